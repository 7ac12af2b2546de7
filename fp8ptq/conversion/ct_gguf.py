"""compressed-tensors -> GGUF (docs/formats.md).

Per Linear, by the config group vLLM would pick:
  exact (codes)  symmetric INT4 / INT8 weights in groups of a multiple of 32 (or per channel, rows a multiple
                 of 32) -> Q4_0 / Q8_0 with the same codes; each group's scale is repeated over its 32-blocks
                 and rounded to fp16 (GGUF's d), the only change (max relative scale error reported: 0 when
                 the scales came from a GGUF). Input-activation quantization has no GGUF form and is dropped.
  dequantized    any other scheme (FP8, asymmetric INT, odd group sizes): compressed-tensors' decompression
                 written as a float matrix (`dtype`).
  quantized      with `--gguf-type` (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0): every matrix (Linears, the embedding,
                 an untied head) gets the GGML type llama.cpp's mix gives it (conversion/gguf_mix.py) and is
                 quantized to it from its float (or decompressed) values -- unless its codes are already
                 that type's (a W4A16 g32 symmetric Linear under Q4_0 stays `exact`). The weight's
                 relative error after gguf-py's own dequantization is recorded.
Float tensors: 1-D (norms, biases) as F32, matrices in `dtype`. KV-cache scales are dropped (reported).
Tensors are planned from headers first (GGUF writes its tensor table before the data), then written one at
a time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fp8ptq.conversion import gguf_mix
from fp8ptq.conversion.gguf_meta import add_metadata, gguf_arch, name_map, to_gguf_rows, to_gguf_values
from fp8ptq.eval.quality import group_scheme_for, read_quantization_config
from fp8ptq.export.compressed_tensors import decompress_linear
from fp8ptq.models.loader import ModelSource, check_finite
from fp8ptq.models.skeleton import build_skeleton
from fp8ptq.ops.ggml import BLOCK, pack_q4_0, pack_q8_0
from fp8ptq.quantization.schemes import handler

LINEAR_KEYS = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "input_scale",
    "weight_g_idx",
)
FLOAT_GGML = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass
class Planned:
    name: str  # HF tensor name (a quantized Linear: its module name + ".weight")
    shape: tuple[int, ...]
    ggml_type: str
    action: str  # exact | quantized | dequantized | kept
    scheme: object = None
    fmt: str | None = None  # compressed-tensors format of a quantized Linear
    why: str = ""
    record: dict = field(default_factory=dict)
    gguf: str = ""  # its GGUF tensor name


def _exact_bits(scheme, shape) -> int | None:
    """4 or 8 when the weights are a symmetric INT grid GGUF's Q4_0 / Q8_0 hold code for code."""
    w = scheme.weights
    codes = None if w is None else handler(w).symmetric_codes(w, shape[1])
    if codes is None or codes[0] not in (4, 8):
        return None
    bits, cols = codes
    return bits if cols % BLOCK == 0 and shape[1] % BLOCK == 0 else None


def plan(src: ModelSource, dtype: torch.dtype, ftype: str | None = None) -> tuple[list[Planned], list[str]]:
    """What each tensor becomes, from the config and headers only; plus the tensors dropped. `ftype`: a
    `--gguf-type` mix (conversion/gguf_mix.py), or None to carry exact codes and write the rest as floats."""
    raw = getattr(src.config, "quantization_config", None)
    qcfg = None if raw is None else read_quantization_config(src, raw)
    model = build_skeleton(src.config)
    planned, dropped, done = [], [], set()
    modules = dict(model.named_modules())
    to_gguf = name_map(src.config)
    tied = not any(n.startswith("lm_head.") for n in src.weight_map)  # as llama.cpp: no output tensor stored

    def mix(name: str, shape) -> tuple[str, str]:
        return gguf_mix.tensor_type(ftype, to_gguf(name), shape, src.config.num_hidden_layers, tied)

    for name, module in modules.items():
        linear = isinstance(module, torch.nn.Linear)
        scheme = group_scheme_for(name, module, qcfg) if linear and qcfg is not None else None
        if scheme is None:
            continue
        shape = (module.out_features, module.in_features)
        bits = _exact_bits(scheme, shape)
        why = "" if scheme.input_activations is None else "input-activation quantization dropped (GGUF is weight-only)"
        fmt = getattr(scheme, "format", None) or qcfg.format
        exact = {4: "Q4_0", 8: "Q8_0"}.get(bits)
        if ftype is not None:
            target, note = mix(f"{name}.weight", shape)
            action = "exact" if target == exact else "kept" if target in ("F16", "F32") else "quantized"
            planned.append(
                Planned(f"{name}.weight", shape, target, action, scheme, fmt, "; ".join(filter(None, (why, note))))
            )
        elif exact:
            planned.append(Planned(f"{name}.weight", shape, exact, "exact", scheme, fmt, why))
        else:
            planned.append(
                Planned(f"{name}.weight", shape, FLOAT_GGML[dtype], "dequantized", scheme, fmt, "no GGUF form")
            )
        done.update(f"{name}.{k}" for k in LINEAR_KEYS)
    for name in src.weight_map:
        if name in done:
            continue
        base = name.rpartition(".")[0]
        if base in modules and name.endswith(("k_scale", "v_scale", "input_scale")):
            dropped.append(name)
            continue
        shape = src.tensor_shape(name)
        if ftype is not None and len(shape) == 2 and name.endswith(".weight"):
            target, note = mix(name, shape)
            planned.append(Planned(name, shape, target, "kept" if target == "F16" else "quantized", why=note))
            continue
        kind = "F32" if len(shape) == 1 else FLOAT_GGML[dtype]
        planned.append(Planned(name, shape, kind, "kept"))
    order = {n: i for i, n in enumerate(model.state_dict())}  # the model's own order: layer by layer
    planned.sort(key=lambda p: order.get(p.name, len(order)))
    for p in planned:
        p.gguf = to_gguf(p.name)
    return planned, dropped


