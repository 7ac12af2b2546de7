"""Engine numerics as module hooks: what vLLM computes for a quantized checkpoint.

- Linear input: static FP8/INT8 with the stored input_scale, or dynamic per token (quantize/schemes.py).
- Linear weight: the stored, dequantized FP8 weight (set by the caller).
- KV cache: keys (after RoPE) and values quantized with k_scale / v_scale, installed through a custom
  transformers attention function ("fp8ptq_sdpa") that wraps SDPA. Every key/value the attention
  reads is quantized, i.e. the decode-time view where all past tokens come from the FP8 cache.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8ptq.quantize.schemes import FP8_GRID

ATTN_IMPL = "fp8ptq_sdpa"


def register_attention() -> str:
    """Register the KV-observing attention with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8ptq_sdpa(module, query, key, value, attention_mask, **kwargs):
        hook: Callable | None = getattr(module, "fp8ptq_kv_hook", None)
        if hook is not None:
            key, value = hook(module, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    if ATTN_IMPL not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_IMPL, fp8ptq_sdpa)
    # The mask builder is looked up by the same name: without it transformers builds no mask and SDPA
    # falls back to a plain causal mask, wrong for padded batches and for several new tokens after a KV
    # cache (lm-eval's batched generation, speculative verification).
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if ATTN_IMPL not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
    return ATTN_IMPL


def install_input_quant(module: torch.nn.Module, quant: Callable[[torch.Tensor], torch.Tensor]):
    """Quantize the first positional input of `module` on every call; returns the hook handle."""
    return module.register_forward_pre_hook(lambda _m, args: (quant(args[0]), *args[1:]))


def install_kv_quant(attn: torch.nn.Module, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """FP8 keys/values with per-layer scales (the only KV scheme exported)."""
    kq = lambda x: FP8_GRID.fake_quant(x, k_scale.float().reshape(1).to(x.device))  # noqa: E731
    vq = lambda x: FP8_GRID.fake_quant(x, v_scale.float().reshape(1).to(x.device))  # noqa: E731
    attn.fp8ptq_kv_hook = lambda _m, k, v: (kq(k), vq(v))
