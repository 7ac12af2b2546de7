"""GPTQ's intra-block column recurrence as one Triton kernel per block.

The eager solver (`ops.gptq._solve`) runs one Python iteration per input column: ~10 tiny kernel
launches per column on a GPU, ~300k per 8B-width layer, the device idle most of the time. Here one
launch solves a whole block (<= 128 columns): each program owns a tile of output channels, keeps the
block's [B, tile] weights in registers and walks the columns on-chip. Output channels are independent
in GPTQ (they share only the inverse Hessian), so tiles need no communication.

Bit for bit what the eager solver computes, for every grid the solver serves (`FusedGrid`): FP8
per-tensor / per-channel / groups / blocks (MXFP8 included), integer grids, FP4 E2M1 (NVFP4, MXFP4).
The same operations in the same order, IEEE-rounded division (`div_rn`), no FMA contraction
(`enable_fp_fusion=False`), every rounding (E4M3, integers, E2M1, bf16) done with exact integer or
add-and-subtract arithmetic instead of a cast (Triton 3.5's interpreter mis-rounds the FP8 cast where a
carry crosses a binade). Params fixed before the block (per-tensor, per-channel, static groups) make one
launch per block; lazy groups (params chosen from the error-updated weights when the solve reaches a
group) one launch per group: the kernel writes the updated block back, the solver chooses the next
group's params from it, and the next launch reads it.

On the CPU the kernel runs only under Triton's interpreter (`TRITON_INTERPRET=1`, set before this
module is imported): that is how the test suite checks it against the eager solver without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # optional: CUDA wheels of torch ship it; on the CPU the test extra installs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# (output channels per program, warps per program) for full 128-column blocks; narrower blocks take 2x the
# channels. A setting, not a constant, so benchmarks/speed/gptq_kernel_bench.py can sweep it on a GPU.
TILE = (32, 4)


@dataclass(frozen=True)
class FusedGrid:
    """A grid the kernel can apply: kind "fp8" (E4M3), "int" (qmin, qmax) or "fp4" (E2M1 codes times the
    scale, rounded to bf16: NVFP4's effective scale, MXFP4's power of two), scale [out, G] (or [1]: one
    for the tensor), zero_point like scale or None, gidx [in] int32: the params column of each input
    column in the solver's (possibly act-ordered) column order."""

    kind: str
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    gidx: torch.Tensor
    qmin: float = 0.0
    qmax: float = 0.0


def available(device: torch.device) -> bool:
    """Whether the fused solve runs on this device: CUDA with Triton, or any device under the interpreter.
    FP8PTQ_GPTQ_KERNEL=eager turns it off (for before/after measurements)."""
    if triton is None or os.environ.get("FP8PTQ_GPTQ_KERNEL", "auto") == "eager":
        return False
    return device.type == "cuda" or INTERPRET


