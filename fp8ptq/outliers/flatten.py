"""FlattenQuant on the MLP intermediate (the down_proj input), exactly.

A channel c of a = silu(gate(x)) * up(x) split k ways: duplicate gate row c k times, duplicate up row
c divided by k, duplicate down column c. Each copy carries a_c / k and the k copies sum back to a_c
through the same down column: the function is unchanged, but the channel's largest value shrinks k
times, so a per-tensor activation scale of the down_proj input shrinks with it.

All layers share one width (config.intermediate_size): each layer spends the same number of extra
channels on its own worst channels, chosen greedily to minimise the largest piece (the per-tensor
max); the width is rounded up to `multiple` x `tp` so tensor-parallel shards stay even.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlattenPlan:
    """New channel j reads source channel src[j] scaled by mult[j] (1/k for a k-way split, 0 = padding)."""

    src: torch.Tensor  # long [new_width]
    mult: torch.Tensor  # float32 [new_width]
    pieces: torch.Tensor  # long [old_width]: k per source channel

    @property
    def width(self) -> int:
        return int(self.src.numel())


def flattened_width(width: int, extra: int, multiple: int = 128, tp: int = 1) -> int:
    """Old MLP width + `extra`, rounded up to a multiple of multiple * tp."""
    step = multiple * tp
    return -(-(width + extra) // step) * step


def plan_flatten(channel_amax: torch.Tensor, new_width: int, max_pieces: int = 64) -> FlattenPlan:
    """Split the largest channels so the max over pieces (channel_amax[c] / k_c) is as small as possible
    with sum(k_c) <= new_width; leftover slots (only if every channel hit max_pieces) are zero padding."""
    amax = channel_amax.float().cpu()
    width = amax.numel()
    assert new_width >= width, (new_width, width)
    pieces = torch.ones(width, dtype=torch.long)
    # max-heap on the current piece size; ties broken by channel index for determinism
    heap = [(-float(a), c) for c, a in enumerate(amax.tolist())]
    heapq.heapify(heap)
    for _ in range(new_width - width):
        while heap:
            neg, c = heapq.heappop(heap)
            if pieces[c] < max_pieces:
                break
        else:
            break
        pieces[c] += 1
        heapq.heappush(heap, (-float(amax[c]) / int(pieces[c]), c))
    src = torch.repeat_interleave(torch.arange(width), pieces)
    mult = (1.0 / pieces.float())[src]
    pad = new_width - src.numel()
    if pad:
        src = torch.cat([src, torch.zeros(pad, dtype=torch.long)])
        mult = torch.cat([mult, torch.zeros(pad)])
    return FlattenPlan(src, mult, pieces)


def apply_flatten(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, plan: FlattenPlan):
    """(gate [I, h], up [I, h], down [h, I]) -> the flattened (gate', up', down') with width plan.width.
    Padding channels get zero gate and up rows (silu(0) * 0 = 0) and zero down columns."""
    live = (plan.mult > 0).to(gate.dtype)
    src = plan.src.to(gate.device)
    k = plan.pieces[plan.src].to(up.device, up.dtype)  # divide by k in the weights' own precision
    gate2 = gate[src] * live.to(gate.device)[:, None]
    up2 = up[src] / k[:, None] * live.to(up.device)[:, None]
    down2 = down[:, src] * live.to(down.device, down.dtype)[None, :]
    return gate2, up2, down2


def flattened_amax(channel_amax: torch.Tensor, plan: FlattenPlan) -> float:
    """The per-tensor max of the down_proj input after flattening (what its static scale must cover)."""
    return float((channel_amax.float().cpu() / plan.pieces.float()).max())
