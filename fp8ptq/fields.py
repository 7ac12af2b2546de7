"""A config field documented once (issue 34 item 5): `documented(default, "help")` is a dataclass field
whose metadata holds the one-line help the CLI shows for its option, and optionally `more` (what the
README's option table adds after it) and `shown` (the table's default cell where the value alone would
mislead, e.g. "recipe's" for None). The CLI's options take `help_of(Config, name)`; README's quantize
option table is rendered from the command (cli/options.py), so help, table and defaults cannot disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MISSING = dataclasses.MISSING


def documented(default: Any = MISSING, help: str = "", *, more: str = "", shown: str | None = None, factory=MISSING):
    """A dataclasses.field with its documentation: help (the CLI's, one line), more, shown."""
    if not help:
        raise ValueError("a documented field needs its help")
    meta = {"help": help, "more": more, "shown": shown}
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
    """{"help", "more", "shown"} of `cls.name`, or {} when the field carries no documentation."""
    return dict(_field(cls, name).metadata)


def default_of(cls, name: str) -> Any:
    """The field's default (its factory's value for a mutable one)."""
    f = _field(cls, name)
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
