"""GPTQ (Frantar et al. 2022) as a pure function: quantize W column by column, pushing each column's
rounding error onto the not-yet-quantized columns through the inverse Hessian of the layer inputs.
Minimises ||W X^T - Q X^T||^2 for the inputs X whose Hessian H = 2 X^T X was accumulated.

The grid is a value (`ops/weight_grid.WeightGrid`: choose params, fake-quantize), built next to each
format's math (`fp8_grid` / `fp8_block_grid` in ops/fp8.py, `int_grid` in ops/intq.py, `nvfp4_grid` /
`mxfp4_grid` in ops/fp4.py, `mxfp8_grid` in ops/mx.py), so this module is the solver only: it serves FP8
per-tensor / per-channel scales and integer grids, including per-group integer grids whose params are chosen
either lazily from the error-updated weights (standard GPTQ) or up front in original column order
("static groups", required with act-order so the checkpoint needs no g_idx).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from fp8ptq.ops import gptq_kernel
from fp8ptq.ops.weight_grid import Params, WeightGrid

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
    # each weight as the solve rounded it (error-updated; `weight` is its fake-quant): the solve's own
    # rounding positions, where a rounding refinement starts (calibrate/signround.py)
    updated: torch.Tensor | None = None
    # [out] fp64: each row's output error tr(d H d^T), d = W - weight (H as given), from the solve's own
    # scaled errors E instead of a [out, in] x [in, in] product: W - weight = E U with U the upper Cholesky
    # factor of (H + s I)^-1, so d (H + s I) d^T = E E^T (exact in exact arithmetic; fp32 solves agree with
    # the product to ~1e-4 relative). s: the absolute damping. Dead inputs add nothing either way.
    out_err: torch.Tensor | None = None

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


def _inverse_hessian_cholesky(
    H: torch.Tensor, damp: float, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Upper Cholesky factor of (H + damp*mean(diag) I)^-1, the relative damping used and the absolute one
    (damp*mean(diag)), retrying with more damping if needed; with order, of H permuted to that column order
    (act-order). Damping relative to mean(diag H) makes the solve invariant to the scale of H (mean or sum).
    Memory: at most two [in, in] temporaries beside H (the intermediate-size Hessian of a 70B model is
    3 GiB in fp32; an identity matrix and chained temporaries would triple the layer's peak): the damped
    copy is the permuted H itself under act-order, not a copy of a permuted copy."""
    mean_diag = None
    for attempt in range(6):
        d = damp * 10**attempt
        A = H.clone() if order is None else H[order[:, None], order]
        if mean_diag is None:
            mean_diag = torch.diag(A).mean().clamp_min(1e-12)
        A.diagonal().add_(d * mean_diag)  # = H + d * mean_diag * I, bit for bit
        try:
            L = torch.linalg.cholesky(A)
        except torch.linalg.LinAlgError:
            continue
        del A
        inv = torch.cholesky_inverse(L)
        del L
        return torch.linalg.cholesky(inv, upper=True), d, d * mean_diag
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


@dataclass(frozen=True)
class Columns:
    """How the solve visits and rounds columns.

    order: the column visit order (a permutation of in_features); natural: it is the identity.
    quant(w, j) rounds one column w [out] onto the grid; j is the column's index (indexed: group grids)
    or its solve position.
    start_group(slab [out, group_size]) -> that group's Params, called when the solve reaches the first
    column of each group, with that group's current (error-updated) weights; blocks must then be
    group-aligned.
    fused: the grid as `gptq_kernel.FusedGrid`: each block is one kernel launch where that runs (CUDA).
    fused_group (lazy groups): one group's Params as a `FusedGrid`: one kernel launch per group.
    """

    order: torch.Tensor
    quant: Callable[[torch.Tensor, int], torch.Tensor]
    natural: bool
    group_size: int | None = None
    start_group: Callable[[torch.Tensor], Params] | None = None
    fused: gptq_kernel.FusedGrid | None = None
    indexed: bool = True
    fused_group: Callable[[Params], gptq_kernel.FusedGrid] | None = None


def _kernel_block(cols: Columns, W1, Q1, Err1, Hinv1, i1: int) -> None:
    """One block on the fused kernel: one launch, or (lazy groups) one per group, each group's params
    chosen from the weights the launches before it left in W1, as the eager loop chooses them."""
    if cols.start_group is None:
        gptq_kernel.solve_block(W1, Q1, Err1, Hinv1, cols.fused, (i1, 0, W1.shape[0]))
        return
    for c0 in range(0, W1.shape[0], cols.group_size):
        grid = cols.fused_group(cols.start_group(W1[c0 : c0 + cols.group_size].T))
        gptq_kernel.solve_block(W1, Q1, Err1, Hinv1, grid, (i1, c0, c0 + cols.group_size))


