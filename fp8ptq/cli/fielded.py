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
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from fp8ptq.cli.common import expand_home, fail
from fp8ptq.errors import Fp8ptqError
from fp8ptq.fields import MISSING, UNSET, Cli, default_of, help_of

FIELDS_ATTR = "__fp8ptq_fields__"


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


def _flags(name: str, cli: Cli) -> tuple[str, ...]:
    if cli.negated:
        return ("--no-" + name.replace("_", "-"),)
    return cli.flags


def _parameter(cls, f: dataclasses.Field, hint) -> inspect.Parameter:
    cli: Cli = f.metadata["cli"]
    default = cli.default if cli.default != UNSET else default_of(cls, f.name)
    annotation, value = _cli_type(hint, ... if default is MISSING else default, cli)
    help = cli.help or f.metadata["help"]
    inner, _ = _optional(hint)
    callback = expand_home if inner is Path else None
    if cli.argument:
        info = typer.Argument(value, help=help, callback=callback, metavar=cli.metavar)
    else:
        info = typer.Option(value, *_flags(f.name, cli), help=help, callback=callback, metavar=cli.metavar)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _field_value(f: dataclasses.Field, hint, value):
    """The command-line value as the field holds it."""
    cli: Cli = f.metadata["cli"]
    if cli.negated:
        return not value
    if cli.joined is not None:
        return cli.joined.join(value)
    if cli.split is not None:
        return tuple(part.strip() for part in value.split(cli.split) if part.strip())
    if isinstance(value, list):
        return tuple(value)
    return value


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


def config_command(cls, *, exclude: tuple[str, ...] = ()):
    """Decorator: `body(cfg, **own)` -> a typer callback taking cls's documented fields (minus `exclude`,
    which the body fills with dataclasses.replace) and then the body's own parameters."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in _documented(cls) if f.name not in exclude]

    def decorate(body: Callable) -> Callable:
        own = list(inspect.signature(body).parameters.values())[1:]
        clash = {p.name for p in own} & {f.name for f in fields}
        if clash:
            raise TypeError(f"{body.__name__}: {sorted(clash)} are generated from {cls.__name__}; drop them")
        own_hints = typing.get_type_hints(body)
        params = [_parameter(cls, f, hints[f.name]) for f in fields]
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=own_hints[p.name]) for p in own]

        def callback(**kwargs):
            values = {f.name: _field_value(f, hints[f.name], kwargs.pop(f.name)) for f in fields}
            try:
                cfg = cls(**values)
            except Fp8ptqError as err:
                fail(err)
            return body(cfg, **kwargs)

        callback.__name__, callback.__qualname__ = body.__name__, body.__qualname__
        callback.__doc__, callback.__module__ = body.__doc__, body.__module__
        callback.__signature__ = inspect.Signature(params)
        callback.__annotations__ = {p.name: p.annotation for p in params}
        mapping = {f.name: (cls, f.name) for f in fields}
        mapping |= {p.name: p.default.fp8ptq_field for p in own if hasattr(p.default, "fp8ptq_field")}
        setattr(callback, FIELDS_ATTR, mapping)
        return callback

    return decorate
