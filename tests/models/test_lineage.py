"""Routers found by what they do (models/arch/lineage.py): the modules whose output reaches a top-k
selection, whatever they are called, kept float."""

from __future__ import annotations

import re

import pytest
import torch

from fp8ptq.models.arch import ARCHS
from fp8ptq.models.arch.capture import stored_path
from fp8ptq.models.arch.generic import discover
from fp8ptq.models.arch.lineage import Lineage

pytestmark = pytest.mark.tiny


class Chooser(torch.nn.Module):
    """An MoE-like block whose router is called `mixer` and is a bare weight cast to float32 before its
    product (as DeepSeek's is), beside a decoy Linear with one row per expert that chooses nothing."""

    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.mixer = torch.nn.Parameter(torch.randn(experts, hidden))
        self.decoy = torch.nn.Linear(hidden, experts)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.proj(x)
        logits = torch.nn.functional.linear(h.float(), self.mixer.float())
        _, chosen = torch.topk(logits.softmax(-1) + 0.1, 2, dim=-1)
        return h * self.decoy(h).sigmoid().sum(-1, keepdim=True) + chosen.float().sum(-1, keepdim=True)


def test_the_module_whose_product_reaches_the_top_k_is_the_router():
    block = Chooser()
    x = torch.randn(1, 3, 16)
    with Lineage(block) as lineage:
        lineage.seed(x)
        block(x)
    assert lineage.chosen == {""}  # the block's own weight (`mixer`), not `proj` before it nor the decoy


def test_a_maximum_along_a_dimension_selects_too():
    """phimoe's sparsemixer picks its experts with `max(dim=-1)`, no topk."""
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with Lineage(lin) as lineage:
        lineage.seed(x)
        assert lin(x).max(dim=-1).values.sum() is not None and not lineage.chosen  # a softmax's shift
        torch.nn.functional.one_hot(lin(x).max(dim=-1).indices, 4)
    assert lineage.chosen == {""}


def _config(model_type, **extra):
    from transformers import AutoConfig

    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return AutoConfig.for_model(model_type, vocab_size=128, max_position_embeddings=512, **(sizes | extra))


TRACED = {
    # a router named `router` inside a block named `block_sparse_moe`, stored as transformers holds it
    "granitemoe": (dict(num_local_experts=8, num_experts_per_tok=2), {"block_sparse_moe.router"}),
    # the router one level down, inside a module beside the experts
    "afmoe": (dict(num_experts=8, num_experts_per_tok=2), {"mlp.router.gate"}),
    # experts picked by max(dim) (sparsemixer), not topk
    "phimoe": (dict(num_local_experts=4, num_experts_per_tok=2), {"mlp.router"}),
    # DeepSeek's sparse attention: its indexer's projections choose the keys each query reads
    "deepseek_v32": (
        dict(
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
            topk_group=1, first_k_dense_replace=0, index_n_heads=2, index_head_dim=32, index_topk=2,
            num_hidden_layers=2,
        ),
        {"mlp.gate", "self_attn.indexer.wq_b", "self_attn.indexer.wk", "self_attn.indexer.weights_proj"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(TRACED))
def test_discovery_keeps_float_every_module_that_chooses(model_type):
    extra, chosen = TRACED[model_type]
    arch = discover(_config(model_type, **extra))
    layers = arch.skeleton.get_submodule(arch.layers)
    kept = {
        n
        for i, layer in enumerate(layers)
        for n, _ in layer.named_modules()
        if any(re.fullmatch(p[3:], f"{arch.layers}.{i}.{n}") for p in arch.keep_float if p.startswith("re:"))
    }
    assert kept == chosen


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_the_adapters_routers_are_what_tracing_finds(model_type, tiny_model):
    """Each MoE adapter names its routers (as the checkpoint stores them); tracing the family's own
    forward finds the same modules."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model(model_type)), dtype=torch.float32).eval()
    keep = ARCHS[model_type].keep_float
    named = set()
    for i, layer in enumerate(model.model.layers):
        for n, m in layer.named_modules():
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] == 1:
                continue  # a shared expert's one-row gate scales its output, it does not choose
            stored = stored_path(model, "model.layers", n)
            if any(re.fullmatch(p[3:], f"model.layers.{i}.{name}") for p in keep for name in (n, stored)):
                named.add(f"model.layers.{i}.{n}")
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad(), Lineage(model) as lineage:
        lineage.seed(x)
        model(inputs_embeds=x)
    assert named and lineage.chosen == named
