"""GPTQ (Frantar et al. 2022) as a pure function: quantize W column by column, pushing each column's
rounding error onto the not-yet-quantized columns through the inverse Hessian of the layer inputs.

The quantization grid is a callback, so the same solver serves FP8 (per-tensor / per-channel scales)
and integer grids. Minimises ||W X - Q X||^2 for the X whose Hessian H = X^T X was accumulated.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

# fake_quant_col(w_col [out], j) -> quantized column [out]; j is the column's index in the original W.
ColumnQuantizer = Callable[[torch.Tensor, int], torch.Tensor]


def accumulate_hessian(H: torch.Tensor | None, x: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """Running mean of 2 x^T x over rows of x [..., in]; returns (H [in, in] fp32, rows seen)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    n = rows.shape[0]
    if H is None:
        H = torch.zeros(rows.shape[1], rows.shape[1], dtype=torch.float32, device=rows.device)
    total = count + n
    H.mul_(count / total).add_(rows.T @ rows, alpha=2.0 / total)
    return H, total


@contextmanager
def _one_thread():
    """The column loop is thousands of tiny ops: OpenMP fork/join costs more than the math (measured
    30x slower with 2 threads on a 2-core machine under load). Restores the caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _inverse_hessian_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp*mean(diag) I)^-1, retrying with more damping if needed."""
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    mean_diag = torch.diag(H).mean().clamp_min(1e-12)
    for attempt in range(6):
        try:
            L = torch.linalg.cholesky(H + (damp * 10**attempt) * mean_diag * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
        except torch.linalg.LinAlgError:
            continue
    raise torch.linalg.LinAlgError("GPTQ: Hessian is not positive definite even with 1e5x damping")


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    fake_quant_col: ColumnQuantizer,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
) -> torch.Tensor:
    """Return the GPTQ-quantized (fake-quant, fp32) copy of W [out, in]; W is not modified.

    H [in, in]: input Hessian. Columns whose inputs are always zero are quantized as zero.
    act_order: visit columns by decreasing H diagonal (largest inputs first).
    """
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    n = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    order = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(n, device=W.device)
    W = W[:, order]
    H = H[order][:, order]
    Q = torch.zeros_like(W)
    with _one_thread():
        Hinv = _inverse_hessian_cholesky(H, damp)
        _solve(W, Hinv, Q, order, fake_quant_col, block_size)
    return Q[:, torch.argsort(order)]


def _solve(W, Hinv, Q, order, fake_quant_col, block_size) -> None:
    n = W.shape[1]
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            q = fake_quant_col(w, int(order[i1 + i]))
            Q[:, i1 + i] = q
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
