"""Phi-3: a Llama-shaped layer whose q/k/v and gate/up are fused ON DISK (`self_attn.qkv_proj`,
`mlp.gate_up_proj`: one weight each, gate rows first). fp8ptq quantizes each as one Linear with one set
of scales; vLLM 0.32 loads such a fused-on-disk weight into its QKV/MergedColumn layer and fills every
shard's per-tensor scale with the one stored scale (linear.py, "weights already fused on disk (e.g.
Phi-3's)"), so per-tensor, per-channel and group scales all load as written. FlattenQuant is not
offered: widening the intermediate would split rows inside the fused gate_up weight."""

from fp8ptq.models.arch import register
from fp8ptq.models.arch.base import TINY, Arch, Block, SmoothGroup

PHI3 = register(
    Arch(
        name="phi3",
        model_types=("phi3",),
        blocks=(
            Block("attention", "input_layernorm", "self_attn", final="self_attn.o_proj"),
            Block("mlp", "post_attention_layernorm", "mlp", final="mlp.down_proj"),
        ),
        fused={},  # already one Linear each on disk
        smooth=(
            SmoothGroup("qkv", "input_layernorm", ("self_attn.qkv_proj",)),
            SmoothGroup("gate_up", "post_attention_layernorm", ("mlp.gate_up_proj",)),
        ),
        tiny=dict(
            TINY,
            original_max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
    )
)
