"""Qwen3-MoE (and Qwen2-style sparse layers): a Llama attention block and a sparse MLP block,
h + mlp(post_attention_layernorm(h)) where mlp = router `gate` (never quantized; in transformers 5 not
even a Linear) + `experts.{e}.{gate,up,down}_proj`. Layers listed in `mlp_only_layers` keep a dense
MLP. transformers' fused 3-D experts are replaced by per-expert Linears named as on disk
(models/moe.py); vLLM's Qwen3MoeForCausalLM reads exactly these names into FusedMoE's w13/w2."""

from transformers.activations import ACT2FN

from fp8ptq.models.arch import register
from fp8ptq.models.arch.base import TINY, Arch, Block, SmoothGroup
from fp8ptq.models.moe import GATE_UP_DOWN, replace_experts


def _prepare(layer, config) -> None:
    moe = layer.mlp
    if hasattr(moe, "experts"):
        act = ACT2FN[config.hidden_act]
        replace_experts(
            moe, config.num_experts, config.hidden_size, config.moe_intermediate_size, act, names=GATE_UP_DOWN
        )


QWEN3_MOE = register(
    Arch(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        blocks=(
            Block("attention", "input_layernorm", "self_attn", final="self_attn.o_proj"),
            Block("mlp", "post_attention_layernorm", "mlp", final="mlp.down_proj"),  # final: dense layers only
        ),
        fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
        # The MLP norm also feeds the router: folding smoothing scales there would change routing.
        smooth=(SmoothGroup("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),),
        expert_lists=("mlp.experts",),
        keep_float=("re:.*mlp\\.gate$", "re:.*shared_expert_gate$"),
        prepare_layer=_prepare,
        tiny=dict(
            TINY,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    )
)