def _solve(W, H, cols: Columns, *, block_size, damp):
    """Core GPTQ loop, in the transposed layout [in, out] so each column is a contiguous row.
    Returns (Q [out, in] in original column order, damping used, the error-updated W it rounded, each
    row's output error: GPTQResult.out_err).
    """
    order, quant_col, natural = cols.order, cols.quant, cols.natural
    group_size, start_group = cols.group_size, cols.start_group
    kernel = cols.fused is not None or cols.fused_group is not None
    n = W.shape[1]
    # the factorisation first: its [in, in] temporaries never sit beside the solve's [in, out] copies
    Hinv, used, shift = _inverse_hessian_cholesky(H, damp, None if natural else order)
    Wt = W[:, order].T.contiguous()
    Qt = torch.empty_like(Wt)
    e2 = torch.zeros(W.shape[0], dtype=torch.float64, device=W.device)  # per row: the sum of squared E
    # column indices for quant_col: a host copy, needed only by the per-column loop of a group grid
    js = None if natural or kernel or not cols.indexed else order.tolist()
    # product buffer: a separate multiply then subtract, not a fused addcmul_/addr_ (FMA), keeps the
    # rounding of the original implementation bit for bit, without a temporary per column
    buf = torch.empty(min(block_size, n), Wt.shape[1], dtype=Wt.dtype, device=Wt.device)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = Wt[i1:i2]  # a view: updated in place
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        if kernel:
            _kernel_block(cols, W1, Qt[i1:i2], Err1, Hinv1, i1)
        for i in range(0 if kernel else i2 - i1):
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
        e2 += Err1.double().square().sum(0)
    Hinv = Hinv1 = buf = None  # the solve's largest temporary (and its last block's view): gone before the copies
    back = torch.argsort(order)
    Q = Qt.T[:, back].contiguous()
    del Qt
    d2 = torch.linalg.vector_norm(W - Q, dim=1).double().square()  # one [out, in] temporary, not fp64 ones
    return Q, used, Wt.T[:, back], e2 - shift.double() * d2  # the last: GPTQResult.out_err


def _fused(grid: WeightGrid, scale, zero_point, gidx):
    """The kernel's view of params: gidx [in] int32, every column's params column in solve order."""
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
    fuse = lambda s, z, gidx: _fused(grid, s, z, gidx) if kernel else None  # noqa: E731
    # one params column for every column: per-tensor / per-channel params, and each lazy group's own
    column0 = torch.zeros_like(order, dtype=torch.int32) if kernel else None
    with _one_thread(W.device):
        if n_g is None:
            params = grid.choose(W)
            quant = lambda w, _j: grid.fake_quant(w.unsqueeze(1), params)[:, 0]  # noqa: E731
            fused = fuse(*params, column0)
            cols = Columns(order, quant, natural=not act_order, fused=fused, indexed=False)
            Q, used, updated, out_err = _solve(W, H, cols, block_size=block_size, damp=damp)
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
            per_group = [
                (scale[:, k : k + 1], None if zero_point is None else zero_point[:, k : k + 1]) for k in range(n // n_g)
            ]
            quant = lambda w, j: grid.fake_quant(w.unsqueeze(1), per_group[j // n_g])[:, 0]  # noqa: E731
            gidx = (order // n_g).to(torch.int32) if kernel else None  # each column's own group
            cols = Columns(order, quant, natural=not act_order, fused=fuse(scale, zero_point, gidx))
            Q, used, updated, out_err = _solve(W, H, cols, block_size=block_size, damp=damp)
        else:
            groups: list[Params] = []
            quant = lambda w, j: grid.fake_quant(w.unsqueeze(1), groups[j // n_g])[:, 0]  # noqa: E731
            aligned = max(1, block_size // n_g) * n_g

            def start(slab: torch.Tensor) -> Params:
                groups.append(grid.choose(slab))
                return groups[-1]

            one_group = (lambda p: fuse(*p, column0)) if kernel else None
            cols = Columns(order, quant, not act_order, n_g, start, fused_group=one_group)
            Q, used, updated, out_err = _solve(W, H, cols, block_size=aligned, damp=damp)
            scale = torch.cat([p[0] for p in groups], dim=1)
            zero_point = None if groups[0][1] is None else torch.cat([p[1] for p in groups], dim=1)
    return GPTQResult(Q, scale, zero_point, dead, used, updated, out_err)
