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

import functools
import inspect
import re
from typing import Callable

import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.views import SourceView

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")  # Qwen-MoE / DeepSeek naming
W1_W3_W2 = ("w1", "w3", "w2")  # Mixtral naming: w1 gate, w3 up, w2 down
UP_DOWN = (None, "up_proj", "down_proj")  # experts without a gate (Nemotron-H): down(act(up(x)))


class ExpertMLP(torch.nn.Module):
    """One expert: down(act(gate(x)) * up(x)) (down(act(up(x))) without a gate), with the checkpoint's
    leaf names. `glu`, when given, replaces act(gate) * up: the family's own gating of the two halves
    (clamped SwiGLU variants)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        act: Callable,
        names: tuple[str | None, str, str] = GATE_UP_DOWN,
        glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        self.names, self.act, self.glu = names, act, glu
        gate, up, down = names
        if gate is not None:
            self.add_module(gate, torch.nn.Linear(hidden, inter, bias=False))
        self.add_module(up, torch.nn.Linear(hidden, inter, bias=False))
        self.add_module(down, torch.nn.Linear(inter, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self._modules.get(n) if n else None for n in self.names)
        if gate is None:
            return down(self.act(up(x)))
        if self.glu is not None:
            return down(self.glu(gate(x), up(x)))
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
    moe: torch.nn.Module, count: int, hidden: int, inter: int, act: Callable, *, names=GATE_UP_DOWN, glu=None
) -> None:
    """Swap `moe.experts` (transformers' fused 3-D experts) for per-expert Linears on the meta device."""
    with torch.device("meta"):
        moe.experts = Experts([ExpertMLP(hidden, inter, act, names, glu) for _ in range(count)])


def token_counts(top_k_index: torch.Tensor, count: int) -> torch.Tensor:
    """Routed (token, expert) pairs per expert."""
    flat = top_k_index.flatten()
    return torch.bincount(flat[(flat >= 0) & (flat < count)], minlength=count).cpu()


# transformers' fused 3-D experts, found and unfused for any family (the generic adapter)
_MODEL_FREE = "quantize it data-free by tensor names: `fp8ptq model-free MODEL -r fp8-dynamic -o OUT`"


def is_fused_experts(m: torch.nn.Module) -> bool:
    """transformers' routed experts: 3-D `gate_up_proj` (or `up_proj`, experts without a gate) and
    `down_proj`, called with the routing (`top_k_index`). Shared experts stacked in 3-D tensors (run on
    every token, no routing) are not: they stay as stored, in float."""
    p = m._parameters
    up = p.get("gate_up_proj", p.get("up_proj"))
    if up is None or up.dim() != 3 or p.get("down_proj") is None:
        return False
    return "top_k_index" in inspect.signature(type(m).forward).parameters


def fused_experts(layers: torch.nn.ModuleList) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Layer-relative paths of fused experts modules, and of the routers and shared-expert gates, which
    are never quantized: a module beside the experts, or inside such a sibling (afmoe's
    `router.gate`), whose 2-D weight has one row per expert (a router) or one row (a gate)."""
    at, keep = set(), set()
    for layer in layers:
        for n, m in layer.named_modules():
            if not is_fused_experts(m):
                continue
            at.add(n)
            parent_name = n.rpartition(".")[0]
            parent = layer.get_submodule(parent_name) if parent_name else layer
            count = m.down_proj.shape[0]
            for c, child in parent.named_children():
                if child is m:
                    continue
                for g, inner in child.named_modules():
                    w = getattr(inner, "weight", None)
                    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] in (count, 1):
                        path = ".".join(p for p in (parent_name, c, g) if p)
                        keep.add(path)
    return tuple(sorted(at)), tuple(sorted(keep))


def stored_expert_leaves(model: torch.nn.Module) -> tuple[str | None, str, str] | None:
    """The leaf names a checkpoint gives one expert's weights ((gate, up, down), gate None for experts
    without one), read off transformers' own checkpoint converters of `model` (the per-expert tensors
    its loader merges into 3-D experts: `experts.*.w1.weight` + `experts.*.w3.weight` -> gate_up_proj);
    None when transformers converts none (the checkpoint stores the experts as the model holds them)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    found: dict[str, list[str]] = {}
    for t in get_model_conversion_mapping(model):
        if not isinstance(t, WeightConverter) or len(t.target_patterns) != 1:
            continue
        leaves = [re.search(r"experts\.\*\.(\w+)\.weight$", p) for p in t.source_patterns]
        target = re.search(r"experts\.(gate_up_proj|up_proj|down_proj)$", t.target_patterns[0])
        if target and leaves and all(leaves):
            found[target.group(1)] = [m.group(1) for m in leaves]
    if "down_proj" not in found:
        return None
    if len(found.get("gate_up_proj", ())) == 2:
        return (*found["gate_up_proj"], found["down_proj"][0])
    if len(found.get("up_proj", ())) == 1:
        return (None, found["up_proj"][0], found["down_proj"][0])
    return None


