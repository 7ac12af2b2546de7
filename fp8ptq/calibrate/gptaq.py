"""GPTQ towards the float model's output (calibration.gptq_float_target; GPTAQ's asymmetric calibration, Li et
al. 2025, as GPTQModel ships it as "GPTQ v2").

Plain GPTQ minimises ||(W - Q) X~^T|| over the inputs X~ the quantized past gives a Linear: each Linear is
faithful to its own input, and the drift the Linears before it left passes through. The float model's output
of the Linear on its own input X is the other target: ||W X^T - Q X~^T||. That splits exactly into a float
least-squares problem and plain GPTQ: with H = 2 X~^T X~ (GPTQ's Hessian) and D = 2 (X - X~)^T X~,

    ||W X^T - Q X~^T||^2 = ||(W* - Q) X~^T||^2 + const,   W* = W + W D H^-1,

W* being the weight that maps the quantized model's input best to the float model's output. GPTQ then runs
unchanged, with the same H, on W' = W + alpha W D (H + damp I)^-1: alpha (the option's value) is how far
towards W*, damp is GPTQ's own damping (gptq_damp of H's mean diagonal). alpha 1 fits the calibration tokens'
drift exactly and generalises worse; GPTQModel's default is 0.25 (BENCHMARKS.md has the measured values).

X comes from the run's float stream (the one SignRound's targets use, calibrate/signround.py): the float
block's pass records each plain group's input per chunk, held for the block (tokens x in-features per group, in
the passes' dtype), and the group's Hessian pass sums D chunk by chunk in the same fixed tree as H. MoE expert
stages are left as plain GPTQ (an expert's tokens differ between the two streams).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from fp8ptq.dist import TreeSum
from fp8ptq.ops.hessian import hessian_partial
from fp8ptq.ops.precision import strict_fp32


@contextmanager
def record_float_inputs(cal, stages: list):
    """While the float block runs: each plain group's input per chunk (the pass's `cal.chunk`) into
    cal.float_inputs; a no-op unless the recipe asks for gptq_float_target."""
    handles = []
    if cal.recipe.calibration.gptq_float_target > 0:
        for group in (s for s in stages if isinstance(s, tuple)):

            def hook(_m, args, g=group):
                cal.float_inputs.setdefault(g, {})[cal.chunk[0]] = args[0].detach().clone()

            handles.append(cal.modules[group[0]].register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class CrossTerm:
    """D = 2 (X - X~)^T X~ over the chunks, summed in dist.TreeSum's fixed tree; X: the recorded float inputs
    (each consumed as its chunk is added)."""

    def __init__(self, float_inputs: dict[int, torch.Tensor]):
        self.float_inputs, self.tree = float_inputs, TreeSum()

    @classmethod
    def of(cls, float_inputs: dict, group) -> CrossTerm | None:
        """The group's cross term when its float inputs were recorded, else None (plain GPTQ)."""
        return cls(float_inputs.pop(group)) if group in float_inputs else None

    def add(self, chunk: int, x_quant: torch.Tensor) -> None:
        xq = x_quant.detach().reshape(-1, x_quant.shape[-1]).float()
        x = self.float_inputs.pop(chunk).reshape(xq.shape).float()
        with strict_fp32():
            self.tree.add(chunk, ((x - xq).T @ xq).mul_(2.0))

    def total(self, comm) -> torch.Tensor:
        return self.tree.total(comm)


class GroupHessian:
    """A group's GPTQ Hessian H = the sum of 2 x^T x over the chunks (dist.TreeSum's fixed tree) and, where the
    float pass recorded the group's inputs, the cross term D beside it (`CrossTerm`), from the same inputs."""

    def __init__(self, float_inputs: dict, group):
        self.tree, self.cross = TreeSum(), CrossTerm.of(float_inputs, group)

    def add(self, chunk: int, x: torch.Tensor) -> None:
        self.tree.add(chunk, hessian_partial(x))
        if self.cross is not None:
            self.cross.add(chunk, x)

    def total(self, comm) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(H, D), D None without recorded float inputs (plain GPTQ)."""
        return self.tree.total(comm), (None if self.cross is None else self.cross.total(comm))


def toward_float(weights: dict[str, torch.Tensor], D: torch.Tensor | None, H: torch.Tensor, cal) -> dict:
    """Each shard's W + alpha W D (H + damp mean(diag H) I)^-1 (fp32; solved in fp64), alpha =
    cal.gptq_float_target; `weights` unchanged without a cross term."""
    if D is None:
        return weights
    A = H.to(torch.float64, copy=True)  # H stays GPTQ's, undamped here
    A.diagonal().add_(A.diagonal().mean().clamp_min(1e-12) * cal.gptq_damp)  # on the device: no host sync
    M = torch.linalg.solve(A, D.double().T).T.mul_(cal.gptq_float_target)  # alpha D A^-1 (A symmetric)
    moved = {}
    for n, w in weights.items():
        w64 = w.double()
        moved[n] = torch.addmm(w64, w64, M).float()
    return moved
