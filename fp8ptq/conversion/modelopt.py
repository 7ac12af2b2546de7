"""NVIDIA ModelOpt checkpoints (hf_quant_config.json) -> compressed-tensors with the same codes and scales.

Source (ModelOpt 0.2x `export_hf_checkpoint`, as vLLM 0.32 `quantization/modelopt.py` and
`model_loader/weight_utils.py` read it): `hf_quant_config.json {producer: {name: modelopt}, quantization:
{quant_algo, kv_cache_quant_algo, exclude_modules[, group_size]}}` (or the same keys in config.json's
quantization_config with quant_method modelopt). Per quantized Linear:
  FP8                        weight float8_e4m3fn, weight_scale fp32 scalar (a multiplier: w = q * s),
                             input_scale fp32 scalar (static: x / input_scale is quantized)
  FP8_PER_CHANNEL_PER_TOKEN  weight_scale fp32 [out], activations dynamic per token (no input_scale)
  NVFP4                      weight uint8 [out, in/2] (two E2M1 codes per byte, low nibble first),
                             weight_scale float8_e4m3fn [out, in/16], weight_scale_2 fp32 scalar and
                             input_scale fp32 scalar, w = fp4(q) * weight_scale * weight_scale_2
  FP8 KV cache               self_attn.k_proj.k_scale / self_attn.v_proj.v_scale
Target (compressed-tensors 0.17 / 0.20): FP8 `float-quantized` {tensor or channel weights; static tensor or
dynamic token inputs} with the same FP8 bytes and fp32 scales; NVFP4 `nvfp4-pack-quantized` with the same
packed bytes and FP8 group scales, and the global scales in compressed-tensors' reciprocal convention
(weight_global_scale = 1 / weight_scale_2, input_global_scale = 1 / input_scale: CT divides by them), the
one place a number changes (fp32 reciprocal rounding, reported); KV scales as self_attn.k_scale/v_scale.
"""

from __future__ import annotations

import torch

from fp8ptq.conversion.shards import Converted, Source, finish, rewrite
from fp8ptq.errors import ModelError
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.recipe import QuantArgs

ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4")
OWNED = (".weight", ".weight_scale", ".input_scale", ".weight_scale_2")


def read_config(path, config: dict, method: str = "modelopt") -> dict:
    from fp8ptq.conversion.detect import read_json

    where = path / "hf_quant_config.json"
    if where.is_file():
        q = read_json(where).get("quantization") or {}
    else:
        where, q = path / "config.json", config.get("quantization_config") or {}
    algo = str(q.get("quant_algo", "")).upper()
    if algo not in ALGOS:
        raise ModelError(
            f"'{where}': ModelOpt quant_algo {algo or None!r} is not converted",
            fix=f"convert a ModelOpt checkpoint with quant_algo one of {', '.join(ALGOS)}",
        )
    kv = q.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise ModelError(f"'{where}': kv_cache_quant_algo {kv!r} is not converted", fix="convert FP8 or no KV cache")
    group = int(q.get("group_size", 16))
    if algo == "NVFP4" and group != 16:
        raise ModelError(f"'{where}': NVFP4 group_size {group}", fix="NVFP4 groups are 16 wide")
    return {"algo": algo, "kv": kv}


def _schemes(algo: str) -> LinearScheme:
    if algo == "NVFP4":
        w = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
        a = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local")
        return LinearScheme(w, a)
    if algo == "FP8":
        w = QuantArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
        return LinearScheme(w, QuantArgs(num_bits=8, type="float", strategy="tensor", symmetric=True))
    w = QuantArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    return LinearScheme(w, QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True))


def _scalar(src: Source, name: str) -> torch.Tensor:
    t = src.get(name).float()
    if t.numel() != 1 or not bool(torch.isfinite(t).all()) or float(t) <= 0:
        raise ModelError(f"tensor '{name}' is {t.flatten()[:4].tolist()}, not one positive number", fix="check it")
    return t.reshape(1)


