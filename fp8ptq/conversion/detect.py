"""Which checkpoint format a directory holds, from its files (docs/formats.md, "Formats fp8ptq inspect tells
apart"); shared by `convert` (conversion/registry.py: which of these it reads) and `inspect`.

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
