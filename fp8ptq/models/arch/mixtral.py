"""Mixtral: a Llama attention block and a sparse MLP block stored on disk as `block_sparse_moe`
(router `gate`, experts `experts.{e}.w1/w3/w2` = gate/up/down). transformers 5 renames the block to
`mlp` in memory; the adapter registers it under its checkpoint name (and keeps `mlp` as a plain
attribute for the decoder layer's own forward) and replaces the fused 3-D experts by per-expert Linears
(models/moe.py). vLLM's MixtralForCausalLM maps `experts.{e}.w1/w3` -> w13 and `w2` -> w2."""

from transformers.activations import ACT2FN

from fp8ptq.models.arch import register
from fp8ptq.models.arch.base import Arch, Block, SmoothGroup
from fp8ptq.models.moe import W1_W3_W2, replace_experts


def _prepare(layer, config) -> None:
    moe = layer._modules.pop("mlp", None)
    if moe is None:
        return
    layer.block_sparse_moe = moe
    layer.__dict__["mlp"] = moe  # the decoder layer's forward calls self.mlp; not a second child
    replace_experts(
        moe,
        config.num_local_experts,
        config.hidden_size,
        config.intermediate_size,
        ACT2FN[config.hidden_act],
        names=W1_W3_W2,
    )


MIXTRAL = register(
    Arch(
        name="mixtral",
        model_types=("mixtral",),
        blocks=(
            Block("attention", "input_layernorm", "self_attn", final="self_attn.o_proj"),
            Block("mlp", "post_attention_layernorm", "block_sparse_moe"),
        ),
        fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "w13": ("w1", "w3")},
        smooth=(SmoothGroup("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),),
        expert_lists=("block_sparse_moe.experts",),
        keep_float=("re:.*block_sparse_moe\\.gate$",),
        prepare_layer=_prepare,
        tiny=dict(
            hidden_size=64,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
    )
)
