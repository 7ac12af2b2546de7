"""`fp8ptq analyze`: the float model's activation statistics, layer by layer, through the same chunked
sequential pass and the same `ActStats` code that calibration uses (nothing is quantized here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fp8ptq.calibrate.experts import expert_of
from fp8ptq.calibrate.state import CalibrationSetup, Progress, observe_layer, prepare
from fp8ptq.models.arch import Arch
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import materialize, release
from fp8ptq.outliers.stats import StatsSpec

ANALYSIS_SPEC = StatsSpec(rows=4096, moments=True, sample_top=8)


@dataclass(frozen=True)
class AnalysisReport:
    """`fp8ptq analyze` / api.analyze (report.json holds it, results.to_json). `layers`: per decoder layer,
    its Linear inputs' statistics (abs-max, percentiles, kurtosis, outlier channels and their stability),
    K/V ranges and massive activations; `worst`: the inputs whose max sits furthest above their p99."""

    SCHEMA: ClassVar[str] = "analysis"
    SCHEMA_VERSION: ClassVar[int] = 1

    model: str
    samples: int
    seq_len: int
    layers: list[dict]
    worst: list[dict]
    data: str = "calibration text"
    files: list[str] = field(default_factory=list)  # what the output directory holds


def input_kind(arch: Arch, name: str) -> str:
    """The label of a Linear input (fused shards read one input, reported once under the first shard):
    the fused module's name ('qkv_proj' -> 'qkv_in') or the Linear's own ('o_proj' -> 'o_in')."""
    leaf = name.rpartition(".")[2]
    fused = next((f for f, shards in arch.fused.items() if leaf in shards), leaf)
    return fused.removesuffix("_proj") + "_in"


def analyze_model(
    src: ModelSource,
    ids: torch.Tensor,
    setup: CalibrationSetup | None = None,
    comm=None,
    progress: Progress | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(report, channel_amax) where channel_amax[kind] is [layers, channels] of per-channel abs-max."""
    setup = setup or CalibrationSetup(None)
    model, state = prepare(src, ids, setup, comm)
    arch = state.arch
    layers = arch.decoder_layers(model)
    rows, cmax, order = [], {}, []
    try:
        for i, layer in enumerate(layers):
            prefix = arch.layer_prefix(i)
            materialize(layer, prefix, src, torch.float32, state.device)
            src.close()
            if not order:  # execution order of the inputs: the layer's module order
                order = [input_kind(arch, n) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
            stats = observe_layer(layer, i, state, ANALYSIS_SPEC, kv=arch.kv_cache, massive=True, write=True)
            entry = {"index": i, "inputs": {}, "kv": {}, "massive": stats.pop("massive", [])}
            layer_cmax: dict[str, torch.Tensor] = {}
            for name, st in stats.items():
                if name in ("k", "v"):
                    entry["kv"][name] = st.summary()
                    continue
                kind = input_kind(arch, name)
                expert = expert_of(name, arch)  # per expert in the tables; all experts as one heatmap row
                entry["inputs"][kind if expert is None else f"expert {expert[1]} {kind}"] = st.summary()
                c = st.channel_amax.float().cpu()
                layer_cmax[kind] = c if kind not in layer_cmax else torch.maximum(layer_cmax[kind], c)
            for kind, c in layer_cmax.items():
                cmax.setdefault(kind, []).append(c)
            rows.append(entry)
            release(layer)
            if progress:
                progress("analyze", i + 1, len(layers))
    finally:
        state.store.close()
    cmax = {k: cmax[k] for k in sorted(cmax, key=lambda k: order.index(k) if k in order else len(order))}
    report = {
        "model": src.label,
        "samples": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]),
        "layers": rows,
        "worst": worst_inputs(rows),
    }
    return report, {k: torch.stack(v) for k, v in cmax.items()}


def worst_inputs(layers: list[dict], top: int = 10) -> list[dict]:
    """Linear inputs ranked by how far their max sits above the 99th percentile (the range a per-tensor
    scale wastes on outliers)."""
    flat = [
        {
            "layer": l["index"],
            "input": kind,
            **{k: s.get(k) for k in ("amax", "max_over_p99", "kurtosis", "outlier_channels", "stability_mean")},
            "p99": s.get("percentiles", {}).get("p99"),
            "top_channels": [c["channel"] for c in s["top_channels"][:4]],
        }
        for l in layers
        for kind, s in l["inputs"].items()
    ]
    return sorted(flat, key=lambda r: -(r["max_over_p99"] or 0))[:top]
