"""OUT/report.md and a self-contained OUT/report.html for a quantize run: what was done, what it costs,
how good it is, and how to serve it. Rendered from the manifest (and any saved evaluations), so
`fp8ptq report OUT` can re-render it at any time; plots are matplotlib PNGs (inlined in the HTML)."""

from __future__ import annotations

import base64
import io
import json
import os
from collections import defaultdict
from pathlib import Path

import jinja2

from fp8ptq.export.card import engine_commands, write_card
from fp8ptq.io import own_subdir, write_bytes_atomic, write_json_atomic
from fp8ptq.manifest import MANIFEST, Manifest

EVALS_DIR = "fp8ptq_evals"
PLOTS_DIR = "report_files"

# Linear name -> the row it gets in the per-layer plots (fused siblings share their input).
_INPUT_ROWS = {
    "q_proj": "attn in (q/k/v)",
    "o_proj": "o_proj in",
    "gate_proj": "mlp in (gate/up)",
    "down_proj": "down_proj in",
}


def serve_commands(path: str, manifest: Manifest) -> dict[str, str]:
    commands = engine_commands(path, bool(manifest.recipe["scheme"].get("kv_cache")))
    vllm, sglang = commands["vllm"], commands["sglang"]
    spec = manifest.speculative
    if spec is not None:  # written by `quantize --draft`; paths relative to the folder
        cfg = dict(spec.speculative_config)
        cfg["model"] = os.path.join(path, cfg["model"])
        vllm += f" --speculative-config '{json.dumps(cfg)}'"
    if spec is not None and spec.sglang_flags:
        flags = [f if not f.startswith("draft") else os.path.join(path, f) for f in spec.sglang_flags]
        sglang += " " + " ".join(flags)
    return {"vllm": vllm, "sglang": sglang, "vllm_python": commands["vllm_python"]}


def _per_layer(manifest: Manifest) -> tuple[dict[str, list], dict[str, list]]:
    """(input abs-max rows, output-error rows), each row a list over decoder layers."""
    amax: dict[str, list] = defaultdict(list)
    err: dict[str, list] = defaultdict(list)
    for layer in manifest.layers:
        seen = {}
        for name, r in layer["quantized"].items():
            short = name.rsplit(".", 1)[-1]
            seen[short] = r
        for short, row in _INPUT_ROWS.items():
            r = seen.get(short)
            amax[row].append(r.get("input_amax") if r else None)
        for short, r in seen.items():
            err[short].append(r.get("output_rel_err", r.get("weight_rel_err")))
        kv = layer.get("kv") or {}  # none in a hybrid stack's layers without attention: a gap in the row
        amax["keys (post-RoPE)"].append(kv.get("k_amax"))
        amax["values"].append(kv.get("v_amax"))
    return ({k: v for k, v in amax.items() if any(x is not None for x in v)}, dict(err))


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def plots(manifest: Manifest) -> dict[str, tuple[str, bytes]]:
    """name -> (caption, PNG bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    amax, err = _per_layer(manifest)
    out = {}
    if amax:
        rows = list(amax)
        grid = np.array([[np.nan if x is None else x for x in amax[r]] for r in rows], dtype=float)
        fig, ax = plt.subplots(figsize=(max(6, grid.shape[1] * 0.28), 0.45 * len(rows) + 1.4))
        im = ax.imshow(
            grid, aspect="auto", cmap="magma", norm=LogNorm(vmin=np.nanmin(grid[grid > 0]), vmax=np.nanmax(grid))
        )
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel("decoder layer")
        ax.set_title("calibration abs-max of each quantized input (log scale)")
        fig.colorbar(im, ax=ax, pad=0.01)
        out["input_amax"] = (
            "Activation ranges per layer: large values are outliers that stretch a per-tensor scale.",
            _png(fig),
        )
        plt.close(fig)
    if err:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for name, vals in err.items():
            ax.plot(range(len(vals)), vals, marker=".", label=name)
        ax.set_yscale("log")
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("relative error")
        ax.set_title("per-Linear quantization error (output error where calibrated, else weight error)")
        ax.legend(fontsize=7, ncol=4)
        out["linear_error"] = ("Where the quantization error sits, layer by layer.", _png(fig))
        plt.close(fig)
    return out


def load_evals(out_dir: Path) -> dict[str, dict]:
    """The evaluations recorded in out_dir/fp8ptq_evals: only the folder's own regular files (a symlink
    there, which fp8ptq never writes, would put another file's contents into the report)."""
    d = out_dir / EVALS_DIR
    if not d.is_dir() or d.is_symlink():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json")) if p.is_file() and not p.is_symlink()}


