"""Commands generated from config dataclasses: each documented field (fp8ptq.fields.documented) becomes
one typer parameter whose name, type, default and help are the field's, so no command lists an option
and then lists it again to build its config.

    @app.command()
    @config_command(InspectConfig)
    def inspect(cfg: InspectConfig, json_out: bool = typer.Option(False, "--json")):
        ...

The body receives the config built from the generated parameters, then its own parameters (flags of
the command alone, such as --json). An own parameter that fills a field of another config takes that
field's help and default with `field_option`. `fields_of(callback)` maps every parameter that came from
a field to its (class, field): README's option table and the house test read it.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from fp8ptq.cli.common import expand_home, fail
from fp8ptq.errors import Fp8ptqError, OptionError
from fp8ptq.fields import MISSING, UNSET, Cli, default_of, help_of

FIELDS_ATTR = "__fp8ptq_fields__"
SPELLING_ATTR = "__fp8ptq_cli__"
CHOICES_ATTR = "__fp8ptq_choices__"


def _documented(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _optional(hint) -> tuple[Any, bool]:
    """(X, True) for `X | None`, else (hint, False)."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _cli_type(hint, default, cli: Cli):
    """The parameter's annotation and default on the command line for a field of type `hint`."""
    if cli.parse is not None:
        return (Optional[str] if default is None else type(default)), default
    if cli.negated:
        return bool, False
    if cli.joined is not None:
        return List[str], [default]
    if cli.split is not None:
        return str, default if default is ... else cli.split.join(default)
    inner, optional = _optional(hint)
    if typing.get_origin(inner) is tuple:
        return List[typing.get_args(inner)[0]], list(default) if default is not ... else ...
    return (Optional[inner] if optional else inner), default


def flag_of(name: str, cli: Cli) -> str:
    """The option's name in messages: its first flag."""
    return (_flags(name, cli) or ("--" + name.replace("_", "-"),))[0].split("/")[0]


def _flags(name: str, cli: Cli) -> tuple[str, ...]:
    if cli.negated:
        return ("--no-" + name.replace("_", "-"),)
    return cli.flags


def _parameter(cls, f: dataclasses.Field, hint, cli: Cli) -> inspect.Parameter:
    default = cli.default if cli.default != UNSET else None if cli.parse else default_of(cls, f.name)
    annotation, value = _cli_type(hint, ... if default is MISSING else default, cli)
    help = cli.help or f.metadata["help"]
    inner, _ = _optional(hint)
    callback = expand_home if inner is Path else None
    if cli.argument:
        info = typer.Argument(value, help=help, callback=callback, metavar=cli.metavar)
    else:
        info = typer.Option(value, *_flags(f.name, cli), help=help, callback=callback, metavar=cli.metavar)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _field_value(cls, f: dataclasses.Field, value, cli: Cli):
    """The command-line value as the field holds it."""
    if cli.parse is not None:
        return default_of(cls, f.name) if value is None else cli.parse(value, flag_of(f.name, cli))
    if cli.negated:
        return not value
    if cli.joined is not None:
        return cli.joined.join(value)
    if cli.split is not None:
        return tuple(part.strip() for part in value.split(cli.split) if part.strip())
    if isinstance(value, list):
        return tuple(value)
    return value


@dataclass(frozen=True)
class Part:
    """Fields of a second config a command also takes (e.g. `spec recommend`'s measuring options): the
    body receives their values as a dict, to build that config where it needs one."""

    cls: type
    fields: tuple[str, ...]
    cli: dict[str, Cli] = dataclasses.field(default_factory=dict)  # this command's spelling, where it differs


class _Fields:
    """The documented fields of one config a command takes, with this command's spelling of each."""

    def __init__(self, cls, names, spelling: dict[str, Cli]):
        hints = typing.get_type_hints(cls)
        self.cls = cls
        self.fields = [f for f in _documented(cls) if names is None or f.name in names]
        if names is not None and len(self.fields) != len(names):
            missing = set(names) - {f.name for f in self.fields}
            raise TypeError(f"{cls.__name__} has no documented field {sorted(missing)}")
        self.cli = {f.name: spelling.get(f.name, f.metadata["cli"]) for f in self.fields}
        self.params = [_parameter(cls, f, hints[f.name], self.cli[f.name]) for f in self.fields]

    def values(self, kwargs: dict) -> dict:
        return {f.name: _field_value(self.cls, f, kwargs.pop(f.name), self.cli[f.name]) for f in self.fields}


def field_option(cls, name: str, *flags: str, **overrides):
    """A typer.Option for an own parameter that fills `cls.name`: the field's default and help."""
    kwargs = {"help": help_of(cls, name), **overrides}
    default = kwargs.pop("default", default_of(cls, name))
    info = typer.Option(default, *flags, **kwargs)
    info.fp8ptq_field = (cls, name)
    return info


def fields_of(callback: Callable) -> dict[str, tuple[type, str]]:
    """{parameter: (config class, field)} of a command's callback (empty for a hand-written one)."""
    return dict(getattr(callback, FIELDS_ATTR, {}))


def spelling_of(callback: Callable) -> dict[str, Cli]:
    """{parameter: the Cli it was generated with} of a generated command's callback."""
    return dict(getattr(callback, SPELLING_ATTR, {}))


