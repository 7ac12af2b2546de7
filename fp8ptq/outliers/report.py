"""Render an outlier analysis: report.json, channel_amax.safetensors, PNG plots and summary.md."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

PLOTS = {
    "heatmap": "Per-channel input abs-max, layer x channel (log colour): bright vertical lines are outlier "
    "channels that persist across layers.",
    "outlier_ratio": "abs-max / 99th percentile of each Linear input, per layer: how much of a per-tensor "
    "scale's range is spent on outliers.",
    "kv_ranges": "Post-RoPE key and value abs-max and 99.9th percentile per layer (FP8 KV-cache scales).",
}


def _plots(report: dict, cmax: dict[str, torch.Tensor]) -> dict[str, bytes]:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    def png(fig) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        return buf.getvalue()

    out = {}
    kinds = list(cmax)
    fig, axes = plt.subplots(len(kinds), 1, figsize=(11, 2.6 * len(kinds)), squeeze=False, gridspec_kw={"hspace": 0.45})
    for ax, kind in zip(axes[:, 0], kinds):
        grid = cmax[kind].numpy()
        pos = grid[grid > 0]
        im = ax.imshow(
            grid,
            aspect="auto",
            cmap="magma",
            interpolation="nearest",
            norm=LogNorm(vmin=max(float(pos.min()), 1e-6), vmax=float(pos.max())) if pos.size else None,
        )
        ax.set_title(f"{kind}: per-channel abs-max", fontsize=9)
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, pad=0.01)
    axes[-1, 0].set_xlabel("channel")
    out["heatmap"] = png(fig)

    layers = report["layers"]
    x = np.arange(len(layers))
    width = 0.8 / max(1, len(kinds))
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for j, kind in enumerate(kinds):
        vals = [l["inputs"].get(kind, {}).get("max_over_p99", np.nan) for l in layers]
        ax.bar(x + j * width, vals, width, label=kind)
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("abs-max / p99")
    ax.legend(fontsize=8, ncol=len(kinds))
    out["outlier_ratio"] = png(fig)

    fig, ax = plt.subplots(figsize=(11, 3))
    for key, style in (("k", "-"), ("v", "--")):
        ax.plot(
            x, [l["kv"].get(key, {}).get("amax", np.nan) for l in layers], style, marker=".", label=f"{key} abs-max"
        )
        ax.plot(
            x,
            [l["kv"].get(key, {}).get("percentiles", {}).get("p99.9", np.nan) for l in layers],
            style,
            alpha=0.5,
            label=f"{key} p99.9",
        )
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.legend(fontsize=8, ncol=4)
    out["kv_ranges"] = png(fig)
    return out


def _markdown(report: dict) -> str:
    lines = [
        f"# Outlier analysis: {report['model']}",
        "",
        f"{report['samples']} samples x {report['seq_len']} tokens of {report.get('data', 'calibration text')}; "
        "float model (nothing quantized), statistics from fp8ptq's calibration code path.",
        "",
        "## Worst Linear inputs (abs-max far above the 99th percentile)",
        "",
        "| layer | input | abs-max | p99 | max/p99 | kurtosis | outlier channels | top channels | stability |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for w in report["worst"]:
        lines.append(
            f"| {w['layer']} | {w['input']} | {w['amax']:.3g} | {w['p99']:.3g} | {w['max_over_p99']:.1f} | "
            f"{w['kurtosis']:.0f} | {w['outlier_channels']} | {', '.join(map(str, w['top_channels']))} | "
            f"{w['stability_mean']:.2f} |"
        )
    lines += [
        "",
        "Stability: the fraction of samples whose own top-8 channels include the layer's top-8 "
        "(1.0: the same channels are outliers for every input, so a fixed per-channel treatment - "
        "smoothing, flattening - works).",
        "",
        "## Massive activations (residual stream)",
        "",
    ]
    massive = [(l["index"], m) for l in report["layers"] for m in l["massive"][:2]]
    if massive:
        lines += [
            "| after layer | sample | position | channel | abs value | x median |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {i} | {m['sample']} | {m['position']} | {m['channel']} | {m['abs']:.1f} | {m['x_median']:.0f} |"
            for i, m in massive[:20]
        ]
    else:
        lines.append("None found (no value above 100 and 1000x the median).")
    lines += ["", "## Plots", ""] + [f"![{n}]({n}.png)\n\n{c}\n" for n, c in PLOTS.items()]
    return "\n".join(lines) + "\n"


def write_analysis(out: Path, report: dict, cmax: dict[str, torch.Tensor]) -> list[Path]:
    """report.json (the report, its `files` set to what is written here), the per-channel abs-max, the
    plots and summary.md into `out`; the paths written."""
    out = Path(out)
    plots = _plots(report, cmax)
    written = [out / "report.json", out / "channel_amax.safetensors"]
    written += [out / f"{name}.png" for name in plots] + [out / "summary.md"]
    (out / "report.json").write_text(json.dumps({**report, "files": [p.name for p in written]}, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in cmax.items()}, str(out / "channel_amax.safetensors"))
    for name, data in plots.items():
        (out / f"{name}.png").write_bytes(data)
    (out / "summary.md").write_text(_markdown(report))
    return written
