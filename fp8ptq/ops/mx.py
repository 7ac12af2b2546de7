"""OCP Microscaling (MX) as pure functions: groups of 32 values sharing one E8M0 scale (a power of two,
stored as the biased exponent e + 127 in a byte), for any element format. MXFP4 (E2M1 elements) lives in
ops/fp4.py on top of these; MXFP8 (E4M3 elements) is here.

Conventions are compressed-tensors' own (0.17 and 0.20, `generate_mx_scales`, the `mxfp8-quantized`
compressor) for weights and vLLM's for dynamic activations (0.32, `_mxfp8_e4m3_quantize_torch`, the
reference its MXFP8 kernels are tested against), so a checkpoint decompresses to what fp8ptq simulated:

- weights, min-max: the group amax rounded to a power of two (up when its mantissa is >= 1.75), its
  exponent minus the element format's offset floor(log2(max)) (E2M1: 2, E4M3: 8); the largest value then
  lands at most at the format's maximum (E4M3: 448, never saturating);
- weights, `weight_observer: mse`: of the two exponents around floor(log2(amax)) - offset, the one with
  the smaller (optionally Hessian-weighted) squared error; the lower saturates the group's top values;
- activations (MXFP8 W8A8, dynamic): the smallest power of two with amax / scale <= 448,
  2^ceil(log2(amax / 448)), computed with the same fp32 operations as vLLM's reference;
- an all-zero or non-finite group gets the smallest exponent; every exponent is clamped to E8M0's
  [-127, 127]; E8M0 holds each scale exactly, and an E4M3 or E2M1 value times a power of two is exact
  in bf16, so the decompressed weight equals the fake-quant bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8ptq.ops.fp8 import FP8_MAX, fake_quant_fp8
from fp8ptq.ops.granularity import CHANNEL
from fp8ptq.ops.weight_grid import WeightGrid

MX_GROUP = 32
E8M0_MIN, E8M0_MAX = -127, 127  # E8M0 stores 2^e as e + 127 in a byte (255 is NaN)
MXFP8_OFFSET = 8  # floor(log2(448))


def mx_exponent(amax: torch.Tensor, offset: int, round_up: bool | torch.Tensor = False) -> torch.Tensor:
    """Scale exponents e (scale 2^e, fp32 tensor of integers) for group abs-maxima amax: the OCP MX
    shared exponent floor(log2(amax)) - offset, plus one where round_up. An all-zero or non-finite amax
    gets the smallest exponent; every exponent is clamped to E8M0's range."""
    a = amax.float()
    ok = torch.isfinite(a) & (a > 0)
    e = torch.frexp(torch.where(ok, a, torch.ones_like(a)))[1].float() - 1 - offset
    e = e + torch.as_tensor(round_up, dtype=torch.float32)
    return torch.where(ok, e, torch.full_like(e, E8M0_MIN)).clamp(E8M0_MIN, E8M0_MAX)


def compressed_tensors_mx_round_up(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own choice (`generate_mx_scales`: amax rounded to a power of two, up when its
    mantissa is at least 1.75): True where it takes the larger exponent."""
    return torch.frexp(amax.float())[0] >= 0.875  # frexp's mantissa is in [0.5, 1)


def choose_mx_scale(
    x: torch.Tensor,
    offset: int,
    fake_quant: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    mse: bool = False,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Power-of-two scales [rows, 1] for groups x [rows, 32] of an element format with this exponent
    offset. minmax: compressed-tensors' rule; mse: of the two exponents around the OCP one, the one
    whose fake_quant(x, scale) has the smaller squared error on x (weight: x-shaped weights on each
    element's error, e.g. diag(H))."""
    amax = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).abs().amax(dim=-1, keepdim=True)
    if not mse:
        return torch.exp2(mx_exponent(amax, offset, compressed_tensors_mx_round_up(amax)))
    lo, hi = torch.exp2(mx_exponent(amax, offset)), torch.exp2(mx_exponent(amax, offset, True))

    def err(s: torch.Tensor) -> torch.Tensor:
        e = (fake_quant(x, s) - x.float()).square()
        return (e if weight is None else e * weight).nansum(dim=-1, keepdim=True)

    return torch.where(err(hi) < err(lo), hi, lo)


# --- MXFP8: E4M3 elements -----------------------------------------------------------------------------


def fake_quant_mxfp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, 32] with one power-of-two scale per row [rows, 1]: E4M3 codes (saturating at +-448) times
    the scale, fp32; the same bits as fake_quant_fp8 per row. A NaN stays NaN."""
    return fake_quant_fp8(x.float(), scale, CHANNEL)


def choose_mxfp8_scale(x: torch.Tensor, mse: bool = False, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Power-of-two scales [rows, 1] of MXFP8 weight groups x [rows, 32] (see the module doc)."""
    return choose_mx_scale(x, MXFP8_OFFSET, fake_quant_mxfp8, mse, weight)


def mxfp8_act_scale(amax: torch.Tensor) -> torch.Tensor:
    """vLLM's dynamic MXFP8 activation scale for group abs-maxima: 2^ceil(log2(amax / 448)), the biased
    exponent clamped to [0, 254] (its fp32 operations, in its order)."""
    a = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    biased = (torch.ceil(torch.log2(a / FP8_MAX)) + 127.0).clamp(0, 254)
    return torch.exp2(biased - 127.0)


def fake_quant_mxfp8_act(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP8 activations x [..., K] (K a multiple of 32): groups of 32 along K, each with the
    scale vLLM computes at run time (`mxfp8_act_scale`); same dtype as x."""
    rows = x.reshape(-1, MX_GROUP).float()
    s = mxfp8_act_scale(rows.abs().amax(dim=-1, keepdim=True))
    return fake_quant_mxfp8(rows, s).to(x.dtype).reshape(x.shape)


# --- GPTQ / RTN grids (ops/weight_grid.py) ---------------------------------------------------


def mx_grid(choose_scale, fake_quant, mse: bool, hessian: bool, fused: tuple | None = None) -> WeightGrid:
    """An MX grid (ops.mx): groups of 32 input columns, per-row power-of-two scales [R, 1] from
    choose_scale(w, mse[, d]) (hessian: the mse choice weighted by diag(H) per column in GPTQ's static
    groups), values by fake_quant(w, scale)."""
    weighted = (lambda w, d: (choose_scale(w, True, d), None)) if mse and hessian else None
    return WeightGrid(
        lambda w: (choose_scale(w, mse), None),
        lambda w, p: fake_quant(w, p[0]),
        MX_GROUP,
        choose_weighted=weighted,
        fused=fused,
    )


def mxfp8_grid(mse: bool = False, hessian: bool = False) -> WeightGrid:
    """MXFP8 (ops.mx): E4M3 values, so the fused block kernel's FP8 rounding applies (the same bits per row)."""
    return mx_grid(choose_mxfp8_scale, fake_quant_mxfp8, mse, hessian, fused=("fp8",))
