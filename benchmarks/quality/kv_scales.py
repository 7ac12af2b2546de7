"""FP8 KV-cache scales: calibrated per tensor (fp8-kv8's min-max), calibrated per KV head, or the
constant 1.0 that vLLM uses for a checkpoint without KV scales (and ModelOpt writes by default), against
the same export with an unquantized KV cache. Weights and activations are fp8-kv8's with RTN weights, so
the KV cache is the only difference; every export is scored by the same evaluator in-domain (the built-in
evaluation split) and off-domain (Debian's licence texts, never used for calibration).

    .venv/bin/python benchmarks/quality/kv_scales.py [--models smollm2-135m,gemma3-270m]
        [--num-samples 32 --seq-len 512 --eval-samples 16] [--out benchmarks/results/kv_scales.json]

Prints a markdown table for BENCHMARKS.md and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
LICENCES = Path("/usr/share/common-licenses")
# variant -> edits of fp8-kv8's recipe (weights and activations kept)
VARIANTS = {
    "no KV quantization": {"kv_cache": None},
    "calibrated per tensor (fp8-kv8)": {},
    "calibrated per KV head": {"kv_strategy": "attn_head"},
    "constant 1.0": {"kv_observer": "constant"},
}


def off_domain_text(work: Path) -> Path:
    """Every licence text once (symlinks skipped), blank-line separated."""
    out = work / "licences.txt"
    parts = [f.read_text(errors="replace") for f in sorted(LICENCES.iterdir()) if f.is_file() and not f.is_symlink()]
    out.write_text("\n\n".join(parts))
    return out


def recipe_file(work: Path, name: str, edits: dict) -> Path:
    from fp8ptq.recipe import load_recipe

    r = load_recipe("fp8-kv8").model_dump(mode="json")
    r["name"], r["gates"] = f"kv-{len(list(work.glob('*.yaml')))}", []
    r["calibration"]["weight_method"] = "rtn"
    if "kv_cache" in edits:
        r["scheme"]["kv_cache"] = None
    if "kv_strategy" in edits:
        r["scheme"]["kv_cache"]["strategy"] = edits["kv_strategy"]
    if "kv_observer" in edits:
        r["calibration"]["kv_observer"] = edits["kv_observer"]
    path = work / f"{r['name']}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_scales.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fp8ptq.api import EvalConfig, QuantizeConfig, evaluate_quality, quantize

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        off = off_domain_text(work)
        for model in args.models.split(","):
            for variant, edits in VARIANTS.items():
                out = work / f"{model}-{len(rows)}"
                cfg = QuantizeConfig(
                    model=model,
                    recipe=str(recipe_file(work, variant, edits)),
                    output=out,
                    num_samples=args.num_samples,
                    seq_len=args.seq_len,
                    eval_samples=0,
                )
                manifest = quantize(cfg)
                q = evaluate_quality(
                    EvalConfig(
                        model=str(out),
                        reference=model,
                        num_samples=args.eval_samples,
                        seq_len=args.seq_len,
                        eval_data=str(off),
                    )
                )
                k_amax = [layer["kv"]["k_amax"] for layer in manifest.layers if "kv" in layer]
                v_amax = [layer["kv"]["v_amax"] for layer in manifest.layers if "kv" in layer]
                row = {"model": model, "variant": variant, "in": q.kl, "in_top1": q.top1}
                row |= {"off": q.off_domain.kl, "off_top1": q.off_domain.top1, "tokens": q.tokens}
                row |= {"k_amax_max": max(k_amax, default=None), "v_amax_max": max(v_amax, default=None)}
                row |= {"k_amax_min": min(k_amax, default=None), "v_amax_min": min(v_amax, default=None)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    meta = {
        "command": "benchmarks/quality/kv_scales.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    }
    meta |= {"commit": commit.stdout.strip(), "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print("| model | KV scales | KL in-domain | top-1 in | KL off-domain | top-1 off |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['variant']} | {r['in']:.5f} | {r['in_top1'] * 100:.2f}% | {r['off']:.5f} "
            f"| {r['off_top1'] * 100:.2f}% |"
        )


if __name__ == "__main__":
    main()
