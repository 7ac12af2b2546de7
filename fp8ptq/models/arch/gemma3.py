"""Gemma 3 (text): four norms per layer, h + post_attention_layernorm(self_attn(input_layernorm(h))) and
h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))); RMSNorm computes x * (1 + w), so
SmoothQuant folds its scales into (1 + w) (norm_offset 1); q/k norms inside the attention; sliding-window
and global layers with their own RoPE (captured by Arch.layer_inputs); embeddings scaled by
sqrt(hidden_size) (Gemma3TextScaledWordEmbedding). vLLM: Gemma3ForCausalLM, q/k/v and gate/up fused."""

from fp8ptq.models.arch import register
from fp8ptq.models.arch.base import TINY, Arch, Block, FlattenTarget, SmoothGroup

GEMMA3 = register(
    Arch(
        name="gemma3",
        model_types=("gemma3_text",),
        blocks=(
            Block(
                "attention",
                "input_layernorm",
                "self_attn",
                final="self_attn.o_proj",
                post_norm="post_attention_layernorm",
            ),
            Block(
                "mlp", "pre_feedforward_layernorm", "mlp", final="mlp.down_proj", post_norm="post_feedforward_layernorm"
            ),
        ),
        fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
        smooth=(
            SmoothGroup("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            SmoothGroup("gate_up", "pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        flatten=FlattenTarget("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        norm_offset=1.0,
        embed_scale=lambda config: config.hidden_size**0.5,
        tiny=dict(
            TINY,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,  # shorter than the tests' sequences: the sliding masks matter
            sliding_window_pattern=2,  # layer 0 sliding, layer 1 global
            tie_word_embeddings=True,
        ),
    )
)
