"""transformers' fine-grained FP8 format (DeepSeek-V3 / Qwen3-FP8 releases) -> compressed-tensors block FP8.

Source (transformers 5.23 `FineGrainedFP8Config`, `integrations/finegrained_fp8.py`): config
`quantization_config {quant_method: fp8, activation_scheme: dynamic, weight_block_size: [bn, bk]}`,
per quantized Linear `weight` float8_e4m3fn [out, in] and `weight_scale_inv` [ceil(out/bn), ceil(in/bk)]
(fp32, or UE8M0 powers of two), dequantized as weight * weight_scale_inv (`_dequantize_fp8_weight`: the
name notwithstanding, a multiplier); `modules_to_not_convert` stay float.
Target (compressed-tensors, as vLLM 0.32 reads block FP8): weights `{num_bits 8, type float, strategy
block, block_structure [bn, bk], symmetric}`, activations `{num_bits 8, type float, strategy group,
group_size bk, dynamic}` (what transformers' dynamic scheme computes: one scale per token and bk-group),
format `float-quantized`, tensors `weight` (the same FP8 bytes) and `weight_scale` (the same numbers in
fp32). Nothing is re-quantized: the codes are copied and the scales renamed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fp8ptq.conversion.shards import Converted, Source, finish, rewrite
from fp8ptq.errors import ModelError
from fp8ptq.models.loader import check_finite
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.recipe import QuantArgs

SCALE = "weight_scale_inv"


def _scheme(block: list[int]) -> LinearScheme:
    weights = QuantArgs(num_bits=8, type="float", strategy="block", block_structure=list(block), symmetric=True)
    acts = QuantArgs(num_bits=8, type="float", strategy="group", group_size=block[1], dynamic=True)
    return LinearScheme(weights, acts)


def read_fp8_config(path: Path) -> tuple[dict, list[int]]:
    config = json.loads((path / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    where = path / "config.json"
    block = qc.get("weight_block_size")
    if qc.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise ModelError(
            f"'{where}' is not transformers' block FP8 (quant_method fp8 with weight_block_size [n, k])",
            fix="pass a checkpoint published in that format (e.g. Qwen3-*-FP8), or --from another format",
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelError(
            f"'{where}': activation_scheme {qc.get('activation_scheme')!r} is not converted (only dynamic)",
            fix="convert a checkpoint with dynamic activations",
        )
    return config, [int(b) for b in block]


def _check(name: str, weight: torch.Tensor, scale: torch.Tensor, block: list[int]) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise ModelError(f"tensor '{name}.weight' is {weight.dtype}, not float8_e4m3fn", fix="check the checkpoint")
    want = (math.ceil(weight.shape[0] / block[0]), math.ceil(weight.shape[1] / block[1]))
    if tuple(scale.shape) != want:
        raise ModelError(
            f"tensor '{name}.{SCALE}' has shape {tuple(scale.shape)}, but weight {tuple(weight.shape)} in blocks "
            f"{block} needs {want}",
            fix="the scales do not match weight_block_size: check the checkpoint's config",
        )


def hf_fp8_to_ct(path: Path, tmp: Path) -> dict:
    """Write the compressed-tensors checkpoint into `tmp`, one source shard at a time; returns the report."""
    config, block = read_fp8_config(path)
    scheme = _scheme(block)

    def convert(src: Source, base: str) -> Converted:
        weight, scale = src.get(f"{base}.weight"), src.get(f"{base}.{SCALE}")
        _check(base, weight, scale, block)
        return Converted(
            {f"{base}.weight": weight, f"{base}.weight_scale": check_finite(f"{base}.{SCALE}", scale.float())},
            {"tensor": f"{base}.weight", "action": "exact", "block": block},
            scheme,
        )

    src = Source(path)
    records, schemes = rewrite(src, tmp, f".{SCALE}", (".weight", f".{SCALE}"), convert)
    report = {"source": str(path), "to": "compressed-tensors", "from": "hf-fp8", "tensors": records}
    report["summary"] = {"exact": len(records), "exact_fp8_block": len(records), "block": block}
    return finish(src, tmp, config, schemes, report)


def check(cfg, fmt: str) -> None:
    read_fp8_config(cfg.source)  # a typed error before any output exists


def write(cfg, fmt: str, checked: None, tmp: Path) -> dict:
    return hf_fp8_to_ct(cfg.source, tmp)


def describe(report: dict) -> str:
    s = report["summary"]
    return f"tensors: {s['exact']} exact (FP8 block {s['block']}: same codes, weight_scale_inv -> weight_scale)"