def _own(body: Callable, skip: int) -> list[inspect.Parameter]:
    """The body's own parameters after its first `skip` (the configs), keyword-only, annotations resolved."""
    hints = typing.get_type_hints(body)
    own = list(inspect.signature(body).parameters.values())[skip:]
    return [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name]) for p in own]


def _as_command(callback: Callable, body: Callable, params: list, fields: dict, spelling: dict) -> Callable:
    """`callback` dressed as typer reads `body`: its name, help and signature `params`, plus the record of
    which parameter fills which field (fields_of) and how it is spelled (spelling_of)."""
    callback.__name__, callback.__qualname__ = body.__name__, body.__qualname__
    callback.__doc__, callback.__module__ = body.__doc__, body.__module__
    callback.__signature__ = inspect.Signature(params)
    callback.__annotations__ = {p.name: p.annotation for p in params}
    setattr(callback, FIELDS_ATTR, fields)
    setattr(callback, SPELLING_ATTR, spelling)
    return callback


def config_command(
    cls,
    *,
    exclude: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    cli: dict[str, Cli] | None = None,
    part: Part | None = None,
):
    """Decorator: `body(cfg, **own)` -> a typer callback taking cls's documented fields (`only` those, or
    all minus `exclude`, which the body fills with dataclasses.replace; `cli`: this command's spelling where
    it differs from the field's), then `part`'s fields (the body is then `body(cfg, part_values, **own)`),
    then the body's own parameters."""
    names = only if only is not None else tuple(f.name for f in _documented(cls) if f.name not in exclude)
    main = _Fields(cls, names, cli or {})
    extra = _Fields(part.cls, part.fields, part.cli) if part is not None else None

    def decorate(body: Callable) -> Callable:
        own = _own(body, 1 if part is None else 2)
        generated = main.params + (extra.params if extra else [])
        clash = {p.name for p in own} & {p.name for p in generated}
        if clash or len({p.name for p in generated}) != len(generated):
            raise TypeError(f"{body.__name__}: {sorted(clash)} are generated from the config fields; drop them")

        def callback(**kwargs):
            try:
                cfg = cls(**main.values(kwargs))
                parts = () if extra is None else (extra.values(kwargs),)
            except Fp8ptqError as err:
                fail(err)
            return body(cfg, *parts, **kwargs)

        mapping = {f.name: (cls, f.name) for f in main.fields}
        mapping |= {f.name: (part.cls, f.name) for f in (extra.fields if extra else [])}
        mapping |= {p.name: p.default.fp8ptq_field for p in own if hasattr(p.default, "fp8ptq_field")}
        spelling = main.cli | (extra.cli if extra else {})
        return _as_command(callback, body, generated + own, mapping, spelling)

    return decorate


def choice_command(choices: dict[str, type], *, flag: str, default: str, help: str):
    """Decorator for one command over several configs, chosen by `flag` (`draft-train --kind model |
    eagle3`): `body(cfg, **own)` with cfg the chosen config. An option two configs share takes one
    spelling; where their defaults differ it defaults to None ("the kind's") and its help states each."""
    names = list(choices)
    by_field: dict[str, list[tuple[type, dataclasses.Field]]] = {}
    for cls in choices.values():
        for f in _documented(cls):
            by_field.setdefault(f.name, []).append((cls, f))
    params, kind_default = [], set()  # kind_default: the options whose default is the chosen kind's
    for name, owners in by_field.items():
        cls, f = owners[0]
        defaults = [default_of(c, name) for c, _ in owners]
        if len(set(map(repr, defaults))) == 1:
            params.append(_parameter(cls, f, typing.get_type_hints(cls)[name], f.metadata["cli"]))
            continue
        kind_default.add(name)
        kinds = [k for k in names for c, _ in owners if choices[k] is c]
        stated = "; ".join(f"{'default' if i == 0 else k} {d}" for i, (k, d) in enumerate(zip(kinds, defaults)))
        inner, _ = _optional(typing.get_type_hints(cls)[name])
        info = typer.Option(None, *_flags(name, f.metadata["cli"]), help=f"{f.metadata['help']} ({stated})")
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=Optional[inner]))
    selector = inspect.Parameter(
        flag.lstrip("-").replace("-", "_"),
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(default, flag, help=help),
        annotation=str,
    )
    params.insert(2, selector)

    def decorate(body: Callable) -> Callable:

        def callback(**kwargs):
            kind = kwargs.pop(selector.name)
            given = {name: kwargs.pop(name) for name in by_field}
            try:
                if kind not in choices:
                    raise OptionError(f"unknown {flag} '{kind}'", fix=f"use {' or '.join(names)}: {help}")
                cls = choices[kind]
                values = {}
                for f in _documented(cls):
                    value = given[f.name]
                    if f.name in kind_default and value is None:
                        continue  # the kind's own default
                    values[f.name] = value if f.name in kind_default else _field_value(cls, f, value, f.metadata["cli"])
                cfg = cls(**values)
            except Fp8ptqError as err:
                fail(err)
            return body(cfg, **kwargs)

        fields = {name: (owners[0][0], name) for name, owners in by_field.items()}
        spelling = {name: owners[0][1].metadata["cli"] for name, owners in by_field.items()}
        setattr(callback, CHOICES_ATTR, dict(choices))
        return _as_command(callback, body, params + _own(body, 1), fields, spelling)

    return decorate
