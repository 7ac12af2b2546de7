"""GPTQ (Frantar et al. 2022) as a pure function: quantize W column by column, pushing each column's
rounding error onto the not-yet-quantized columns through the inverse Hessian of the layer inputs.
Minimises ||W X^T - Q X^T||^2 for the inputs X whose Hessian H = 2 X^T X was accumulated.

The grid is a value (`WeightGrid`: choose params, fake-quantize), so one solver serves FP8 per-tensor /
per-channel scales and integer grids, including per-group integer grids whose params are chosen
either lazily from the error-updated weights (standard GPTQ) or up front in original column order
("static groups", required with act-order so the checkpoint needs no g_idx).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from fp8ptq.ops import gptq_kernel
from fp8ptq.ops.fp4 import (
    MX_GROUP,
    NVFP4_GROUP,
    NVFP4_SCALE_SEARCH,
    choose_mxfp4_scale,
    fake_quant_mxfp4,
    fake_quant_nvfp4,
    nvfp4_search_scale,
)
from fp8ptq.ops.fp8 import block_row_scale, choose_fp8_scale, fake_quant_fp8, mse_block_row_scale, scale_up_to
from fp8ptq.ops.granularity import CHANNEL, TENSOR, Granularity, finite_values
from fp8ptq.ops.intq import DEFAULT_SHRINK_GRID, choose_int_qparams, fake_quant_int, int_range, mse_int_qparams
from fp8ptq.ops.mx import choose_mxfp8_scale, fake_quant_mxfp8

# (scale, zero_point | None) at a grid's granularity; x ~= (q - zero_point) * scale.
Params = tuple[torch.Tensor, torch.Tensor | None]


# --- Grids ---------------------------------------------------------------------------------------


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
    # what the fused block kernel (ops.gptq_kernel) applies for this fake_quant: ("fp8",) or ("int", qmin,
    # qmax); None: the eager loop only (FP4 grids)
    fused: tuple | None = None


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
    )


def _mx_grid(choose_scale, fake_quant, mse: bool, hessian: bool, fused: tuple | None = None) -> WeightGrid:
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


def mxfp4_grid(mse: bool = False, hessian: bool = False) -> WeightGrid:
    """MXFP4 (ops.fp4): E2M1 values; the eager solver only."""
    return _mx_grid(choose_mxfp4_scale, fake_quant_mxfp4, mse, hessian)


def mxfp8_grid(mse: bool = False, hessian: bool = False) -> WeightGrid:
    """MXFP8 (ops.mx): E4M3 values, so the fused block kernel's FP8 rounding applies (the same bits per row)."""
    return _mx_grid(choose_mxfp8_scale, fake_quant_mxfp8, mse, hessian, fused=("fp8",))


def int_grid(
    bits: int,
    symmetric: bool,
    g: Granularity,
    *,
    mse: bool = False,
    shrink_grid: tuple[float, ...] = DEFAULT_SHRINK_GRID,
    scale_dtype: torch.dtype | None = None,
    params: Params | None = None,
    refine: Callable[[Params], Params] | None = None,
    hessian: bool = False,
) -> WeightGrid:
    """Integer grid (compressed-tensors conventions, see ops.intq): g is TENSOR, CHANNEL or group(n).

    mse: choose each scale (per row, per group) by the clipping search of `mse_int_qparams`
    instead of plain min-max; hessian: GPTQ's static groups weight that search's error by diag(H).
    scale_dtype: round scales to the dtype the engine loads them in.
    params: fixed (scale, zero_point) for TENSOR / CHANNEL grids (e.g. a scale shared by fused shards).
    """
    assert g.kind in ("tensor", "channel", "group"), g
    within = TENSOR if g == TENSOR else CHANNEL  # a group's params are per-row over its n columns
    if params is not None:
        assert g.kind != "group", "fixed params are for per-tensor / per-channel grids"
        choose = lambda w: params  # noqa: E731
    elif mse:
        choose = lambda w: mse_int_qparams(w, within, bits, symmetric, grid=shrink_grid, scale_dtype=scale_dtype)  # noqa: E731
    else:
        choose = lambda w: choose_int_qparams(w, within, bits, symmetric, scale_dtype=scale_dtype)  # noqa: E731
    if params is None:  # scales of a group's finite values (refused at load anyway: defence in depth)
        choose = (lambda c: lambda w: c(finite_values(w)))(choose)
    weighted = None
    if mse and hessian and params is None:
        weighted = lambda w, d: mse_int_qparams(  # noqa: E731
            finite_values(w), within, bits, symmetric, grid=shrink_grid, scale_dtype=scale_dtype, col_weight=d
        )
    return WeightGrid(
        choose,
        lambda w, p: fake_quant_int(w, p[0], p[1], within, bits),
        g.group_size,
        refine,
        choose_weighted=weighted,
        fused=("int", *int_range(bits)),
    )