def unfuse_experts(layer: torch.nn.Module, config, leaves: tuple | None = None) -> None:
    """transformers' fused 3-D experts -> one Linear per expert weight, named as checkpoints store them
    (`leaves`: stored_expert_leaves; default gate_proj/up_proj/down_proj)."""
    for n, m in list(layer.named_modules()):
        if not is_fused_experts(m):
            continue
        gated = m._parameters.get("gate_up_proj") is not None
        count, rows, hidden = (m.gate_up_proj if gated else m.up_proj).shape
        inter = rows // 2 if gated else rows
        if tuple(m.down_proj.shape) != (count, hidden, inter) or any(
            k.endswith("bias") and v is not None for k, v in m._parameters.items()
        ):
            raise ModelError(
                f"experts '{n}' ({type(m).__name__}) are not laid out as [E, 2I, H] (or [E, I, H]) / [E, H, I] "
                "without biases",
                fix=_MODEL_FREE,
            )
        parent_name, _, leaf = n.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        names = leaves or (GATE_UP_DOWN if gated else UP_DOWN)
        if (names[0] is not None) != gated:
            raise ModelError(f"experts '{n}': the checkpoint's expert names {names} do not match {type(m).__name__}")
        act, glu = _gating(n, m)
        replace_experts(parent, count, hidden, inter, act, names=names, glu=glu)
        if leaf != "experts":
            parent._modules[leaf] = parent._modules.pop("experts")


def _gating(name: str, m: torch.nn.Module) -> tuple[Callable, Callable | None]:
    """The activation of a fused experts module and, for families that gate the two halves their own
    way (`_apply_gate(gate_up)`: clamped SwiGLU), that gating as a function of (gate, up)."""
    apply_gate = getattr(type(m), "_apply_gate", None)
    if apply_gate is not None:
        return torch.nn.Identity(), functools.partial(_glu_of, functools.partial(apply_gate, m))
    act = getattr(m, "act_fn", None)
    if act is None:
        raise ModelError(
            f"experts '{name}' ({type(m).__name__}) have neither an act_fn nor an _apply_gate: their gating is unknown",
            fix=_MODEL_FREE,
        )
    return act, None


def _glu_of(apply_gate: Callable, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return apply_gate(torch.cat([gate, up], dim=-1))


def fused_views(stored: dict[str, str], experts: dict[str, tuple[int, int]], leaves: tuple[str | None, str, str]):
    """Per-expert Linear weights (named as after unfusing, `model.layers.3.mlp.experts.7.gate_proj.weight`)
    as views of a checkpoint's fused 3-D tensors. `experts`: a fused experts module's path -> (expert
    count, intermediate size); `stored`: a fused parameter's module name (`...experts.gate_up_proj`) ->
    the checkpoint's name for it (absent: not in the checkpoint). gate_up_proj [E, 2I, H] holds the
    gate rows first, then the up rows (the `.chunk(2, dim=-1)` of transformers' experts forward)."""
    gate, up, down = leaves
    views = {}
    for path, (count, inter) in experts.items():
        fused_up = stored.get(f"{path}.gate_up_proj" if gate else f"{path}.up_proj")
        fused_down = stored.get(f"{path}.down_proj")
        if fused_up is None or fused_down is None:
            continue
        for e in range(count):
            views[f"{path}.{e}.{down}.weight"] = SourceView(fused_down, e)
            if gate is None:
                views[f"{path}.{e}.{up}.weight"] = SourceView(fused_up, e)
            else:
                views[f"{path}.{e}.{gate}.weight"] = SourceView(fused_up, e, rows=(0, inter))
                views[f"{path}.{e}.{up}.weight"] = SourceView(fused_up, e, rows=(inter, 2 * inter))
    return views
