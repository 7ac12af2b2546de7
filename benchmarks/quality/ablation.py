"""fp8-kv8 ablation: observer (minmax | mse) x weight method (rtn | gptq | gptq-act: GPTQ with static
act-order), same data and evaluator.

    .venv/bin/python benchmarks/quality/ablation.py [--num-samples 16 --seq-len 512 --eval-samples 32] \
        [--observers minmax,mse] [--methods rtn,gptq,gptq-act]

Prints a markdown table for BENCHMARKS.md. Variants are built from the built-in fp8-kv8 recipe by
changing only `calibration.observer`, `calibration.weight_method` and `calibration.gptq_act_order`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import yaml


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--observers", default="minmax,mse")
    ap.add_argument("--methods", default="rtn,gptq", help="of rtn, gptq, gptq-act (GPTQ with act-order)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.data import load_samples
    from fp8ptq.eval.quality import compare, load_simulated
    from fp8ptq.models.loader import open_hf_dir, resolve_model
    from fp8ptq.recipe import load_recipe

    src = resolve_model("smollm2-135m")
    eval_ids = load_samples("builtin", src.tokenizer(), args.eval_samples, args.seq_len, "evaluation", seed=0)
    ref = load_simulated(src).model
    base = load_recipe("fp8-kv8").model_dump(mode="json")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for observer in args.observers.split(","):
            for method in args.methods.split(","):
                cal = {"observer": observer, "weight_method": method.removesuffix("-act")}
                cal["gptq_act_order"] = method.endswith("-act")
                r = {**base, "name": f"fp8-kv8-{observer}-{method}", "calibration": {**base["calibration"], **cal}}
                f = Path(tmp) / f"{r['name']}.yaml"
                f.write_text(yaml.safe_dump(r))
                t = time.perf_counter()
                quantize(
                    QuantizeConfig(
                        model="smollm2-135m",
                        recipe=str(f),
                        output=Path(tmp) / r["name"],
                        num_samples=args.num_samples,
                        seq_len=args.seq_len,
                        eval_samples=0,
                    )
                )
                secs = time.perf_counter() - t
                q = compare(ref, load_simulated(open_hf_dir(Path(tmp) / r["name"])).model, eval_ids)
                rows.append((observer, method, secs, q))
    print(f"\ncalibration {args.num_samples}x{args.seq_len}, eval {args.eval_samples}x{args.seq_len} held-out\n")
    print("| observer | weights | quantize s | KL / token | top-1 | PPL |")
    print("|---|---|---:|---:|---:|---:|")
    for observer, method, secs, q in rows:
        print(f"| {observer} | {method} | {secs:.1f} | {q['kl']:.5f} | {q['top1'] * 100:.2f}% | {q['ppl']:.3f} |")


if __name__ == "__main__":
    main()
