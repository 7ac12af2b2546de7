"""The KV-cache stage of a layer's calibration (calibrate/pipeline.py): static FP8 scales for the post-RoPE keys
and values, per layer or per KV head, then the engine's KV quantizer installed for the passes after it."""

from __future__ import annotations

import torch

from fp8ptq.calibrate.observers import OBSERVER_STATS, OBSERVERS
from fp8ptq.calibrate.state import Stop, finite_stats
from fp8ptq.models.arch import Block
from fp8ptq.outliers.stats import ActStats
from fp8ptq.quantization.numerics import install_kv_quant
from fp8ptq.quantization.schemes import handler


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

    attn.fp8ptq_kv_hook = observe
    try:
        cal._pass(block)
    finally:
        attn.__dict__.pop("fp8ptq_kv_hook", None)
    kv = cal.recipe.scheme.kv_cache
    grid = handler(kv).act_grid(kv)
    # default minmax: clipping hurts FP8's flat relative error (BENCHMARKS.md, FP8 KV observers)
    reduced = {key: stats[key].reduce(cal.state.comm) for key in ("k", "v")}
    kc, vc = (OBSERVERS[kv_observer](reduced[key], grid) for key in ("k", "v"))
    prefix = cal.plan.prefix + cal.attn_name
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
