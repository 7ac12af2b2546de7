"""Mixture-of-experts blocks as calibration, export and the evaluator see them.

transformers 5 holds a layer's experts fused in two 3-D parameters (gate_up_proj [E, 2I, H] and
down_proj [E, H, I]) and converts the checkpoint's per-expert tensors on load. fp8ptq needs the
checkpoint's own layout instead: one nn.Linear per expert weight, named as on disk
(`mlp.experts.7.gate_proj`, `block_sparse_moe.experts.7.w1`), so that every expert is a group the
pipeline can hook, calibrate and quantize, and export writes the per-expert names vLLM's
compressed-tensors MoE loader reads (FusedMoE.make_expert_params_mapping: `experts.{e}.{gate,up,down}_proj`
or `w1/w3/w2` -> w13/w2; checked in vLLM 0.32). An adapter's `prepare_layer` calls `replace_experts`.

`Experts.forward` keeps transformers' experts interface (hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) and its math: each token's output is the sum over its k experts of
weight * expert(token). Two calibration switches: `observe_all` (experts that run on every token,
while the output still uses only the tokens routed to them: the fallback for experts the router
starves) and `only` (a stats pass over a batch of experts runs just those: an expert's inputs never
depend on other experts' weights).
"""

from __future__ import annotations

from typing import Callable

import torch

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")  # Qwen-MoE / DeepSeek naming
W1_W3_W2 = ("w1", "w3", "w2")  # Mixtral naming: w1 gate, w3 up, w2 down


class ExpertMLP(torch.nn.Module):
    """One expert: down(act(gate(x)) * up(x)), with the checkpoint's leaf names."""

    def __init__(self, hidden: int, inter: int, act: Callable, names: tuple[str, str, str] = GATE_UP_DOWN):
        super().__init__()
        self.names, self.act = names, act
        gate, up, down = names
        self.add_module(gate, torch.nn.Linear(hidden, inter, bias=False))
        self.add_module(up, torch.nn.Linear(hidden, inter, bias=False))
        self.add_module(down, torch.nn.Linear(inter, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self._modules[n] for n in self.names)
        return down(self.act(gate(x)) * up(x))


class Experts(torch.nn.ModuleList):
    """A layer's experts as separate modules `0..E-1`, with transformers' experts forward."""

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__(experts)
        self.observe_all: frozenset[int] = frozenset()
        self.only: frozenset[int] | None = None  # stats passes: run just these experts (output incomplete)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        hit = set(torch.unique(top_k_index).tolist())
        for e in sorted(hit | self.observe_all):
            if not 0 <= e < len(self) or (self.only is not None and e not in self.only):  # E: padding
                continue
            token, pos = torch.where(top_k_index == e)
            if e in self.observe_all:
                y = self[e](hidden_states)[token]  # every token through the expert; output keeps the routing
            elif token.numel():
                y = self[e](hidden_states[token])
            else:
                continue
            out.index_add_(0, token, (y * top_k_weights[token, pos, None]).to(out.dtype))
        return out


def replace_experts(
    moe: torch.nn.Module, count: int, hidden: int, inter: int, act: Callable, names=GATE_UP_DOWN
) -> None:
    """Swap `moe.experts` (transformers' fused 3-D experts) for per-expert Linears on the meta device."""
    with torch.device("meta"):
        moe.experts = Experts([ExpertMLP(hidden, inter, act, names) for _ in range(count)])


def token_counts(top_k_index: torch.Tensor, count: int) -> torch.Tensor:
    """Routed (token, expert) pairs per expert."""
    flat = top_k_index.flatten()
    return torch.bincount(flat[(flat >= 0) & (flat < count)], minlength=count).cpu()
