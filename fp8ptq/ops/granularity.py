"""Granularity of a scale: a small frozen value the math converts into shapes once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Granularity:
    """How many elements share one scale.

    kind: "tensor" (one scale), "channel" (one per output row of a weight [out, in]),
    "token" (one per row of an activation [..., in]), "group" (one per `group_size` consecutive
    elements along the last dim), "tensor_group" (groups as "group", plus one global scale per tensor:
    NVFP4's two levels) or "block" (one per `block` = (rows, cols) tile of a 2-D weight; edge tiles
    may be partial).
    """

    kind: str
    group_size: int | None = None
    block: tuple[int, int] | None = None

    def __post_init__(self):
        assert self.kind in KINDS, self.kind
        assert (self.kind in ("group", "tensor_group")) == (self.group_size is not None), self
        assert (self.kind == "block") == (self.block is not None), self


KINDS = ("tensor", "channel", "token", "group", "tensor_group", "block")
TENSOR = Granularity("tensor")
CHANNEL = Granularity("channel")
TOKEN = Granularity("token")


def group(n: int) -> Granularity:
    return Granularity("group", n)


def tensor_group(n: int) -> Granularity:
    return Granularity("tensor_group", n)


def block(rows: int, cols: int) -> Granularity:
    return Granularity("block", block=(rows, cols))


def _blocks(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """x [out, in] (fp32) zero-padded to whole tiles and viewed as [out/m, m, in/n, n]."""
    m, n = g.block
    rows, cols = x.shape
    pr, pc = -rows % m, -cols % n
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape(x.shape[0] // m, m, x.shape[1] // n, n)


def reduce_amax(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """abs-max of x reduced to the scale shape of `g`, kept broadcastable against x.

    tensor -> [1]; channel/token -> [rows, 1] (x viewed as [-1, last]); group / tensor_group ->
    [rows, last/n]; block -> [ceil(out/m), ceil(in/n)] of a 2-D x.
    NaN is propagated so a broken input is not silently hidden by max().
    """
    if g.kind == "tensor":
        if not x.numel():
            return torch.zeros(1, device=x.device)
        lo, hi = torch.aminmax(x.detach())  # no |x| temporary: calibration inputs can be GBs
        return torch.maximum(-lo, hi).float().reshape(1)
    if g.kind == "block":
        return _blocks(x.detach().abs().float(), g).amax(dim=(1, 3))
    rows = x.detach().abs().float().reshape(-1, x.shape[-1])
    if g.kind in ("channel", "token"):
        return rows.amax(dim=-1, keepdim=True)
    n = g.group_size
    assert rows.shape[-1] % n == 0, (rows.shape, n)
    return rows.reshape(rows.shape[0], -1, n).amax(dim=-1)


def reduce_minmax(x: torch.Tensor, g: Granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of x (fp32) reduced to the scale shape of `g`, like `reduce_amax`; NaN propagates.

    Asymmetric integer grids need both ends, not just |x|.
    """
    if g.kind == "tensor":
        if not x.numel():
            return torch.zeros(1, device=x.device), torch.zeros(1, device=x.device)
        lo, hi = torch.aminmax(x.detach())
        return lo.float().reshape(1), hi.float().reshape(1)
    if g.kind == "block":
        t = _blocks(x.detach().float(), g)
        return t.amin(dim=(1, 3)), t.amax(dim=(1, 3))
    rows = x.detach().float().reshape(-1, x.shape[-1])
    if g.kind in ("group", "tensor_group"):
        n = g.group_size
        assert rows.shape[-1] % n == 0, (rows.shape, n)
        lo, hi = torch.aminmax(rows.reshape(rows.shape[0], -1, n), dim=-1)
        return lo, hi
    lo, hi = torch.aminmax(rows, dim=-1, keepdim=True)
    return lo, hi


def expand_scale(scale: torch.Tensor, x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """Broadcast a scale of granularity g to x's 2-D view [-1, last]."""
    if g.kind == "tensor":
        return scale.reshape(1, 1)
    if g.kind in ("channel", "token"):
        return scale.reshape(-1, 1)
    if g.kind == "block":
        m, n = g.block
        full = scale.repeat_interleave(m, dim=0).repeat_interleave(n, dim=1)
        return full[: x.shape[0], : x.shape[-1]]
    return scale.repeat_interleave(g.group_size, dim=-1)


def finite_values(x: torch.Tensor) -> torch.Tensor:
    """x itself when every value is finite (one aminmax reduction), else a copy with NaN and +-inf set to
    0, for choosing scales: the new formats' scales (block FP8, NVFP4, MXFP4, W4A8) are taken over a
    group's finite values, so an all-NaN/inf or all-zero group still gets a finite, positive scale.
    Defence in depth only: the loader refuses NaN/inf weights (errors.NonFiniteError), and the
    fake-quant still applies the scale to the original values (a NaN stays NaN, an inf saturates)."""
    if x.numel() == 0:
        return x
    lo, hi = torch.aminmax(x)
    if math.isfinite(float(lo)) and math.isfinite(float(hi)):
        return x
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
