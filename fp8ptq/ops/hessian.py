"""GPTQ's input Hessian H = 2 X^T X of a Linear's calibration inputs, accumulated chunk by chunk."""

from __future__ import annotations

import torch

from fp8ptq.ops.precision import strict_fp32


def hessian_partial(x: torch.Tensor) -> torch.Tensor:
    """2 X^T X (fp32, [in, in]) over the rows of x [..., in]: one chunk's unnormalised contribution, to be
    summed in a fixed order (`gptq` needs no division by the row count). fp32 matmuls are bit-reproducible
    only for a fixed BLAS thread count: compute partials with one thread count wherever bits must match."""
    rows = x.detach().reshape(-1, x.shape[-1]).float()
    return _gram(rows).mul_(2.0)


def _gram(rows: torch.Tensor, blocks: int = 4) -> torch.Tensor:
    """rows^T rows, exactly symmetric: from 512 wide the upper row blocks only (5/8 of the work), mirrored.
    IEEE fp32 even inside a TF32 pass (--compute-dtype tf32): GPTQ solves on it."""
    with strict_fp32():
        return _gram_fp32(rows, blocks)


def _gram_fp32(rows: torch.Tensor, blocks: int) -> torch.Tensor:
    n = rows.shape[1]
    if n < 512:
        return rows.T @ rows
    b, H = -(-n // blocks), torch.empty(n, n, dtype=rows.dtype, device=rows.device)
    for i in range(0, n, b):
        torch.mm(rows[:, i : i + b].T, rows[:, i:], out=H[i : i + b, i:])
        H[i + b :, i : i + b] = H[i : i + b, i + b :].T
    return H


def accumulate_hessian(
    H: torch.Tensor | None, x: torch.Tensor, count: int, mean: bool = True
) -> tuple[torch.Tensor, int]:
    """Add rows of x [..., in] to H; returns (H [in, in] fp32, rows seen). H is updated in place.

    mean=True keeps the running mean of 2 x^T x; mean=False keeps the plain sum (= the sum of
    `hessian_partial`), which GPTQ accepts unchanged because its damping is relative to mean(diag H).
    """
    rows = x.reshape(-1, x.shape[-1]).float()
    n = rows.shape[0]
    if H is None:
        H = torch.zeros(rows.shape[1], rows.shape[1], dtype=torch.float32, device=rows.device)
    total = count + n
    if mean:
        H.mul_(count / total).add_(_gram(rows), alpha=2.0 / total)
    else:
        H.add_(_gram(rows), alpha=2.0)
    return H, total
