"""`fp8ptq inspect` of a .gguf file: which of its tensor types compressed-tensors carries exactly, and
whether the file agrees with its own metadata (as quantize checks it before any work)."""

from __future__ import annotations

from pathlib import Path

from fp8ptq.conversion.inspect_report import Finding, InspectReport
from fp8ptq.errors import ModelError
from fp8ptq.models import gguf


def inspect_gguf(path: Path) -> InspectReport:
    """`fp8ptq inspect` of a .gguf file: its tensor types, size and what a conversion carries exactly."""
    reader, k_types = gguf.open_reader(path), gguf.K_TYPES
    types: dict[str, int] = {}
    params = 0
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        params += int(t.n_elements)
    carried = sorted(k for k in types if k in k_types)
    other = sorted(k for k in types if k not in gguf.EXACT_TYPES and k not in gguf.FLOAT_TYPES and k not in k_types)
    findings = []
    if carried:
        findings.append(
            Finding(
                "info",
                "gguf-k-quant",
                str(path),
                f"types {carried}: `convert --to compressed-tensors` carries their Linears as INT8 group 32, "
                "re-rounded (the error is reported per tensor)",
            )
        )
    if other:
        findings.append(
            Finding("info", "gguf-requantize", str(path), f"types {other} have no exact compressed-tensors form")
        )
    try:  # the file against its own metadata, as quantize checks it
        gguf.check_supported(gguf.gguf_architecture(reader))
        gguf.check_gguf(path)
    except ModelError as err:
        code = "gguf-incomplete" if "transformers' GGUF loader" not in err.message else "gguf-architecture"
        findings.append(Finding("error", code, str(path), err.message))
    size = path.stat().st_size
    return InspectReport(
        path=str(path),
        format="gguf",
        architecture=gguf.gguf_architecture(reader),
        tensor_types=types,
        size_bytes=size,
        bits_per_param=8 * size / max(params, 1),
        findings=tuple(findings),
    )
