"""Engine numerics as module hooks: what vLLM computes for a quantized checkpoint.

- Linear input: static FP8 with the stored input_scale, or dynamic per-token FP8.
- Linear weight: the stored, dequantized FP8 weight (set by the caller).
- KV cache: keys (after RoPE) and values quantized with k_scale / v_scale, installed through a custom
  transformers attention function ("fp8ptq_sdpa") that wraps SDPA. Every key/value the attention
  reads is quantized, i.e. the decode-time view where all past tokens come from the FP8 cache.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8ptq.ops.fp8 import fake_quant_fp8, fake_quant_fp8_dynamic
from fp8ptq.ops.granularity import TENSOR, TOKEN

ATTN_IMPL = "fp8ptq_sdpa"
_CHUNK_ROWS = 8192  # bounds the fp32 temporaries of fake-quant on large calibration batches


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
    return ATTN_IMPL


def chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a row-wise fn to x [..., d] in row chunks (same result, smaller temporaries)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= _CHUNK_ROWS:
        return fn(x)
    out = torch.empty_like(rows)
    for i in range(0, rows.shape[0], _CHUNK_ROWS):
        out[i : i + _CHUNK_ROWS] = fn(rows[i : i + _CHUNK_ROWS])
    return out.reshape(x.shape)


def quantize_input_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return chunked(lambda r: fake_quant_fp8(r, scale, TENSOR), x)


def quantize_input_dynamic(x: torch.Tensor) -> torch.Tensor:
    return chunked(lambda r: fake_quant_fp8_dynamic(r, TOKEN), x)


def input_quantizer(dynamic: bool, scale: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if dynamic:
        return quantize_input_dynamic
    assert scale is not None
    return lambda x: quantize_input_static(x, scale)


def install_input_quant(module: torch.nn.Module, quant: Callable[[torch.Tensor], torch.Tensor]):
    """Quantize the first positional input of `module` on every call; returns the hook handle."""
    return module.register_forward_pre_hook(lambda _m, args: (quant(args[0]), *args[1:]))


def install_kv_quant(attn: torch.nn.Module, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    attn.fp8ptq_kv_hook = lambda _m, k, v: (quantize_input_static(k, k_scale), quantize_input_static(v, v_scale))