def _module(src: Source, name: str, algo: str) -> Converted:
    w = src.get(f"{name}.weight")
    want = torch.uint8 if algo == "NVFP4" else torch.float8_e4m3fn
    if w.dtype != want:
        raise ModelError(f"tensor '{name}.weight' is {w.dtype}, not {want} ({algo})", fix="check the quant_algo")
    scale = src.get(f"{name}.weight_scale")
    scheme = _schemes(algo)
    if algo == "NVFP4":
        ws2, inp = _scalar(src, f"{name}.weight_scale_2"), _scalar(src, f"{name}.input_scale")
        if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (w.shape[0], w.shape[1] * 2 // 16):
            raise ModelError(
                f"tensor '{name}.weight_scale' is {scale.dtype} {tuple(scale.shape)}, not float8_e4m3fn "
                f"{(w.shape[0], w.shape[1] * 2 // 16)} (one per 16 weights)",
                fix="check the checkpoint's NVFP4 layout",
            )
        g = 1.0 / ws2
        out = {"weight_packed": w, "weight_scale": scale, "weight_global_scale": g, "input_global_scale": 1.0 / inp}
        err = float(((1.0 / g) - ws2).abs().max() / ws2.abs().max())
        rec = {"action": "exact", "algo": algo, "global_scale_reciprocal_rel_err": err}
    else:
        if algo == "FP8":
            scale, inp = _scalar(src, f"{name}.weight_scale"), _scalar(src, f"{name}.input_scale")
            out = {"weight": w, "weight_scale": scale, "input_scale": inp}
        else:
            scale = scale.float().reshape(-1, 1)
            if scale.shape[0] != w.shape[0]:
                raise ModelError(f"tensor '{name}.weight_scale' has {scale.shape[0]} rows, not {w.shape[0]}", fix="")
            out = {"weight": w, "weight_scale": scale}
        rec = {"action": "exact", "algo": algo}
    return Converted({f"{name}.{k}": v for k, v in out.items()}, rec, scheme)


def modelopt_to_ct(path, tmp) -> dict:
    """Write the compressed-tensors checkpoint of a ModelOpt directory into `tmp`; returns the report."""
    from fp8ptq.conversion.detect import read_json

    config = read_json(path / "config.json")
    q = read_config(path, config)
    src = Source(path)
    anchor = ".weight_scale"  # quantized Linears have one; float ones (exclude_modules) do not
    records, schemes = rewrite(src, tmp, anchor, OWNED, lambda s, n: _module(s, n, q["algo"]))
    kv = _rename_kv(tmp)
    summary = {"exact": len(records), "algo": q["algo"], "kv_scales": kv}
    summary["worst_global_scale_rel_err"] = max(
        (r.get("global_scale_reciprocal_rel_err", 0) for r in records), default=0
    )
    report = {"source": str(path), "to": "compressed-tensors", "from": "modelopt", "summary": summary}
    report["tensors"] = records
    kv_args = QuantArgs(num_bits=8, type="float", strategy="tensor", symmetric=True) if kv else None
    return finish(src, tmp, config, schemes, report, None if kv_args is None else kv_args.model_dump(mode="json"))


def _rename_kv(tmp) -> int:
    """self_attn.k_proj.k_scale -> self_attn.k_scale (where compressed-tensors and fp8ptq keep KV scales)."""
    import json

    from safetensors.torch import load_file, save_file

    from fp8ptq.io import write_json_atomic

    index = json.loads((tmp / "model.safetensors.index.json").read_text())
    moved = {n: n.replace(".k_proj.k_scale", ".k_scale").replace(".v_proj.v_scale", ".v_scale")
             for n in index["weight_map"] if n.endswith((".k_proj.k_scale", ".v_proj.v_scale"))}  # fmt: skip
    for shard in sorted({index["weight_map"][n] for n in moved}):
        tensors = load_file(str(tmp / shard))
        tensors = {moved.get(k, k): v.float().reshape(1) if k in moved else v for k, v in tensors.items()}
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
    index["weight_map"] = dict(sorted({moved.get(k, k): v for k, v in index["weight_map"].items()}.items()))
    write_json_atomic(tmp / "model.safetensors.index.json", index, trailing_newline=True)
    return len(moved)


def check(cfg, fmt: str) -> None:
    from fp8ptq.conversion.detect import read_json

    read_config(cfg.source, read_json(cfg.source / "config.json"))  # a typed error before any output


def write(cfg, fmt: str, checked: None, tmp) -> dict:
    return modelopt_to_ct(cfg.source, tmp)


def describe(report: dict) -> str:
    s = report["summary"]
    extra = f", {s['kv_scales']} KV scales" if s["kv_scales"] else ""
    if s["algo"] == "NVFP4":
        extra += f"; global scales inverted, worst rel err {s['worst_global_scale_rel_err']:.3g}"
    return f"tensors: {s['exact']} exact (ModelOpt {s['algo']}: same codes and scales{extra})"
