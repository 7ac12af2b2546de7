"""Typed results and the JSON they become.

A library entry point returns a frozen dataclass (or a pydantic model); the CLI renders its
attributes and `--json` prints `to_json(result)`: the fields, after two keys that say what the
object is — `schema` (the class's SCHEMA) and `schema_version` (its SCHEMA_VERSION, raised when a
field is renamed, removed or changes meaning; adding a field with a default does not raise it). A
file written from a result is read back by `from_json` / `read_json`: validated against the class by
pydantic (its TypeAdapter over the dataclass, nested dataclasses and tuples included), so a renamed
key, a missing field or another kind of file is a typed error naming the file and the field — never
a KeyError deep in the caller. Files written before the schema keys existed (schema_version absent)
are read as version 1 when they validate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TypeVar

from fp8ptq.errors import Fp8ptqError, ModelError

T = TypeVar("T")
SCHEMA_KEYS = ("schema", "schema_version")


def to_json(result) -> dict:
    """`result` (a dataclass with SCHEMA / SCHEMA_VERSION) as a JSON-able dict, schema keys first."""
    cls = type(result)
    data = asdict(result) if is_dataclass(result) else result.model_dump(mode="json")
    return {"schema": cls.SCHEMA, "schema_version": cls.SCHEMA_VERSION, **data}


def from_json(data, cls: type[T], *, where: str, error: type[Fp8ptqError] = ModelError, fix: str = "") -> T:
    """`data` (parsed JSON) validated as `cls`; `error` naming `where` and the first bad field otherwise."""
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(data, dict):
        raise error(f"'{where}' holds a JSON {type(data).__name__}, not fp8ptq's '{cls.SCHEMA}' object", fix=fix)
    schema, version = data.get("schema", cls.SCHEMA), data.get("schema_version", 1)
    if schema != cls.SCHEMA:
        raise error(f"'{where}' holds schema '{schema}', not '{cls.SCHEMA}'", fix=fix)
    if not isinstance(version, int) or version > cls.SCHEMA_VERSION:
        raise error(
            f"'{where}' has '{cls.SCHEMA}' schema_version {version!r}; this fp8ptq reads up to {cls.SCHEMA_VERSION}",
            fix="upgrade fp8ptq, or write the file again with this version",
        )
    try:
        return TypeAdapter(cls).validate_python({k: v for k, v in data.items() if k not in SCHEMA_KEYS})
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise error(f"'{where}' is not a valid '{cls.SCHEMA}' file: {loc}: {first['msg']}{more}", fix=fix) from None


def read_json(path: Path, cls: type[T], *, error: type[Fp8ptqError] = ModelError, fix: str = "") -> T:
    """The file at `path` validated as `cls` (from_json); unreadable or non-JSON files are `error` too."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise error(f"cannot read '{path}' ({err})", fix=fix) from None
    return from_json(data, cls, where=str(path), error=error, fix=fix)
