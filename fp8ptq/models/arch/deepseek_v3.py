"""DeepSeek-V3 / R1 (and V2-style MLA models registered as deepseek_v3): multi-head latent attention and
a sparse MLP with shared experts.

Attention (MLA): `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (or one `q_proj` without a q LoRA rank),
`kv_a_proj_with_mqa` (the compressed KV latent plus the shared RoPE key) -> `kv_a_layernorm` ->
`kv_b_proj`, then `o_proj`. vLLM 0.32 (deepseek_v2.py) fuses `q_a_proj` + `kv_a_proj_with_mqa` into
`fused_qkv_a_proj` (they read the same input: one per-tensor scale) and dequantizes `kv_b_proj` to
absorb it into the MLA kernels. Its KV cache holds the normed latent and the RoPE key, not per-head
keys/values: KV recipes round that entry with the one scale vLLM applies (calibrate/kv.py).

MLP: the first `first_k_dense_replace` layers are dense; the others are `gate` (router with a
score-correction bias; never quantized) + routed `experts.{e}.{gate,up,down}_proj` (models/moe.py) +
`shared_experts.{gate,up,down}_proj` (plain Linears, quantized as any MLP)."""

from transformers.activations import ACT2FN

from fp8ptq.models.arch import register
from fp8ptq.models.arch.base import TINY, Arch, Block, SmoothGroup
from fp8ptq.models.moe import GATE_UP_DOWN, replace_experts


def _prepare(layer, config) -> None:
    moe = layer.mlp
    if hasattr(moe, "experts"):
        act = ACT2FN[config.hidden_act]
        replace_experts(
            moe, config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, act, names=GATE_UP_DOWN
        )


DEEPSEEK_V3 = register(
    Arch(
        name="deepseek_v3",
        model_types=("deepseek_v3",),
        blocks=(
            Block("attention", "input_layernorm", "self_attn", final="self_attn.o_proj"),
            Block("mlp", "post_attention_layernorm", "mlp", final="mlp.down_proj"),  # final: dense layers only
        ),
        fused={"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "gate_up_proj": ("gate_proj", "up_proj")},
        smooth=(SmoothGroup("qkv", "input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),),
        expert_lists=("mlp.experts",),
        keep_float=("re:.*mlp\\.gate$",),
        kv_cache=False,
        latent_kv=True,
        prepare_layer=_prepare,
        tiny=dict(
            TINY,
            moe_intermediate_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            topk_method="noaux_tc",  # as DeepSeek-V3's config.json: vLLM then builds the router's correction bias
            scoring_func="sigmoid",
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=32,
            tie_word_embeddings=False,
        ),
    )
)
