"""The Llama family (llama, mistral, qwen2, qwen3): two residual blocks per layer,
h + self_attn(input_layernorm(h)) and h + mlp(post_attention_layernorm(h)), a gated MLP, and q/k/v
and gate/up fused by vLLM (its LlamaForCausalLM.packed_modules_mapping). Qwen3's q/k norms sit inside
the attention and change nothing here; Qwen2's q/k/v biases are carried as float tensors."""

from fp8ptq.models.arch import register
from fp8ptq.models.arch.base import TINY, Arch, Block, FlattenTarget, SmoothGroup

LLAMA = register(
    Arch(
        name="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        blocks=(
            Block("attention", "input_layernorm", "self_attn", final="self_attn.o_proj"),
            Block("mlp", "post_attention_layernorm", "mlp", final="mlp.down_proj"),
        ),
        fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
        smooth=(
            SmoothGroup("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            SmoothGroup("gate_up", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        flatten=FlattenTarget("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        head_pair=("self_attn.v_proj", "self_attn.o_proj"),
        tiny=dict(
            TINY,
            tie_word_embeddings=True,
        ),
    )
)
