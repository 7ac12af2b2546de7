"""Which checkpoint format a path holds, from its files (docs/formats.md, "Formats fp8ptq inspect tells apart").

gguf                a .gguf file
modelopt            hf_quant_config.json (NVIDIA ModelOpt's export), or quant_method modelopt in config.json
compressed-tensors  quantization_config.quant_method compressed-tensors
hf-fp8              quant_method fp8 with weight_block_size (transformers' fine-grained FP8)
gptq / awq          quant_method gptq / awq in config.json, or a GPTQ quantize_config.json
float               none of these
"""

from __future__ import annotations

import json
from pathlib import Path

from fp8ptq.errors import ModelError

SOURCES = ("gguf", "gptq", "awq", "modelopt", "hf-fp8", "compressed-tensors")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ModelError(f"'{path}' is not JSON ({err})", fix="check the checkpoint's files") from None
    if not isinstance(data, dict):
        raise ModelError(f"'{path}' is not a JSON object", fix="check the checkpoint's files")
    return data


def format_of_config(path: Path, config: dict) -> str:
    """The format a checkpoint directory's config (and side files) declare; 'float' when none."""
    qc = config.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if (path / "hf_quant_config.json").is_file() or method == "modelopt":
        return "modelopt"
    if method == "fp8" and qc.get("weight_block_size"):
        return "hf-fp8"
    if method in ("compressed-tensors", "gptq", "awq"):
        return method
    if not method and (path / "quantize_config.json").is_file():
        return "gptq"  # AutoGPTQ writes its config beside config.json only
    return f"unknown ({method})" if method else "float"


def detect_source(path: Path) -> str:
    """The format of `path`; a ModelError when it is none fp8ptq converts."""
    if not path.exists():
        raise ModelError(f"'{path}' not found", fix="pass a .gguf file or a checkpoint directory")
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf"
        raise ModelError(f"'{path}' is not a .gguf file", fix="pass a .gguf file or a checkpoint directory")
    if not (path / "config.json").is_file():
        raise ModelError(f"'{path}' has no config.json", fix="pass a Hugging Face checkpoint directory")
    fmt = format_of_config(path, read_json(path / "config.json"))
    if fmt not in SOURCES:
        hint = "quantize it with `fp8ptq quantize`, or pass" if fmt == "float" else "pass"
        raise ModelError(
            f"'{path}' is a {fmt} checkpoint, which `convert` does not read",
            fix=f"{hint} a checkpoint in one of: {', '.join(SOURCES)}",
        )
    return fmt


def check_source(path: Path, declared: str | None) -> str:
    """detect_source, confirmed against `--from` when given (a ModelError naming both when they differ)."""
    if declared is not None and declared not in SOURCES:
        from fp8ptq.errors import OptionError

        raise OptionError(f"unknown --from '{declared}'", fix=f"use one of: {', '.join(SOURCES)}")
    found = detect_source(path)
    if declared is not None and declared != found:
        raise ModelError(
            f"--from {declared}, but '{path}' is a {found} checkpoint",
            fix=f"pass --from {found} (or drop --from), or the {declared} checkpoint you meant",
        )
    return found
