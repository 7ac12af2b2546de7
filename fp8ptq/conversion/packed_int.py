"""GPTQ and AWQ checkpoints -> compressed-tensors `pack-quantized` INT, carrying codes, scales and zero points.

Both formats dequantize a Linear as W[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)] with unsigned codes q and
zero points z in [0, 2^bits) (layouts in fp8ptq/ops/int_pack.py). compressed-tensors (0.17 / 0.20,
`PackedQuantizationCompressor`) stores signed codes q - 2^(bits-1) and, when asymmetric, zero points
z - 2^(bits-1) packed along the output dim, and computes (q_ct - z_ct) * s: the same numbers. The
converter checks each module: compressed-tensors' decompression must equal the source's dequantization
bit for bit (an internal invariant; the conversion fails otherwise).

GPTQ (`quant_method: gptq`; config.json's quantization_config or quantize_config.json):
  - `sym: true` -> symmetric CT (vLLM 0.32 reads GPTQ sym as uint4b8 / uint8b128 and ignores qzeros);
    the zero points must then all be 2^(bits-1), else the layout does not match the config (ModelError).
    `sym: false` -> asymmetric CT with zero points (vLLM's CT WNA16 runs uint4 + zero points).
  - AutoGPTQ's v1 format (`checkpoint_format: gptq`, the default) stores z - 1; GPTQModel's
    `gptq_v2` stores z. A v1 zero of 0 (stored -1, wrapped to 2^bits - 1) reads as 2^bits, which no
    bits-wide grid holds: refused with the tensor named.
  - `g_idx`: i // group_size (no act-order, or desc_act with static groups) is dropped. Another order
    (desc_act with dynamic groups) has no form compressed-tensors 0.20 or vLLM 0.32 reads (both removed
    group activation ordering: vLLM's CompressedTensorsConfig and auto_gptq refuse it at load), so such
    a fused group is dequantized to `dtype` and reported.
AWQ (`quant_method: awq`, `version: gemm`, `zero_point: true`): asymmetric CT with zero points.
"""

from __future__ import annotations

import torch

from fp8ptq.conversion.shards import Converted, Source, finish, rewrite
from fp8ptq.errors import ModelError
from fp8ptq.export.compressed_tensors import compress_linear, ct_scheme, decompress_linear
from fp8ptq.ops.int_pack import AWQ_REVERSE, trivial_g_idx, unpack_cols, unpack_rows
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.quantization.weights import export_format
from fp8ptq.recipe import QuantArgs

OWNED = (".qweight", ".qzeros", ".scales", ".g_idx")
FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}
FUSED.update({"k_proj": FUSED["q_proj"], "v_proj": FUSED["q_proj"], "up_proj": FUSED["gate_proj"]})


def read_config(path, config: dict, method: str) -> dict:
    """The source's quantization settings (bits, group_size, sym, v1, version), checked."""
    from fp8ptq.conversion.detect import read_json

    qc = dict(config.get("quantization_config") or {})
    if not qc and (path / "quantize_config.json").is_file():
        qc = read_json(path / "quantize_config.json")
    where = path / "config.json"
    bits = qc.get("bits", qc.get("w_bit"))
    if bits not in (2, 4, 8):
        raise ModelError(f"'{where}': {method} bits {bits!r} are not converted", fix="convert a 2-, 4- or 8-bit model")
    out = {"bits": int(bits), "group_size": int(qc.get("group_size", qc.get("q_group_size", -1)))}
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelError(f"'{where}': GPTQ checkpoint_format {fmt!r}", fix="convert a gptq or gptq_v2 checkpoint")
        out.update(sym=bool(qc.get("sym", True)), v1=fmt == "gptq")
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or not qc.get("zero_point", True):
            raise ModelError(
                f"'{where}': AWQ version {version!r} zero_point {qc.get('zero_point')!r} is not converted",
                fix="convert an AWQ GEMM checkpoint with zero points (AutoAWQ's default)",
            )
        out.update(sym=False, v1=False)
    return out


def _grid(name: str, src: Source, q: dict, method: str):
    """(codes [out, in], zeros [out, G] or None, scales fp32 [out, G], g_idx [in], group size) of a module."""
    bits, words = q["bits"], src.get(f"{name}.qweight")
    if words.dtype != torch.int32:
        raise ModelError(f"tensor '{name}.qweight' is {words.dtype}, not int32", fix="check the checkpoint")
    if method == "gptq":
        codes = unpack_rows(words, bits).T
        zeros = unpack_cols(src.get(f"{name}.qzeros"), bits).T + int(q["v1"])
    else:
        codes = unpack_cols(words, bits, AWQ_REVERSE).T
        zeros = unpack_cols(src.get(f"{name}.qzeros"), bits, AWQ_REVERSE).T
    scales = src.get(f"{name}.scales").float().T
    out_f, in_f = codes.shape
    groups = scales.shape[1]
    if tuple(scales.shape) != (out_f, groups) or tuple(zeros.shape) != (out_f, groups) or in_f % groups:
        raise ModelError(
            f"tensors of '{name}' do not match: codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, "
            f"zeros {tuple(zeros.shape)} (as [out, groups])",
            fix=f"check the checkpoint's bits ({bits}) and layout ({method})",
        )
    gs = in_f // groups
    g_idx = src.get(f"{name}.g_idx").long() if src.has(f"{name}.g_idx") else torch.arange(in_f) // gs
    if g_idx.numel() != in_f or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ModelError(f"tensor '{name}.g_idx' does not index {groups} groups of {in_f} inputs", fix="check it")
    if int(zeros.max()) >= 1 << bits:
        raise ModelError(
            f"tensor '{name}.qzeros' holds a zero point of {int(zeros.max())} after GPTQ v1's +1 (a stored -1 "
            f"wrapped to {(1 << bits) - 1}), which no {bits}-bit grid holds",
            fix="convert the checkpoint to GPTQModel's gptq_v2 format first, or re-quantize it",
        )
    return codes, zeros, scales, g_idx, gs