def _data(src: ModelSource, p: Planned, dtype: torch.dtype, importance: dict | None = None) -> np.ndarray:
    """The GGUF bytes (Q4_0 / Q8_0 blocks) or float array of one planned tensor, in llama.cpp's row order."""
    module = p.name.removesuffix(".weight")
    if p.scheme is None:
        weight = check_finite(p.name, src.tensor(p.name))
    else:
        local = {k: src.tensor(f"{module}.{k}") for k in LINEAR_KEYS if src.has(f"{module}.{k}")}
        weight = check_finite(p.name, decompress_linear(local, p.scheme, p.fmt))
    if p.action == "quantized":
        w = to_gguf_rows(p.name, weight.float(), src.config)
        data = gguf_mix.encode(p.ggml_type, w, (importance or {}).get(p.name))
        back = gguf_mix.decode(p.ggml_type, data)
        p.record = {"weight_rel_err": float((back - w).norm() / w.norm().clamp_min(1e-30))}
        return data
    if p.action == "kept":
        weight = to_gguf_values(p.gguf, weight, src.config)
        if p.ggml_type == "F32":
            t = weight.float()
        else:  # F16: a --gguf-type fallback for rows llama.cpp cannot block; else the --dtype
            t = weight.to(torch.float16 if p.ggml_type == "F16" else dtype)
        p.record = {"max_abs_err": float((t.float() - weight.float()).abs().max())}
        return _np(to_gguf_rows(p.name, t, src.config))
    if p.action == "dequantized":
        t = weight.to(dtype)
        p.record = {"max_abs_err": float((t.float() - weight).abs().max())}
        return _np(to_gguf_rows(p.name, t, src.config))
    bits = p.scheme.weights.num_bits
    codes = _codes(local, bits, p.shape)
    scale = local["weight_scale"].float().reshape(p.shape[0], -1)
    scale = scale.repeat_interleave(p.shape[1] // BLOCK // scale.shape[1], dim=1)  # one scale per 32-block
    d = scale.to(torch.float16).float()
    rel = ((d - scale).abs() / scale.abs().clamp_min(torch.finfo(torch.float32).tiny)).max()
    check_finite(p.name + " (fp16 scale)", d)
    back = (codes.float().reshape(p.shape[0], -1, BLOCK) * scale.reshape(p.shape[0], -1, 1)).reshape(p.shape)
    if not torch.equal(back, weight):  # an invariant: the codes are what compressed-tensors decompresses
        raise AssertionError(f"{p.name}: unpacked codes do not reproduce the decompressed weight")
    p.record = {"bits": bits, "scale_fp16_rel_err": float(rel)}
    codes, d = to_gguf_rows(p.name, codes, src.config), to_gguf_rows(p.name, d, src.config)
    return (pack_q4_0 if bits == 4 else pack_q8_0)(codes, d).numpy()


def _codes(local: dict, bits: int, shape) -> torch.Tensor:
    if "weight_packed" in local:
        from compressed_tensors.compressors.pack_quantized import unpack_from_int32

        return unpack_from_int32(local["weight_packed"], bits, torch.Size(shape))
    return local["weight"].to(torch.int8)  # int-quantized: int8 codes as they are


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint16).numpy()  # gguf takes BF16 as raw 16-bit words
    return t.contiguous().numpy()


def _nbytes(p: Planned) -> int:
    if p.ggml_type not in FLOAT_GGML.values():
        return gguf_mix.nbytes(p.ggml_type, p.shape)
    return int(np.prod(p.shape)) * (4 if p.ggml_type == "F32" else 2)


