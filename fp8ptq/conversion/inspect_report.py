"""What `fp8ptq inspect` reports: a checkpoint's format, schemes and size, and the lint's findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Finding:
    level: str  # error | warning | info
    code: str
    where: str
    message: str


@dataclass(frozen=True)
class InspectReport:
    """What `inspect` says of a checkpoint (`--json`: results.to_json of it). Directory fields: model_type,
    schemes (label -> Linears), linears, linears_unquantized (None unless compressed-tensors); GGUF
    fields: architecture, tensor_types (GGUF type -> tensors)."""

    SCHEMA: ClassVar[str] = "inspect"
    SCHEMA_VERSION: ClassVar[int] = 1

    path: str
    format: str
    size_bytes: int
    bits_per_param: float
    findings: tuple[Finding, ...] = ()
    model_type: str | None = None
    schemes: dict[str, int] = field(default_factory=dict)
    linears: int | None = None
    linears_unquantized: int | None = None
    architecture: str | None = None
    tensor_types: dict[str, int] = field(default_factory=dict)
    errors: int = field(init=False, default=0)  # findings at level error (inspect exits 1 when > 0)

    def __post_init__(self):
        object.__setattr__(self, "errors", sum(f.level == "error" for f in self.findings))