if triton is not None:

    @triton.jit
    def _round_fp8(t):
        # ops.fp8.round_to_fp8: t + c - c with c = 1.5 * 2^(max(e, -6) + 20), then t's sign
        bits = t.to(tl.int32, bitcast=True)
        e = tl.maximum(bits & 0x7F800000, 121 << 23)
        c = (e + ((20 << 23) | 0x400000)).to(tl.float32, bitcast=True)
        return _copysign((t + c) - c, t)

    @triton.jit
    def _copysign(r, t):
        sign = (t.to(tl.int32, bitcast=True) >> 31) << 31
        return ((r.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_bf16(x):
        # fp32 -> bf16 -> fp32, nearest with ties to even (torch's cast, for finite values)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000 as int32
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _round_e2m1(t):
        # ops.fp4.cast_e2m1 on t in [-6, 6]: |t| / step (the power of two of |t|'s binade clamped to [1, 4],
        # halved: exact), rounded half to even, times step, signed as t (torch.sign: +0.0 for either zero)
        a = tl.abs(t)
        step = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        step = tl.minimum(tl.maximum(step, 1.0), 4.0) * 0.5
        m = ((tl.math.div_rn(a, step) + 12582912.0) - 12582912.0) * step
        return tl.where(t == 0.0, 0.0, _copysign(m, t))

    @triton.jit
    def _block_kernel(
        W, Q, E, H, S, Z, G,
        c0, c1, nb, out, ldw, hs0, hs1, lds, qmin, qmax,
        B: tl.constexpr, BN: tl.constexpr, KIND: tl.constexpr, HAS_Z: tl.constexpr, PER_TENSOR: tl.constexpr,
    ):  # fmt: skip
        # KIND 0: E4M3, 1: integer, 2: E2M1. Columns c0..c1 of the block are solved; every later row of the
        # block takes their errors, and the whole register tile is written back to W (what the eager loop
        # leaves there: each row as it was rounded)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        cmask = cols < out
        rows = tl.arange(0, B)
        tile = (rows[:, None] < nb) & cmask[None, :]
        w = tl.load(W + rows[:, None] * ldw + cols[None, :], mask=tile, other=0.0)
        for i in tl.range(c0, c1):
            # row i of the register tile, exactly (max over one value and -infs keeps -0.0)
            wi = tl.max(tl.where(rows[:, None] == i, w, float("-inf")), axis=0)
            g = tl.load(G + i)
            if PER_TENSOR:
                s = tl.load(S)
            else:
                s = tl.load(S + cols * lds + g, mask=cmask, other=1.0)
            t = tl.math.div_rn(wi, s)
            if KIND == 0:
                t = _round_fp8(tl.minimum(tl.maximum(t, -448.0), 448.0))
                q = t * s
            elif KIND == 2:
                q = _round_bf16(_round_e2m1(tl.minimum(tl.maximum(t, -6.0), 6.0)) * s)
            else:
                if HAS_Z:
                    if PER_TENSOR:
                        z = tl.load(Z)
                    else:
                        z = tl.load(Z + cols * lds + g, mask=cmask, other=0.0)
                    t = t + z
                t = tl.minimum(tl.maximum(t, qmin), qmax)
                t = _copysign((t + 12582912.0) - 12582912.0, t)  # torch.round: half to even, sign kept
                if HAS_Z:
                    t = t - z
                q = t * s
            tl.store(Q + i * ldw + cols, q, mask=cmask)
            err = tl.math.div_rn(wi - q, tl.load(H + i * hs0 + i * hs1))
            tl.store(E + i * ldw + cols, err, mask=cmask)
            later = (rows > i) & (rows < nb)
            h = tl.load(H + i * hs0 + rows * hs1, mask=later, other=0.0)
            w = tl.where(later[:, None], w - h[:, None] * err[None, :], w)
        tl.store(W + rows[:, None] * ldw + cols[None, :], w, mask=tile)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_KINDS = {"fp8": 0, "int": 1, "fp4": 2}


def solve_block(
    W1: torch.Tensor,
    Q1: torch.Tensor,
    E1: torch.Tensor,
    Hinv1: torch.Tensor,
    grid: FusedGrid,
    at: tuple[int, int, int],
):
    """Columns c0..c1 of one block of the recurrence, at = (i1, c0, c1); i1: the block's first column (for
    gidx). W1 [nb, out]: the error-updated block rows, updated in place as the eager loop updates them;
    Hinv1 [nb, nb]: a view of the upper Cholesky factor, any strides; Q1 / E1 [nb, out]: rows c0..c1
    written, the quantized rows and the scaled errors the eager loop leaves in Qt and Err1."""
    i1, c0, c1 = at
    nb, out = W1.shape
    assert W1.stride(1) == 1 and Q1.stride(1) == 1 and E1.stride(1) == 1
    per_tensor = grid.scale.numel() == 1
    s = grid.scale.reshape(1) if per_tensor else grid.scale.reshape(out, -1).contiguous()
    z = s if grid.zero_point is None else grid.zero_point.reshape(s.shape).contiguous()
    bn, warps = TILE if nb > 64 else (2 * TILE[0], TILE[1])
    _block_kernel[(triton.cdiv(out, bn),)](
        W1, Q1, E1, Hinv1, s, z, grid.gidx[i1 : i1 + nb],
        c0, c1, nb, out, W1.stride(0), Hinv1.stride(0), Hinv1.stride(1), 1 if per_tensor else s.stride(0),
        float(grid.qmin), float(grid.qmax),
        B=_pow2(nb), BN=bn, KIND=_KINDS[grid.kind], HAS_Z=grid.zero_point is not None, PER_TENSOR=per_tensor,
        num_warps=warps, **({} if INTERPRET else {"enable_fp_fusion": False}),
    )  # fmt: skip