def dequantize(codes, zeros, scales, g_idx) -> torch.Tensor:
    """The source's dequantization, fp32: (q - z[g]) * s[g]."""
    return (codes - zeros[:, g_idx]).float() * scales[:, g_idx]


def _scheme(bits: int, gs: int, in_f: int, sym: bool) -> LinearScheme:
    if gs == in_f:  # one group per row: per channel
        args = QuantArgs(num_bits=bits, type="int", strategy="channel", symmetric=sym)
    else:
        args = QuantArgs(num_bits=bits, type="int", strategy="group", group_size=gs, symmetric=sym)
    return LinearScheme(args, None)


def _module(src: Source, name: str, q: dict, method: str, dtype: torch.dtype) -> Converted:
    codes, zeros, scales, g_idx, gs = _grid(name, src, q, method)
    ref = dequantize(codes, zeros, scales, g_idx)
    parent, _, leaf = name.rpartition(".")
    shards = [f"{parent}.{s}" for s in FUSED.get(leaf, (leaf,)) if src.has(f"{parent}.{s}.qweight")]
    ordered = all(trivial_g_idx(src.get(f"{s}.g_idx"), gs) if src.has(f"{s}.g_idx") else True for s in shards)
    rec = {"source": method, "bits": q["bits"], "group_size": gs}
    if not ordered:
        cast = ref.to(dtype)
        err = float((cast.float() - ref).abs().max())
        why = "act-order g_idx (in this fused group): no compressed-tensors 0.20 / vLLM 0.32 form"
        return Converted({f"{name}.weight": cast}, {**rec, "action": "dequantized", "max_abs_err": err, "why": why})
    mid = 1 << (q["bits"] - 1)
    if q["sym"] and not bool((zeros == mid).all()):
        raise ModelError(
            f"tensor '{name}.qzeros' is not all {mid} but the config says sym: true",
            fix="set sym: false in the config if the checkpoint is asymmetric",
        )
    scheme = _scheme(q["bits"], gs, codes.shape[1], q["sym"])
    params = {"weight_scale": scales}
    if not q["sym"]:
        params["weight_zero_point"] = (zeros - mid).to(torch.int8)
    packed = compress_linear(ref, params, scheme)
    back = decompress_linear(packed, ct_scheme(scheme, ["Linear"]), export_format(scheme.weights, None))
    if not torch.equal(back, ref):  # an internal invariant: the codes must survive bit for bit
        raise AssertionError(f"{name}: compressed-tensors does not reproduce the {method} values")
    out = {f"{name}.{k}": v for k, v in packed.items()}
    return Converted(out, {**rec, "action": "exact", "symmetric": q["sym"]}, scheme)


def packed_int_to_ct(path, tmp, method: str, dtype: torch.dtype) -> dict:
    """Write the compressed-tensors checkpoint of a GPTQ / AWQ directory into `tmp`; returns the report."""
    from fp8ptq.conversion.detect import read_json

    config = read_json(path / "config.json")
    q = read_config(path, config, method)
    src = Source(path)
    records, schemes = rewrite(src, tmp, ".qweight", OWNED, lambda s, n: _module(s, n, q, method, dtype))
    exact = [r for r in records if r["action"] == "exact"]
    deq = [r for r in records if r["action"] == "dequantized"]
    summary = {"exact": len(exact), "dequantized": len(deq), "bits": q["bits"], "symmetric": q["sym"]}
    summary["worst_dequantized_abs_err"] = max((r["max_abs_err"] for r in deq), default=0.0)
    report = {"source": str(path), "to": "compressed-tensors", "from": method, "summary": summary, "tensors": records}
    return finish(src, tmp, config, schemes, report)


def check(cfg, fmt: str) -> None:
    from fp8ptq.conversion.detect import read_json

    read_config(cfg.source, read_json(cfg.source / "config.json"), fmt)  # a typed error before any output


def write(cfg, fmt: str, checked: None, tmp) -> dict:
    return packed_int_to_ct(cfg.source, tmp, fmt, getattr(torch, cfg.dtype))


def describe(report: dict) -> str:
    s = report["summary"]
    kind = f"INT{s['bits']} {'symmetric' if s['symmetric'] else 'with zero points'}"
    deq = f", {s['dequantized']} dequantized (act-order g_idx)" if s["dequantized"] else ""
    return f"tensors: {s['exact']} exact ({report['from']} -> {kind}: same codes, scales, zero points){deq}"
