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
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8ptq.convert.gguf_ct import quantization_config
from fp8ptq.errors import ModelError
from fp8ptq.io import write_json_atomic
from fp8ptq.models.loader import _weight_map, check_finite
from fp8ptq.quantize.schemes import LinearScheme
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
    weight_map = _weight_map(path)
    modules = sorted(n.removesuffix(f".{SCALE}") for n in weight_map if n.endswith(f".{SCALE}"))
    records, out_map, total = [], {}, 0
    shards = sorted(set(weight_map.values()))
    for i, shard in enumerate(shards):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path / shard), framework="pt") as h:
            for name in h.keys():
                base = name.rpartition(".")[0]
                if name.endswith(f".{SCALE}"):
                    continue  # written with its weight
                t = h.get_tensor(name)
                if name.endswith(".weight") and base in modules:
                    scale = _tensor(path, weight_map, f"{base}.{SCALE}")
                    _check(base, t, scale, block)
                    out[name] = t
                    out[f"{base}.weight_scale"] = check_finite(f"{base}.{SCALE}", scale.float())
                    records.append({"tensor": name, "action": "exact", "block": block})
                else:
                    out[name] = check_finite(name, t)
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(out, str(tmp / file), metadata={"format": "pt"})
        out_map.update({k: file for k in out})
        total += (tmp / file).stat().st_size
    write_json_atomic(
        tmp / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(out_map.items()))},
        trailing_newline=True,
    )
    scheme = _scheme(block)
    config["quantization_config"] = quantization_config({"block": (scheme, modules)})
    write_json_atomic(tmp / "config.json", config, trailing_newline=True)
    for f in path.iterdir():  # tokenizer, generation config, chat template ...
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    report = {"source": str(path), "to": "compressed-tensors", "from": "hf-fp8", "tensors": records}
    report["summary"] = {"exact": len(records), "exact_fp8_block": len(records), "block": block}
    write_json_atomic(tmp / "conversion.json", report, trailing_newline=True)
    return report


def _tensor(path: Path, weight_map: dict[str, str], name: str) -> torch.Tensor:
    with safe_open(str(path / weight_map[name]), framework="pt") as h:
        return h.get_tensor(name)
