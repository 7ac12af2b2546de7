"""Sign-gradient rounding (SignRound, Cheng et al. 2023; what Intel's auto-round runs), as pure pieces.

A weight w on a grid with fixed params is rounded as fq(x0 + v * s): s the grid's own scale at w's
position (the group, block, row or tensor scale), v a trainable offset in [-0.5, 0.5] steps, and fq the
grid's own fake-quant (any grid: integer, FP8, FP4, MX), passed through with a straight-through
gradient. The offsets are trained by signed gradient descent on a block's output error
(calibrate/signround.py); only the rounding direction of each weight changes, never the params, so the
export is what the solver wrote with other codes.

x0, the starting point, is where the solver rounded from, moved inside the cell of the solver's result q
when it is not there already: the float weights for round-to-nearest (SignRound as published), GPTQ's
error-updated weights for GPTQ (its own rounding positions: a weight GPTQ rounded from near a cell edge is
cheap to flip), so step 0 is exactly the solver's result.
"""

from __future__ import annotations

from typing import Callable

import torch

FakeQuant = Callable[[torch.Tensor], torch.Tensor]

REACH = 0.5  # |v| <= 0.5 steps: one code either way of round-to-nearest (SignRound's bound)
INSIDE = 0.499  # x0 stays this far inside q's cell (in steps), so fq(x0) == q without a tie


def step_of(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A grid's scale ([1], [out, 1] or one per group/block column run [out, in / n]) at every weight."""
    if scale.numel() == 1 or scale.shape[-1] == 1:
        return scale.reshape(-1, 1).expand(shape) if scale.numel() > 1 else scale.reshape(1, 1).expand(shape)
    return scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)


class Offsets:
    """Trainable rounding offsets for one stacked weight: `weight()` is its fake-quant, differentiable in v."""

    def __init__(self, start: torch.Tensor, q: torch.Tensor, step: torch.Tensor, fq: FakeQuant):
        self.fq, self.step = fq, step
        with torch.no_grad():
            x0 = q + (start - q).clamp(-INSIDE * step, INSIDE * step)
            self.x0 = torch.where(fq(x0) == q, x0, q)  # a cell narrower than the step (FP grids near 0): q
        self.v = torch.zeros_like(q, requires_grad=True)

    def weight(self) -> torch.Tensor:
        """forward: fq(x0 + v * step); gradient: straight through to v (dL/dv = dL/dw * step). One graph
        node (_StraightThrough) instead of the three of x + (fq(x) - x).detach(), with the same values."""
        return _StraightThrough.apply(self.v, self)

    def codes(self, v: torch.Tensor | None = None) -> torch.Tensor:
        """The fake-quant weight at offsets v (default: the current ones), without a graph."""
        with torch.no_grad():
            return self.fq(self.x0 + (self.v if v is None else v) * self.step)

    def sign_step(self, lr: float) -> None:
        """v <- clamp(v - lr * sign(dL/dv), +-REACH); the gradient is cleared."""
        with torch.no_grad():
            if self.v.grad is not None:
                self.v.sub_(lr * torch.sign(self.v.grad)).clamp_(-REACH, REACH)
                self.v.grad = None


class _StraightThrough(torch.autograd.Function):
    """w = x + (fq(x) - x) with x = x0 + v * step, computed as the plain expression (the same bits), and a
    backward that is the straight-through estimator's: grad * step."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, offsets: Offsets) -> torch.Tensor:
        ctx.offsets = offsets
        x = offsets.x0 + v * offsets.step
        return x + (offsets.fq(x) - x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.offsets.step, None
