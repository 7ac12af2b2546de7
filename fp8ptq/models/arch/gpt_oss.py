"""gpt-oss (transformers 5.23's GptOss* classes): a Llama-shaped layer with three differences.

Attention: q/k/v/o with biases and a learned per-head *sink* logit that joins each softmax row and is
dropped after it (`sinks`; never quantized: a parameter, not a Linear). transformers' SDPA cannot
compute it, so the model runs transformers' own eager gpt-oss attention (`Arch.eager_attention`; the
KV-observing wrapper calls it as the layer's `fp8ptq_inner_attention`, with eager additive masks).
Layers alternate sliding-window (even) and full attention (`layer_types`); Arch.layer_inputs captures
each layer's mask from the model's own forward.

MLP: `router` (Linear weight + bias, top-k then softmax over the k; never quantized) and experts that
the files store fused: `experts.gate_up_proj` [E, H, 2I] (gate and up columns interleaved: gate =
[..., ::2], up = [..., 1::2]) + `gate_up_proj_bias` [E, 2I], `experts.down_proj` [E, I, H] +
`down_proj_bias` [E, H]; the expert computes down((clamp(up, ±7) + 1) * g * sigmoid(1.702 g)) with
g = clamp(gate, max=7). The adapter replaces them by one `gate_up_proj` (rows interleaved, as vLLM's w13)
and one `down_proj` Linear per expert, with biases, and `source_views` reads each from its slice of the
fused tensor. The export then writes per-expert names `mlp.experts.{e}.gate_up_proj.*` /
`mlp.experts.{e}.down_proj.*`: vLLM 0.32's GptOssForCausalLM maps `.gate_up_proj.weight` ->
`.w13_weight` (hf_to_vllm_mapper) and loads `experts.{e}.w13_*` / `w2_*` one expert at a time
(`_GPT_OSS_STREAMED_EXPERT_SUFFIX_TO_SHARD`, models/gpt_oss.py); docs/DESIGN.md says what it does not read.
"""

from __future__ import annotations

import re

import torch
from transformers.models.gpt_oss import modeling_gpt_oss

from fp8ptq.models.arch import register
from fp8ptq.models.arch.base import TINY, Arch, Block, SmoothGroup
from fp8ptq.models.moe import Experts
from fp8ptq.models.views import SourceView

LEAVES = ("gate_up_proj", "down_proj")


class GptOssExpert(torch.nn.Module):
    """One gpt-oss expert as two biased Linears; the math of transformers' GptOssExperts for one expert."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * inter, bias=True)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=True)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


def _prepare(layer, config) -> None:
    layer.self_attn.fp8ptq_inner_attention = modeling_gpt_oss.eager_attention_forward  # the sink softmax
    moe = layer.mlp
    if isinstance(moe.experts, Experts):
        return
    args = (config.hidden_size, config.intermediate_size, config.swiglu_alpha, config.swiglu_limit)
    with torch.device("meta"):
        moe.experts = Experts([GptOssExpert(*args) for _ in range(config.num_local_experts)])


_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def _views(names: list[str], config) -> dict[str, SourceView]:
    """Per-expert Linear tensors as slices of the fused 3-D ones (a checkpoint without them: none)."""
    views = {}
    for name in names:
        m = _FUSED.fullmatch(name)
        if m is None:
            continue
        experts, leaf, bias = m.groups()
        for e in range(config.num_local_experts):
            key = f"{experts}.{e}.{leaf}.{'bias' if bias else 'weight'}"
            views[key] = SourceView(name, e, transpose=not bias)  # weights stored [in, out]
    return views


GPT_OSS = register(
    Arch(
        name="gpt_oss",
        model_types=("gpt_oss",),
        blocks=(
            Block("attention", "input_layernorm", "self_attn", final="self_attn.o_proj"),
            Block("mlp", "post_attention_layernorm", "mlp"),
        ),
        fused={"qkv_proj": ("q_proj", "k_proj", "v_proj")},  # vLLM's packed_modules_mapping
        # The MLP norm also feeds the router: folding smoothing scales there would change routing.
        smooth=(SmoothGroup("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),),
        expert_lists=("mlp.experts",),
        keep_float=("re:.*mlp\\.router$",),
        prepare_layer=_prepare,
        source_views=_views,
        eager_attention=True,
        tiny=dict(
            TINY,
            intermediate_size=64,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,  # shorter than the tests' sequences: the sliding masks matter (layer 0)
            tie_word_embeddings=False,
        ),
    )
)