_ROUNDING = {"rtn": "RTN (round to nearest)", "gptq": "GPTQ (error-compensating, calibrated)"}


def _context(out_dir: Path, manifest: Manifest, serve_path: str) -> dict:
    sizes = manifest.size_bytes.model_dump()
    scheme = manifest.recipe["scheme"]

    def describe(args, activations=False):
        if not args:
            return "unquantized"
        kind = {"float": "FP", "int": "INT"}[args["type"]] + str(args["num_bits"])
        mode = (" dynamic" if args.get("dynamic") else " static") if activations else ""
        group = f" g{args['group_size']}" if args.get("group_size") else ""
        return f"{kind}{mode} per-{args['strategy']}{group}"

    return {
        "m": manifest,
        "speculative": None if manifest.speculative is None else manifest.speculative.model_dump(mode="json"),
        "scheme_rows": [
            ("weights", describe(scheme.get("weights"))),
            ("weight rounding", _ROUNDING.get(manifest.recipe.get("calibration", {}).get("weight_method"), "n/a")),
            ("input activations", describe(scheme.get("input_activations"), activations=True)),
            ("KV cache", describe(scheme.get("kv_cache"))),
            ("targets", ", ".join(scheme["targets"])),
            ("ignored", ", ".join(scheme["ignore"]) or "none"),
        ],
        "mib": {k: sizes[k] / 2**20 for k in ("source", "output")},
        "weight_bits": manifest.size_bytes.weight_bits,
        "ratio": manifest.size_bytes.ratio,
        "serve": serve_commands(serve_path, manifest),
        "evals": load_evals(out_dir),
        "name": Path(serve_path).name,  # the output's final name (it is written inside a hidden temp dir)
        "experts": expert_rows(manifest),
    }


def expert_rows(manifest: Manifest) -> list[dict]:
    """Per MoE block: how many calibration tokens the router sent each expert, and which experts were
    calibrated on every token instead (calibrate/experts.py)."""
    rows = []
    for layer in manifest.layers:
        for path, e in (layer.get("experts") or {}).items():
            tokens = sorted(e["tokens"])
            rows.append(
                {
                    "block": path,
                    "experts": len(tokens),
                    "min": tokens[0],
                    "median": tokens[len(tokens) // 2],
                    "max": tokens[-1],
                    "all_tokens": e.get("all_tokens", []),
                    "min_tokens": e["min_tokens"],
                }
            )
    return rows


def fmt_num(x, spec: str = ".1f") -> str:
    """A number, or 'n/a' for None (e.g. the standard error of a single question)."""
    return "n/a" if x is None else format(x, spec)


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("fp8ptq", "report_templates"),
        autoescape=jinja2.select_autoescape(["html", "html.j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = fmt_num
    return env


def write_report(out_dir: Path, manifest: Manifest | None = None, serve_path: str | None = None) -> list[Path]:
    """Write report.md, report.html, report_files/*.png and the model card README.md (export/card.py) into
    out_dir. Returns the paths written."""
    out_dir = Path(out_dir)
    manifest = manifest if manifest is not None else Manifest.load(out_dir)
    ctx = _context(out_dir, manifest, serve_path or str(out_dir))
    figs = plots(manifest)
    own_subdir(out_dir, PLOTS_DIR)
    written = []
    for name, (_, png) in figs.items():
        p = out_dir / PLOTS_DIR / f"{name}.png"
        write_bytes_atomic(p, png)
        written.append(p)
    env = _env()
    md = env.get_template("report.md.j2").render(
        **ctx, plots={n: (c, f"{PLOTS_DIR}/{n}.png") for n, (c, _) in figs.items()}
    )
    html = env.get_template("report.html.j2").render(
        **ctx, plots={n: (c, "data:image/png;base64," + base64.b64encode(png).decode()) for n, (c, png) in figs.items()}
    )
    for fname, text in (("report.md", md), ("report.html", html)):
        write_bytes_atomic(out_dir / fname, text.encode())
        written.append(out_dir / fname)
    written.append(write_card(out_dir, manifest, md))
    return written


def save_eval(out_dir: Path, name: str, result: dict) -> Path | None:
    """Record an evaluation beside an fp8ptq checkpoint and re-render its report. None if out_dir is not one."""
    out_dir = Path(out_dir)
    if not (out_dir / MANIFEST).is_file() or not os.access(out_dir, os.W_OK):
        return None
    write_json_atomic(own_subdir(out_dir, EVALS_DIR) / f"{name}.json", result, trailing_newline=True)
    write_report(out_dir)
    return out_dir / "report.html"
