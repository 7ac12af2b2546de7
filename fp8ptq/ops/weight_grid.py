"""What GPTQ (ops/gptq.py) and RTN solve against: a format's grid as a value, two pure functions.
Each format builds its own next to its math (ops/fp8.py, ops/intq.py, ops/fp4.py, ops/mx.py); the solver
knows none of them. DEFAULT_SHRINK_GRID: the clip factors every clip search starts from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# (scale, zero_point | None) at a grid's granularity; x ~= (q - zero_point) * scale.
Params = tuple[torch.Tensor, torch.Tensor | None]

# clip factors of the weight scale searches (1.0 down to 0.5): INT (mse_int_qparams), FP8 blocks, NVFP4
DEFAULT_SHRINK_GRID: tuple[float, ...] = tuple(round(1.0 - 0.02 * i, 2) for i in range(26))


@dataclass(frozen=True)
class WeightGrid:
    """A quantization grid for GPTQ, as two pure functions.

    choose(W [out, k]) -> Params for those columns: per-tensor ([1]) or per-row ([out, 1]).
    fake_quant(W [out, k], params) -> [out, k] fp32 on the grid the params define.
    group_size None: one Params for the whole W, chosen once before solving (FP8/INT8 per-tensor or
    per-channel). group_size n: one Params per n consecutive input columns; `choose` must then be
    per-row ([out, 1]), and the result stacks them into [out, in / n].
    refine: optional, for group grids whose params depend on a whole row of groups (e.g. group scales
    an engine re-quantizes per row): all groups' params [out, in / n] -> the params to use. GPTQ then
    chooses every group up front (static groups).
    row_separable: `choose` treats every row alone, so static groups may be chosen in one call over
    W viewed as [(out x in / n), n]. False (block grids: rows share a block's params): one call per
    [out, n] column slab.
    """

    choose: Callable[[torch.Tensor], Params]
    fake_quant: Callable[[torch.Tensor, Params], torch.Tensor]
    group_size: int | None = None
    refine: Callable[[Params], Params] | None = None
    row_separable: bool = True
    # choose_weighted(W rows [R, n], d [R, n]) -> Params: like choose, but each column's error weighted
    # by d (GPTQ passes the Hessian diagonal: the output error a column's rounding causes on its own)
    choose_weighted: Callable[[torch.Tensor, torch.Tensor], Params] | None = None
    # what the fused block kernel (ops.gptq_kernel) applies for this fake_quant: ("fp8",), ("int", qmin,
    # qmax) or ("fp4",); None: the eager loop only
    fused: tuple | None = None
