"""Which modules choose: those whose output reaches a top-k selection (an MoE router, a sparse
attention's indexer), found by running a layer and following every tensor back to the last weight it
was multiplied by, whatever the modules are called.

A traced tensor is either an activation, labelled with the weights that last multiplied it (the
layer's input carries none), or a tensor computed from weights alone (a weight cast to float32 before
its product, as DeepSeek's router does), labelled with those weights. A product (linear, matmul,
einsum) of an activation with a weight starts a new label (that weight); any other operation with an
activation passes the union of its inputs' labels on. A selection (`topk`, `sort`, `argsort`, `argmax`) records its
input's label; so does a `max` or `min` along a dimension once an operation reads the indices it returned
(phimoe's sparsemixer chooses so; a softmax that subtracts the maximum, as gpt-oss's attention with sinks
does, reads only the values). Only 2-D weights count: norms and biases scale a tensor, they do not produce one.
The values do not matter, only what each tensor was computed from, so a layer with random weights
traces like the real one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from fp8ptq.models.moe import Experts, is_fused_experts

SELECTIONS = frozenset(
    {
        torch.topk,
        torch.Tensor.topk,
        torch.sort,
        torch.Tensor.sort,
        torch.argsort,
        torch.Tensor.argsort,
        torch.argmax,
        torch.Tensor.argmax,
    }
)
# the products a weight makes a new tensor by; any other use of a weight (a bias added, an elementwise
# scale: ernie4_5_moe adds a [1, E] correction to its router's scores) passes the labels on
PRODUCTS = frozenset(
    {
        torch.nn.functional.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.bmm,
        torch.einsum,
        torch.addmm,
        torch.baddbmm,
    }
)
NONE: frozenset[str] = frozenset()


class Lineage(TorchFunctionMode):
    """The labels of a traced run (see module doc); `chosen` holds the modules whose weight's product
    reached a selection."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.weights = {  # id of a 2-D weight -> its module
            id(p): n for n, m in module.named_modules() for p in m.parameters(recurse=False) if p.dim() == 2
        }
        self.activations: dict[int, frozenset[str]] = {}  # id -> the weights that last multiplied it
        self.derived: dict[int, frozenset[str]] = {}  # id of a tensor computed from weights alone -> them
        self.alive: list[torch.Tensor] = []  # every labelled tensor stays alive: its id stays its own
        self.where: dict[int, frozenset[str]] = {}  # id of the indices a max/min along a dim returned -> label
        self.chosen: set[str] = set()

    def seed(self, x: torch.Tensor) -> None:
        """`x` is the layer's input: an activation no weight has multiplied yet."""
        self._label(self.activations, x, NONE)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        weights = NONE.union(*(self._weights_of(t) for t in tensors))
        activations = [self.activations[id(t)] for t in tensors if id(t) in self.activations]
        label = self.activations.get(id(tensors[0])) if tensors else None
        if label is not None and func in SELECTIONS:
            self.chosen |= label
        elif label is not None and isinstance(out, tuple) and hasattr(out, "indices"):
            self.where[id(out.indices)] = label  # max/min along a dim: chooses once the indices are read
        for t in tensors:
            self.chosen |= self.where.get(id(t), NONE)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if activations:
                product = weights and func in PRODUCTS
                self._label(self.activations, t, weights if product else NONE.union(*activations))
            elif weights:
                self._label(self.derived, t, weights)
        return out

    def _weights_of(self, t: torch.Tensor) -> frozenset[str]:
        name = self.weights.get(id(t))
        return frozenset((name,)) if name is not None else self.derived.get(id(t), NONE)

    def _label(self, table: dict, t: torch.Tensor, label: frozenset[str]) -> None:
        self.activations.pop(id(t), None)
        self.derived.pop(id(t), None)
        table[id(t)] = label
        self.alive.append(t)


class NoExperts(torch.nn.Module):
    """Stands in for routed experts in a traced copy: they run after the choice, and materializing them
    would cost the whole layer's memory. Returns zeros shaped as the hidden states they were given."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def random_copy(layer: torch.nn.Module, strip: Callable[[torch.nn.Module], None] = lambda _m: None) -> torch.nn.Module:
    """A float32 CPU copy of a (meta-device) `layer` with small random weights, for tracing; `strip`
    edits the copy before its weights are allocated (drops the experts)."""
    probe = copy.deepcopy(layer)
    strip(probe)
    probe.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return probe.float()


def without_fused_experts(layer: torch.nn.Module) -> None:
    """`random_copy`'s strip for a layer as transformers builds it: its fused experts become NoExperts."""
    for n, m in list(layer.named_modules()):
        if is_fused_experts(m):
            parent, _, leaf = n.rpartition(".")
            layer.get_submodule(parent)._modules[leaf] = NoExperts()


def without_routed_experts(layer: torch.nn.Module) -> None:
    """`random_copy`'s strip for a layer with fp8ptq's unfused experts: none is kept, none runs
    (Experts.forward skips the experts it lacks)."""
    for m in layer.modules():
        if isinstance(m, Experts):
            m._modules.clear()
