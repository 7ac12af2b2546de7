"""NVFP4 (FP4 E2M1 values, one FP8 E4M3 scale per 16, one fp32 global scale per tensor) as pure functions.

Conventions are compressed-tensors' own (0.17.0 and 0.20: `generate_gparam`, `calculate_qparams` with
a global scale, `FP4_E2M1_DATA.cast_to_fp4`, the NVFP4 compressor), so its compressor decompresses
what these functions simulate, bit for bit:

- global scale gs = 448 * 6 / amax(tensor) (fp32), a *divisor*: 1.0 where amax is 0; amax and the
  group maxima below are over finite values only (fp8ptq refuses NaN/inf weights at load anyway);
- group scale s = fp8_e4m3(gs * (amax(group) / 6)), stored as FP8; a scale that rounds to 0 becomes
  0.125 (compressed-tensors' eps for FP8), so every scale is finite and positive;
- effective scale eff = s / gs (fp32); x ~= e2m1(clamp(x / eff, -6, 6)) * eff, E2M1 values
  0, 0.5, 1, 1.5, 2, 3, 4, 6, rounded to nearest with ties to even;
- the dequantized weight is rounded to bf16 (compressed-tensors' decompressor unpacks to bf16); an
  engine multiplies in fp32, a difference within bf16 rounding (2^-9 relative).

vLLM 0.32 (CompressedTensorsW4A4Fp4) inverts the stored global scale and takes the max over fused
shards, so shards that run as one GEMM must share it.
"""

from __future__ import annotations

import torch

from fp8ptq.ops.fp8 import FP8_DTYPE, FP8_MAX, best_row_scale
from fp8ptq.ops.granularity import finite_values
from fp8ptq.ops.mx import MX_GROUP, choose_mx_scale, mx_grid  # noqa: F401  (MX_GROUP: re-exported for MXFP4)
from fp8ptq.ops.weight_grid import DEFAULT_SHRINK_GRID, WeightGrid

FP4_MAX = 6.0
NVFP4_GROUP = 16
_ZERO_SCALE = 0.125  # compressed-tensors' replacement for an FP8 group scale that rounds to 0


def cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round x (already clamped to [-6, 6]) to the nearest E2M1 value, ties to even; same dtype.
    NaN becomes 0 (torch.sign(NaN) is 0): the fake-quants that must show a NaN put it back."""
    # E2M1's values are 0.5 apart below 2, 1 apart in [2, 4), 2 apart in [4, 6]: dividing |x| by that
    # step is exact (a power of two), and round-half-even of the quotient is ties-to-even of the code
    # (each binade starts on an even code). Bit for bit the former table lookup (torch.bucketize, 3x
    # slower, the NVFP4 recipe's largest cost) on a dense sweep, every tie, both zeros: tests/ops/test_fp4.py.
    # The step is |x|'s power of two (its exponent bits) clamped to [1, 4], halved: 0.5 below 2, 1 in
    # [2, 4), 2 from 4 (and for NaN); the same values as two nested torch.where, in a third of the time.
    xf = x.float()
    a = xf.abs()
    step = (a.view(torch.int32) & 0x7F800000).view(torch.float32).clamp_(1.0, 4.0).mul_(0.5)
    q = a.div_(step).round_().mul_(step).mul_(torch.sign(xf)).nan_to_num_(0.0)
    return q.to(x.dtype)


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """fp32 [1]: 448 * 6 / amax(w), the divisor compressed-tensors stores as `weight_global_scale`
    (1.0 for an all-zero tensor, as compressed-tensors' `generate_gparam`). amax is taken over the finite
    values (`finite_values`), so a stray inf cannot make the divisor 0 (defence in depth: the loader
    refuses NaN/inf weights)."""
    amax = finite_values(w.detach()).abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny)
    gs = (FP8_MAX * FP4_MAX) / amax
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_group_scale(amax: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """FP8 group scales (as fp32 values) from group abs-maxima and the global scale."""
    s = (gs.float() * (amax.float() / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    return torch.where(s == 0, torch.full_like(s, _ZERO_SCALE), s)


def fake_quant_nvfp4_act(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 W4A4 activations x [..., K]: groups of 16 along K with dynamic FP8 group scales under the
    static per-tensor scale (x ~= q * scale convention: scale = 1 / input_global_scale). Same dtype as x.
    vLLM's scaled_fp4_quant computes the same values up to fp32 rounding order."""
    gs = 1.0 / scale.float().reshape(1)
    rows = x.reshape(-1, NVFP4_GROUP).float()
    s = nvfp4_group_scale(rows.abs().amax(dim=-1, keepdim=True), gs)
    eff = s / gs
    q = cast_e2m1((rows / eff).clamp(-FP4_MAX, FP4_MAX))
    return (q * eff).to(x.dtype).reshape(x.shape)


def fake_quant_nvfp4(x: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """x [rows, n] with one effective scale per row eff [rows, 1] (= group scale / global scale): the
    dequantized E2M1 values rounded to bf16, returned as fp32 (compressed-tensors' decompression)."""
    q = cast_e2m1((x.float() / eff).clamp(-FP4_MAX, FP4_MAX))
    return torch.where(torch.isnan(x), x.float(), q * eff).to(torch.bfloat16).float()  # a NaN stays visible


# NVFP4's clip search also tries scales above min-max, up to amax mapped to FP4's 4 instead of its 6
# (x 1.5, and one FP8 step beyond): E2M1's grid is finest near 0, so a group's typical values can lose
# less there than its largest loses to the 4..6 gap ("Four Over Six"). SmolLM2's Linears: weight MSE
# -18% against the shrink-only search (benchmarks/quality/nvfp4_scale_search.py).
NVFP4_SCALE_SEARCH: tuple[float, ...] = DEFAULT_SHRINK_GRID + tuple(round(1.0 + 0.02 * i, 2) for i in range(1, 31))


def nvfp4_search_scale(
    w: torch.Tensor, gs: torch.Tensor, factors: tuple[float, ...] = NVFP4_SCALE_SEARCH, d: torch.Tensor | None = None
) -> torch.Tensor:
    """Effective scales [R, 1] (FP8 group scale / gs) of NVFP4 groups w [R, 16]: min-max, or with
    factors, the group amax scaled by the factor whose fake-quant has the least squared error (d:
    w-shaped weights on each element's error, e.g. diag(H) per column)."""
    w = finite_values(w)  # finite scales even for a broken group (refused at load; defence in depth)
    amax = w.abs().amax(dim=-1, keepdim=True)
    if not factors:
        return nvfp4_group_scale(amax, gs) / gs
    cands = torch.cat([nvfp4_group_scale(amax * f, gs) / gs for f in (1.0, *factors)], dim=1)

    def err_of_rows(rows, eff):  # the 58 factors give ~15 distinct FP8 scales per group: each scored once
        wr = w[rows]
        e = (fake_quant_nvfp4(wr, eff) - wr.float()).square_()
        return (e if d is None else e.mul_(d[rows])).sum(-1)

    return best_row_scale(cands, err_of_rows)


# --- MXFP4 (OCP Microscaling): E2M1 values in groups of 32 with one E8M0 (power-of-two) scale each ---


_MX_OFFSET = 2  # floor(log2(6)): the E2M1 exponent offset of the OCP MX shared exponent


def fake_quant_mxfp4(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, 32] with one power-of-two scale per row [rows, 1]: E2M1 codes times the scale, rounded
    to bf16 (exact: compressed-tensors' MXFP4 decompressor multiplies bf16 codes by a bf16 power of
    two), returned as fp32. A NaN stays NaN (fp8ptq refuses non-finite weights at load; never hide one)."""
    q = cast_e2m1((x.float() / scale).clamp(-FP4_MAX, FP4_MAX))
    return torch.where(torch.isnan(x), x.float(), q * scale).to(torch.bfloat16).float()


def choose_mxfp4_scale(x: torch.Tensor, mse: bool = False, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Power-of-two scales [rows, 1] for groups x [rows, 32] (ops.mx): minmax, compressed-tensors' rule
    (largest value in [4, 8): values above 6 saturate, or in [2, 4) when its mantissa is >= 1.75); mse:
    of the two exponents around the OCP one (saturate the top vs halve the resolution), the one with
    the smaller squared error on x (weight: x-shaped weights on each element's error, e.g. diag(H))."""
    return choose_mx_scale(x, _MX_OFFSET, fake_quant_mxfp4, mse, weight)


def fake_quant_mxfp4_act(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP4 activations x [..., K] (K a multiple of 32; MXFP4 W4A4): groups of 32 along K, each
    with the power-of-two scale vLLM 0.32 computes at run time -- its portable quantizer
    (`mxfp4_utils._compute_quant_and_scale`, "round-to-nearest-even block scale (OCP MX spec), matching
    hardware/aiter MXFP4 quantizers") rounds the group amax up to the next power of two when its
    mantissa is >= 1.75, which is compressed-tensors' weight rule (`choose_mxfp4_scale` min-max) --
    and E2M1 values rounded to nearest, ties to even, saturating at 6. Same dtype as x."""
    rows = x.reshape(-1, MX_GROUP).float()
    return fake_quant_mxfp4(rows, choose_mxfp4_scale(rows)).to(x.dtype).reshape(x.shape)


# --- GPTQ / RTN grids (ops/weight_grid.py) ---------------------------------------------------


def nvfp4_grid(global_scale: torch.Tensor, mse: bool = False, hessian: bool = False) -> WeightGrid:
    """NVFP4 (ops.fp4) with a fixed per-tensor global scale (of the whole, fused, weight): groups of 16
    input columns, per-row params eff = FP8 group scale / global scale [R, 1]. mse: each group's FP8
    scale from `nvfp4_search_scale` over NVFP4_SCALE_SEARCH (hessian: the error weighted by diag(H) per
    column, through `choose_weighted`); the scales stay FP8 values, so the export is as exact as
    min-max's."""
    gs = global_scale.float().reshape(1)
    factors = NVFP4_SCALE_SEARCH if mse else ()
    return WeightGrid(
        lambda w: (nvfp4_search_scale(w, gs, factors), None),
        lambda w, p: fake_quant_nvfp4(w, p[0]),
        NVFP4_GROUP,
        choose_weighted=(lambda w, d: (nvfp4_search_scale(w, gs, factors, d), None)) if mse and hessian else None,
        fused=("fp4",),
    )


def mxfp4_grid(mse: bool = False, hessian: bool = False) -> WeightGrid:
    """MXFP4 (ops.fp4): E2M1 values times a power of two, so the fused block kernel's E2M1 rounding applies."""
    return mx_grid(choose_mxfp4_scale, fake_quant_mxfp4, mse, hessian, fused=("fp4",))
