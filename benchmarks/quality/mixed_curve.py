"""KL vs 4-bit FLOP share of the automatic 4/8-bit mix (recipe mixed-w4-w8), per sensitivity measure.

    .venv/bin/python benchmarks/quality/mixed_curve.py [--fractions 0 0.25 0.5 0.75 1] [--sensitivity output kl]
        [--num-samples 32 --seq-len 512 --eval-samples 32] [--png docs/mixed-kl-vs-int4-share.png]

Every point is a full `fp8ptq quantize` (same calibration tokens) scored by the same evaluator (engine
numerics) on held-out text; a "random" baseline picks groups in a fixed pseudo-random order instead
of by sensitivity, so the curve shows what the sensitivity measure buys. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import yaml


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--sensitivity", nargs="+", default=["output", "kl", "random"])
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--png", type=Path, default=Path("docs/mixed-kl-vs-int4-share.png"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import fp8ptq.calibrate.mixed as mixed
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.data import load_samples
    from fp8ptq.eval.quality import compare, load_simulated
    from fp8ptq.models.loader import open_hf_dir, resolve_model
    from fp8ptq.recipe import load_recipe

    src = resolve_model("smollm2-135m")
    eval_ids = load_samples("builtin", src.tokenizer(), args.eval_samples, args.seq_len, "evaluation", 0)
    ref = load_simulated(src).model
    base = load_recipe("mixed-w4-w8").model_dump(mode="json")
    base["gates"] = []
    rows = []
    real_choose = mixed.choose_low
    with tempfile.TemporaryDirectory() as tmp:
        endpoints = {}
        for sens in args.sensitivity:
            for frac in args.fractions:
                if frac in (0.0, 1.0) and frac in endpoints:  # all-8 / all-4 bit: no choice to make
                    rows.append({**endpoints[frac], "sensitivity": sens})
                    continue
                r = json.loads(json.dumps(base))
                r["mixed"]["sensitivity"] = "output" if sens == "random" else sens
                r["mixed"]["int4_fraction"] = frac
                f = Path(tmp) / f"{sens}-{frac}.yaml"
                f.write_text(yaml.safe_dump(r))
                if sens == "random":  # same budget rule, groups in a fixed shuffled order
                    import random

                    def shuffled(groups, fraction):
                        rnd = random.Random(0)
                        for g in groups:
                            g["sensitivity"] = rnd.random() * g["flops"]
                        return real_choose(groups, fraction)

                    mixed.choose_low = shuffled
                t = time.perf_counter()
                m = quantize(
                    QuantizeConfig(
                        model="smollm2-135m",
                        recipe=str(f),
                        output=Path(tmp) / f.stem,
                        num_samples=args.num_samples,
                        seq_len=args.seq_len,
                        eval_samples=0,
                    )
                )
                secs = time.perf_counter() - t
                mixed.choose_low = real_choose
                q = compare(ref, load_simulated(open_hf_dir(Path(tmp) / f.stem)).model, eval_ids)
                rows.append(
                    dict(
                        sensitivity=sens,
                        target=frac,
                        share=m.mixed["int4_flop_share"],
                        secs=secs,
                        size=m.size_bytes.ratio,
                        **q,
                    )
                )
                if frac in (0.0, 1.0):
                    endpoints[frac] = rows[-1]
                print(json.dumps(rows[-1]), flush=True)
    print(f"\ncalibration {args.num_samples}x{args.seq_len}, eval {args.eval_samples}x{args.seq_len} held-out\n")
    print("| sensitivity | int4 FLOP share (target) | KL / token | top-1 | PPL | size ratio | quantize s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['sensitivity']} | {r['share']:.3f} ({r['target']:.2f}) | {r['kl']:.5f} | {r['top1'] * 100:.2f}% | "
            f"{r['ppl']:.3f} | {r['size']:.3f} | {r['secs']:.0f} |"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for sens in args.sensitivity:
        pts = sorted((r["share"], r["kl"]) for r in rows if r["sensitivity"] == sens)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"groups chosen by: {sens}")
    ax.set_xlabel("4-bit share of linear FLOPs (W4A16 g64; rest INT8 W8A8)")
    ax.set_ylabel("KL(ref || quantized) / token")
    ax.set_title("SmolLM2-135M: automatic 4/8-bit mix")
    ax.legend()
    ax.grid(alpha=0.3)
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110, bbox_inches="tight")
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
