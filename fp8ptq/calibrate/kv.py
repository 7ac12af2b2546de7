"""The KV-cache stage of a layer's calibration (calibrate/pipeline.py): static FP8 scales for the post-RoPE keys
and values, per layer or per KV head, then the engine's KV quantizer installed for the passes after it.

MLA layers cache one entry per token, the normed latent and the RoPE key (quantization/numerics.py,
`is_latent`). vLLM 0.32 quantizes it with the layer's `_k_scale`, which a compressed-tensors checkpoint
cannot set: its config gives KV-cache methods to `Attention` layers only, not `MLAAttention`
(compressed_tensors.py get_quant_method), so the scale keeps its default 1.0 on every MLA backend. The
stage therefore measures the entry's abs-max (a report; values past FP8's range saturate in the engine)
and installs the quantizer with the scale the engine uses, 1.0, written so as the export's k/v scales."""

from __future__ import annotations

import logging

import torch

from fp8ptq.calibrate.observers import OBSERVER_STATS, OBSERVERS
from fp8ptq.calibrate.state import Stop, finite_stats
from fp8ptq.models.arch import Block
from fp8ptq.outliers.stats import ActStats
from fp8ptq.quantization.numerics import clear_kv_hook, install_kv_quant, is_latent, set_kv_hook
from fp8ptq.quantization.schemes import handler

log = logging.getLogger(__name__)


def quantize_kv(cal, block: Block) -> None:
    """Post-RoPE keys and values: static per-layer scales, then the KV quantizer is installed."""
    attn = cal.modules[cal.attn_name]
    stats: dict[str, ActStats] = {}
    kv_heads = 0  # KV heads, as the hook sees them
    kv_observer = cal.recipe.calibration.kv_observer
    spec = OBSERVER_STATS[kv_observer]

    def observe(_m, k, v):
        nonlocal kv_heads
        c, first = cal.chunk
        kv_heads = k.shape[1]
        for key, t in (("k", k), ("v", v)):  # [n, kv_heads, seq, head] -> [n, seq, kv_heads*head]
            t = t.transpose(1, 2).flatten(2)
            stats.setdefault(key, cal.state.new_stats(t.shape[-1], spec)).update(c, first, t)
        raise Stop

    set_kv_hook(attn, observe)
    try:
        cal._pass(block)
    finally:
        clear_kv_hook(attn)
    kv = cal.recipe.scheme.kv_cache
    grid = handler(kv).act_grid(kv)
    prefix = cal.plan.prefix + cal.attn_name
    if is_latent(attn):
        _latent_scales(cal, prefix, {key: s.reduce(cal.state.comm) for key, s in stats.items()}, grid)
        install_kv_quant(attn, kv, cal.result.kv_scales[f"{prefix}.k_scale"], torch.ones(1))
        return
    # default minmax: clipping hurts FP8's flat relative error (BENCHMARKS.md, FP8 KV observers)
    reduced = {key: stats[key].reduce(cal.state.comm) for key in ("k", "v")}
    kc, vc = (OBSERVERS[kv_observer](reduced[key], grid) for key in ("k", "v"))
    finite_stats(f"{prefix} (keys)", kc.amax)
    finite_stats(f"{prefix} (values)", vc.amax)
    k_scale, v_scale = kc.scale, vc.scale
    cal.result.report["kv"] = {"k_amax": kc.amax, "v_amax": vc.amax}
    if kv.strategy == "attn_head":  # one min-max scale per KV head (the recipe refuses other observers)
        heads = {key: reduced[key].channel_amax.reshape(kv_heads, -1).amax(dim=1) for key in ("k", "v")}
        k_scale, v_scale = (torch.stack([grid.scale(float(a))[0] for a in heads[key]]) for key in ("k", "v"))
        cal.result.report["kv"] |= {f"{key}_amax_heads": heads[key].tolist() for key in ("k", "v")}
    cal.result.kv_scales[f"{prefix}.k_scale"] = k_scale
    cal.result.kv_scales[f"{prefix}.v_scale"] = v_scale
    install_kv_quant(attn, kv, k_scale, v_scale)


def _latent_scales(cal, prefix: str, reduced: dict[str, ActStats], grid) -> None:
    """MLA: the cache entry's abs-max (latent "k", RoPE key "v" as the hook passes them) and the scale the
    engine applies, 1.0 (module doc)."""
    amax = {key: float(reduced[key].channel_amax.max()) for key in ("k", "v")}
    finite_stats(f"{prefix} (latent cache)", max(amax.values()))
    cal.result.kv_scales[f"{prefix}.k_scale"] = torch.ones(1)
    cal.result.kv_scales[f"{prefix}.v_scale"] = torch.ones(1)  # nothing in the engine reads it
    if max(amax.values()) > grid.qmax:
        log.warning(
            "%s: the MLA cache entry reaches %.4g, past FP8's %g: vLLM 0.32 caches it with scale 1.0 and clips it",
            prefix,
            max(amax.values()),
            grid.qmax,
        )
    cal.result.report["kv"] = {
        "k_amax": max(amax.values()),
        "latent_amax": amax["k"],
        "rope_key_amax": amax["v"],
        "saturates": max(amax.values()) > grid.qmax,  # the engine clips what the 1.0 scale cannot hold
    }