# --- Solver --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTQResult:
    """weight: fake-quantized W [out, in] fp32, every column on its grid. scale / zero_point: the
    params actually used (group grids: [out, in / n]), to be exported as-is. dead_columns: inputs
    that were always zero (quantized as 0). damp: relative damping finally used (after retries)."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    dead: torch.Tensor  # [in] bool
    damp: float

    @property
    def dead_columns(self) -> int:  # read on demand: a host sync on a GPU
        return int(self.dead.sum())


@contextmanager
def _one_thread(device: torch.device):
    """The column loop is thousands of tiny ops: OpenMP fork/join costs more than the math (measured
    30x slower with 2 threads on a 2-core machine under load). Restores the caller's setting. On a GPU
    the ops run on the device: the host's thread count is left alone."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _inverse_hessian_cholesky(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp*mean(diag) I)^-1, retrying with more damping if needed.
    Damping relative to mean(diag H) makes the solve invariant to the scale of H (mean or sum).
    Memory: at most two [in, in] temporaries beside H (the intermediate-size Hessian of a 70B model is
    3 GiB in fp32; an identity matrix and chained temporaries would triple the layer's peak)."""
    mean_diag = torch.diag(H).mean().clamp_min(1e-12)
    for attempt in range(6):
        d = damp * 10**attempt
        A = H.clone()
        A.diagonal().add_(d * mean_diag)  # = H + d * mean_diag * I, bit for bit
        try:
            L = torch.linalg.cholesky(A)
        except torch.linalg.LinAlgError:
            continue
        del A
        inv = torch.cholesky_inverse(L)
        del L
        return torch.linalg.cholesky(inv, upper=True), d
    raise torch.linalg.LinAlgError("GPTQ: Hessian is not positive definite even with 1e5x damping")


def _prepare(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 W (a copy) and H (copied only when it must change) with dead inputs (zero H diagonal)
    neutralised: their weights are 0 and their diagonal is the mean live diagonal (keeps mean(diag H),
    hence damping, scale-invariant)."""
    W = W.detach().float().clone()
    H = H.detach().float()
    dead = H.diagonal() == 0
    if dead.any():
        H = H.clone()  # only then: H is read-only otherwise, and it can be GiBs
        diag = H.diagonal()
        live = diag[~dead]
        diag[dead] = live.mean() if live.numel() else 1.0
        W[:, dead] = 0.0
    return W, H, dead


def _solve(
    W, H, order, quant_col, *, block_size, damp, natural, group_size=None, start_group=None, fused=None, indexed=True
):
    """Core GPTQ loop, in the transposed layout [in, out] so each column is a contiguous row.

    start_group(slab [out, group_size]) is called when the solve reaches the first column of each
    group, with that group's current (error-updated) weights; blocks must then be group-aligned.
    fused: the grid as `gptq_kernel.FusedGrid`: each block is one kernel launch where that runs (CUDA).
    indexed: quant_col reads its column's index (group grids); else it gets the solve position.
    Returns (Q [out, in] in original column order, damping used).
    """
    n = W.shape[1]
    Wt = W[:, order].T.contiguous()
    Qt = torch.empty_like(Wt)
    Hinv, used = _inverse_hessian_cholesky(H if natural else H[order[:, None], order], damp)
    # column indices for quant_col: a host copy, needed only by the per-column loop of a group grid
    js = None if natural or fused is not None or not indexed else order.tolist()
    # product buffer: a separate multiply then subtract, not a fused addcmul_/addr_ (FMA), keeps the
    # rounding of the original implementation bit for bit, without a temporary per column
    buf = torch.empty(min(block_size, n), Wt.shape[1], dtype=Wt.dtype, device=Wt.device)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = Wt[i1:i2]  # a view: updated in place
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        if fused is not None:
            gptq_kernel.solve_block(W1, Qt[i1:i2], Err1, Hinv1, fused, i1)
        for i in range(0 if fused is not None else i2 - i1):
            if start_group is not None and (i1 + i) % group_size == 0:
                start_group(W1[i : i + group_size].T)
            w = W1[i]
            q = quant_col(w, i1 + i if js is None else js[i1 + i])
            Qt[i1 + i] = q
            err = torch.div(w - q, Hinv1[i, i], out=Err1[i])
            rest = i2 - i1 - i - 1
            if rest:
                W1[i + 1 :].sub_(torch.mul(Hinv1[i, i + 1 :].unsqueeze(1), err, out=buf[:rest]))
        Wt[i2:] -= Hinv[i1:i2, i2:].T @ Err1
    return Qt.T[:, torch.argsort(order)].contiguous(), used


def _fused(grid: WeightGrid, scale, zero_point, order, n_g):
    """The kernel's view of params fixed before the solve: every column's params column, in solve order."""
    gidx = (order // n_g if n_g else torch.zeros_like(order)).to(torch.int32)
    z = None if zero_point is None else zero_point.float()
    return gptq_kernel.FusedGrid(grid.fused[0], scale.float(), z, gidx, *grid.fused[1:])


def _column_order(H: torch.Tensor, act_order: bool) -> torch.Tensor:
    n = H.shape[0]
    if not act_order:
        return torch.arange(n, device=H.device)
    return torch.argsort(torch.diag(H), descending=True, stable=True)  # stable: ties stay deterministic


def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    grid: WeightGrid,
    *,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
) -> GPTQResult:
    """GPTQ-quantize W [out, in] onto `grid` given the input Hessian H [in, in] (mean or sum of
    2 x^T x: only its shape matters, not its scale). W and H are not modified.

    act_order: visit columns by decreasing diag(H). For group grids this implies static groups.
    static_groups: choose every group's params up front from the original W, in original column
    order (each column keeps its own group's params, so the export needs no g_idx). Otherwise each
    group's params are chosen when the solve reaches its first column, from the error-updated
    weights; block_size is then rounded down to a multiple of group_size (at least one group) so a
    group never straddles blocks and its params see fully updated weights.
    Params are chosen after dead inputs are zeroed.
    """
    n, n_g = W.shape[1], grid.group_size
    if n_g is not None and (n_g <= 0 or n % n_g):
        raise ValueError(f"group_size {n_g} does not divide in_features {n}")
    W, H, dead = _prepare(W, H)
    order = _column_order(H, act_order)
    kernel = grid.fused is not None and gptq_kernel.available(W.device)
    fuse = lambda s, z, g: _fused(grid, s, z, order, g) if kernel else None  # noqa: E731
    with _one_thread(W.device):
        if n_g is None:
            params = grid.choose(W)
            quant = lambda w, _j: grid.fake_quant(w.unsqueeze(1), params)[:, 0]  # noqa: E731
            fused = fuse(*params, None)
            Q, used = _solve(
                W, H, order, quant, block_size=block_size, damp=damp, natural=not act_order, fused=fused, indexed=False
            )
            scale, zero_point = params
        elif act_order or static_groups or grid.refine is not None:
            if grid.row_separable:
                # rows of W.reshape(-1, n_g) are (row, group) pairs: one vectorised choose for all groups
                if grid.choose_weighted is not None:  # each column's error weighted by its diag(H)
                    d = H.diagonal().reshape(1, -1).expand(W.shape[0], -1).reshape(-1, n_g)
                    s, z = grid.choose_weighted(W.reshape(-1, n_g), d)
                else:
                    s, z = grid.choose(W.reshape(-1, n_g))
                scale = s.reshape(W.shape[0], -1)
                zero_point = None if z is None else z.reshape(W.shape[0], -1)
            else:
                slabs = [grid.choose(W[:, k : k + n_g]) for k in range(0, n, n_g)]
                scale = torch.cat([p[0] for p in slabs], dim=1)
                zero_point = None if slabs[0][1] is None else torch.cat([p[1] for p in slabs], dim=1)
            if grid.refine is not None:
                scale, zero_point = grid.refine((scale, zero_point))
            cols = [
                (scale[:, k : k + 1], None if zero_point is None else zero_point[:, k : k + 1]) for k in range(n // n_g)
            ]
            quant = lambda w, j: grid.fake_quant(w.unsqueeze(1), cols[j // n_g])[:, 0]  # noqa: E731
            fused = fuse(scale, zero_point, n_g)
            Q, used = _solve(W, H, order, quant, block_size=block_size, damp=damp, natural=not act_order, fused=fused)
        else:
            groups: list[Params] = []
            quant = lambda w, j: grid.fake_quant(w.unsqueeze(1), groups[j // n_g])[:, 0]  # noqa: E731
            aligned = max(1, block_size // n_g) * n_g
            start = lambda slab: groups.append(grid.choose(slab))
            Q, used = _solve(
                W,
                H,
                order,
                quant,
                block_size=aligned,
                damp=damp,
                natural=not act_order,
                group_size=n_g,
                start_group=start,
            )
            scale = torch.cat([p[0] for p in groups], dim=1)
            zero_point = None if groups[0][1] is None else torch.cat([p[1] for p in groups], dim=1)
    return GPTQResult(Q, scale, zero_point, dead, used)