def ct_to_gguf(
    src: ModelSource, out: Path, dtype: torch.dtype, ftype: str | None = None, importance: dict | None = None
) -> dict:
    """Write `src` (a compressed-tensors or float checkpoint) as one GGUF file at `out` (the caller makes it
    atomic); `ftype`: a `--gguf-type` mix, or None (exact codes, other matrices as floats); `importance`:
    HF weight name -> per-column weights of the block search (conversion/importance.py)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    gguf_arch(src.config)  # a typed error for a family or RoPE GGUF cannot take, before any work
    planned, dropped = plan(src, dtype, ftype)
    writer = GGUFWriter(str(out), gguf_arch(src.config))
    pre, pre_why = add_metadata(writer, src.config, src.path, src.label)
    writer.add_quantization_version(2)
    for p in planned:
        qtype = GGMLQuantizationType[p.ggml_type]
        if p.ggml_type not in FLOAT_GGML.values():
            row = (p.shape[0], _nbytes(p) // p.shape[0])
            writer.add_tensor_info(p.gguf, row, np.uint8, _nbytes(p), qtype)
        else:
            np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[p.ggml_type]
            writer.add_tensor_info(p.gguf, p.shape, np_dtype, _nbytes(p), None if p.ggml_type != "BF16" else qtype)
    writer.write_header_to_file(path=Path(out))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    records = []
    for p in planned:
        writer.write_tensor_data(_data(src, p, dtype, importance))
        src.close()
        records.append({"tensor": p.name, "gguf_type": p.ggml_type, "action": p.action, **p.record, "why": p.why})
    writer.close()
    exact = [r for r in records if r["action"] == "exact"]
    summary = {
        "exact": len(exact),
        "exact_q4_0": sum(r["bits"] == 4 for r in exact),
        "exact_q8_0": sum(r["bits"] == 8 for r in exact),
        "worst_scale_fp16_rel_err": max((r["scale_fp16_rel_err"] for r in exact), default=0.0),
        "quantized": sum(r["action"] == "quantized" for r in records),
        "worst_quantized_rel_err": max((r["weight_rel_err"] for r in records if "weight_rel_err" in r), default=0.0),
        "dequantized": sum(r["action"] == "dequantized" for r in records),
        "kept": sum(r["action"] == "kept" for r in records),
        "types": dict(sorted(Counter(r["gguf_type"] for r in records).items())),
        "tokenizer_pre": pre,
        **({"tokenizer_pre_why": pre_why} if pre_why else {}),
    }
    return {"source": str(src.path), "to": "gguf", "dropped": dropped, "summary": summary, "tensors": records}


def check(cfg, fmt: str) -> ModelSource:
    """The compressed-tensors checkpoint opened, and its family one GGUF names, before any output exists."""
    from fp8ptq.models.loader import open_hf_dir

    src = open_hf_dir(cfg.source)
    gguf_arch(src.config)
    return src


def write(cfg, fmt: str, src: ModelSource, tmp: Path) -> dict:
    importance = None
    if cfg.importance is not None:
        from fp8ptq.conversion.importance import collect

        importance = collect(src, cfg.importance, cfg.num_samples, cfg.seq_len)
    report = ct_to_gguf(src, tmp, getattr(torch, cfg.dtype), cfg.gguf_type, importance)
    if importance is not None:
        report["summary"]["importance"] = {"data": cfg.importance, "tokens": cfg.num_samples * cfg.seq_len}
    return report


def describe(report: dict) -> str:
    s = report["summary"]
    parts = []
    if s["exact"] or not s.get("quantized"):
        parts.append(
            f"{s['exact']} exact codes (Q4_0: {s['exact_q4_0']}, Q8_0: {s['exact_q8_0']}; worst fp16 scale "
            f"rounding {s['worst_scale_fp16_rel_err']:.3g})"
        )
    if s.get("quantized"):
        parts.append(f"{s['quantized']} quantized (worst weight rel err {s['worst_quantized_rel_err']:.3g})")
    parts += [f"{s['dequantized']} dequantized", f"{s['kept']} float"]
    types = ", ".join(f"{t} {n}" for t, n in s.get("types", {}).items())
    dropped = f"; dropped {', '.join(report['dropped'])}" if report["dropped"] else ""
    imp = s.get("importance")
    weighted = f"; search weighted by mean x^2 over {imp['tokens']} tokens of {imp['data']}" if imp else ""
    pre = f"; tokenizer.ggml.pre {s['tokenizer_pre']} ({s['tokenizer_pre_why']})" if s.get("tokenizer_pre_why") else ""
    return f"tensors: {', '.join(parts)} (GGML types: {types}){weighted}{dropped}{pre}"
