"""A config field documented once: `documented(default, "help")` is a dataclass field whose metadata holds
the one-line help the CLI shows for its option, and optionally `more` (what the README's option table adds
after it), `shown` (the table's default cell where the value alone would mislead, e.g. "recipe's" for
None) and `cli` (how the option is spelled: `Cli`). The commands are generated from these fields
(cli/fielded.py) and README's quantize option table from the command (cli/options.py), so an option's
name, type, default and help live in one place and cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from fp8ptq.errors import OptionError

MISSING = dataclasses.MISSING
UNSET = "<unset>"  # Cli.default when the command takes the field's own default


@dataclass(frozen=True)
class Cli:
    """How a documented field appears on the command line. The defaults give `--field-name` (a bool:
    `--field-name/--no-field-name`) with the field's type and default."""

    flags: tuple[str, ...] = ()  # the option's names; () -> --field-name
    argument: bool = False  # a positional argument instead of an option
    negated: bool = False  # a bool field set False by the one flag `--no-field-name`
    joined: str | None = None  # a str field given as a repeatable option, its values joined with this
    split: str | None = None  # a tuple[str, ...] field given as one option, split at this (empty parts dropped)
    default: Any = UNSET  # the command's own default (`...`: required) where it differs from the library's
    metavar: str | None = None
    help: str | None = None  # a negated flag's own help (what passing it does), where it reads otherwise
    # the command-line value -> the field's, as parse(value, flag) (e.g. int_list: "1-8" -> (1, ..., 8));
    # the option then takes the type of `default` (str when it is None) and None keeps the field's default
    parse: Callable[[Any, str], Any] | None = None


def documented(
    default: Any = MISSING,
    help: str = "",
    *,
    more: str = "",
    shown: str | None = None,
    factory=MISSING,
    cli: Cli | None = None,
):
    """A dataclasses.field with its documentation: help (the CLI's, one line), more, shown, cli."""
    if not help:
        raise ValueError("a documented field needs its help")
    meta = {"help": help, "more": more, "shown": shown, "cli": cli or Cli()}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _field(cls, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def help_of(cls, name: str) -> str:
    """The CLI help of `cls.name` (KeyError if the field is not documented)."""
    return _field(cls, name).metadata["help"]


def doc_of(cls, name: str) -> dict:
    """{"help", "more", "shown", "cli"} of `cls.name`, or {} when the field carries no documentation."""
    return dict(_field(cls, name).metadata)


def default_of(cls, name: str) -> Any:
    """The field's default (its factory's value for a mutable one)."""
    f = _field(cls, name)
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def int_list(text: str, flag: str) -> tuple[int, ...]:
    """'1-8' or '1,2,4' -> (1, ..., 8) / (1, 2, 4); OptionError naming `flag` otherwise."""
    fix = "write e.g. 1-8 or 1,2,4"
    try:
        if "-" in text and "," not in text:
            lo, hi = (int(x) for x in text.split("-"))
            if hi - lo > 1024:  # checked before the range is built: 1-1000000000 is a typo, not a plan
                raise OptionError(f"{flag} '{text}' spans {hi - lo + 1} values", fix=fix)
            values = tuple(range(lo, hi + 1))
        else:
            values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise OptionError(f"cannot read {flag} '{text}'", fix=fix) from None
    if not values:
        raise OptionError(f"{flag} '{text}' is empty", fix=fix)
    return values


def float_list(text: str, flag: str) -> tuple[float, ...]:
    """'0,1' -> (0.0, 1.0); OptionError naming `flag` for an unreadable or non-finite value."""
    fix = "write e.g. 0,1 or 0.3,0.5"
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise OptionError(f"cannot read {flag} '{text}'", fix=fix) from None
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise OptionError(f"{flag} '{text}' holds {bad[0]}", fix="write finite numbers, e.g. 0,1 or 0.3,0.5")
    return values
