"""fp8ptq vs llm-compressor on the same model, calibration tokens and evaluator.

    .venv/bin/python benchmarks/quality/compare_llmc.py --schemes fp8-kv8 fp8-dynamic w4a16=w4a16-g64-gptq \
        w8a8-int8 [--num-samples 64 --seq-len 512 --eval-samples 32] [--work /tmp/fp8ptq-bench] [--reuse]
        [--fp8ptq-args '--offload-activations --chunk-tokens 1024'] [--eval-data licences.txt]

A scheme is `RECIPE` (same name on both sides) or `RECIPE=LLMC_SCHEME` (fp8ptq recipe or YAML file =
llm-compressor scheme of benchmarks/llmc_quantize.py); `--only fp8ptq|llmc` runs one side, `--reuse`
scores an existing output instead of re-running that tool (for long llm-compressor runs).

Needs the llm-compressor venv (bash benchmarks/setup_llmc_venv.sh). Each tool runs in its own
subprocess, one after the other; wall time is the tool's own calibration+quantization time, peak RSS
is the subprocess's max resident set (ru_maxrss of the child). Quality: fp8ptq's evaluator (engine
numerics: FP8 weights, static/dynamic FP8 inputs, FP8 KV) on the held-out built-in split vs the
unquantized model, identical for both checkpoints, windows opened as the tokenizer opens a prompt (Gemma's
BOS); `--model` picks the model (default the demo, e.g. `--model gemma3-270m`); `--eval-data PATH` (any local text, as `eval quality
--eval-data`) scores the same number of tokens of that source too, off the calibration domain. Prints a
markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: probe.py, llmc_quantize.py, .venv-llmc
sys.path.insert(0, str(BENCH))
from probe import child  # noqa: E402

# LLMC_PYTHON overrides (e.g. a git worktree using the main checkout's venv)
LLMC_PY = Path(os.environ.get("LLMC_PYTHON", BENCH / ".venv-llmc" / "bin" / "python"))


def child_run(cmd: list[str], env=None) -> tuple[float, float, str]:
    """Run cmd (probe.child); return (wall s, its peak RSS MiB, stdout); exit on failure."""
    meta, lines, err = child(cmd, env)
    if meta["rc"] != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{err}\n" + "\n".join(lines))
    return meta["wall"], meta["rss"], "\n".join(lines)


def forward_floor(model_dir: Path, ids: torch.Tensor, dtype) -> float:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.inference_mode():
        t = time.perf_counter()
        for i in range(0, ids.shape[0], 8):
            m.model(ids[i : i + 8])
        return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="what both tools quantize (alias, .gguf, directory)")
    ap.add_argument("--schemes", nargs="+", default=["fp8-kv8", "fp8-dynamic"])
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--eval-seq-len", type=int, help="evaluation sequence length (default: --seq-len)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-bench"))
    ap.add_argument("--skip-floor", action="store_true")
    ap.add_argument("--skip-llmc", action="store_true")
    ap.add_argument("--only", choices=["fp8ptq", "llmc"])
    ap.add_argument("--eval-data", help="off-domain text source scored beside the built-in split")
    ap.add_argument("--reuse", action="store_true", help="score existing outputs in --work instead of re-running")
    ap.add_argument(
        "--fp8ptq-args",
        default="",
        help="extra fp8ptq quantize options, e.g. "
        "'--offload-activations --chunk-tokens 1024' (the output folder gets a suffix)",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fp8ptq.data import load_samples
    from fp8ptq.eval.stream import compare_streaming
    from fp8ptq.models.loader import open_hf_dir, resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    src = resolve_model(args.model)
    tok = src.tokenizer()
    calib = load_samples("builtin", tok, args.num_samples, args.seq_len, "calibration", seed=0)
    calib_file = args.work / "calib.safetensors"
    save_file({"input_ids": calib.contiguous()}, str(calib_file))
    eval_len = args.eval_seq_len or args.seq_len
    eval_ids = load_samples("builtin", tok, args.eval_samples, eval_len, "evaluation", seed=0)
    off_ids = None
    if args.eval_data:
        off_ids = load_samples(args.eval_data, tok, args.eval_samples, eval_len, "evaluation", seed=0)

    def score(out_dir: Path) -> dict:  # layer by layer: a 262k-token head's whole-batch logits are GBs
        cand = open_hf_dir(out_dir)
        q = compare_streaming(src, cand, eval_ids)[0]
        if off_ids is not None:
            q["off_domain"] = compare_streaming(src, cand, off_ids)[0]
        return q

    rows = []
    if not args.skip_floor:
        for dt in (torch.float32, torch.bfloat16):
            rows.append(
                ("plain forward (floor)", str(dt).split(".")[1], forward_floor(src.path, calib, dt), None, None)
            )
    results = {}
    for spec in args.schemes:
        scheme, _, llmc_scheme = spec.partition("=")
        llmc_scheme = llmc_scheme or scheme
        tag = Path(scheme).stem
        extra = args.fp8ptq_args.split()
        out = args.work / "-".join([f"fp8ptq-{tag}", *(a.strip("-") for a in extra)])
        if args.only != "llmc":
            if args.reuse and (out / "fp8ptq_run.json").is_file():
                meta = json.loads((out / "fp8ptq_run.json").read_text())
            else:
                wall, rss, stdout = child_run(
                    [
                        sys.executable,
                        "-m",
                        "fp8ptq",
                        "quantize",
                        str(src.path),
                        "--recipe",
                        scheme,
                        "-o",
                        str(out),
                        "--overwrite",
                        "--no-recipe-gates",  # a comparison, not a gate check
                        "--eval-samples",
                        "0",
                        "--json",
                        "--num-samples",
                        str(args.num_samples),
                        "--seq-len",
                        str(args.seq_len),
                        *extra,
                    ]
                )
                manifest = json.loads(stdout)
                meta = dict(quantize_s=manifest["timings"]["quantize_s"], total_s=wall, rss=rss)
                (out / "fp8ptq_run.json").write_text(json.dumps(meta))
            q = score(out)
            results[("fp8ptq " + args.fp8ptq_args if extra else "fp8ptq", tag)] = dict(**meta, **q)
        if not args.skip_llmc and args.only != "fp8ptq":
            lout = args.work / f"llmc-{llmc_scheme}"
            if args.reuse and (lout / "llmc_bench.json").is_file():
                meta = json.loads((lout / "llmc_bench.json").read_text())
            else:
                wall, rss, stdout = child_run(
                    [
                        str(LLMC_PY),
                        str(BENCH / "llmc_quantize.py"),
                        "--model",
                        str(src.path),
                        "--calib",
                        str(calib_file),
                        "--scheme",
                        llmc_scheme,
                        "--out",
                        str(lout),
                    ]
                )
                info = json.loads(stdout.strip().splitlines()[-1])
                meta = dict(quantize_s=info["quantize_wall_s"], total_s=wall, rss=rss)
                (lout / "llmc_bench.json").write_text(json.dumps(meta))
            q = score(lout)
            results[("llm-compressor", llmc_scheme)] = dict(**meta, **q)
    print(
        f"\ncalibration: {args.num_samples}x{args.seq_len} tokens (built-in split, seed 0); "
        f"eval: {args.eval_samples}x{eval_len} held-out tokens; threads={torch.get_num_threads()}\n"
    )
    for name, dt, secs, _, _ in rows:
        print(f"- {name} {dt}: {secs:.1f} s")
    off_head = " off-domain KL | top-1 | PPL (ref) |" if off_ids is not None else ""
    print(f"\n| tool | scheme | calib+quant s | process s | peak RSS MiB | KL | top-1 | PPL (ref) |{off_head}")
    print("|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if off_ids is not None else ""))
    for (tool, scheme), r in results.items():
        cells = [
            f"{d['kl']:.5f} | {d['top1'] * 100:.2f}% | {d['ppl']:.3f} ({d['ppl_reference']:.3f})"
            for d in (r, r.get("off_domain"))
            if d is not None
        ]
        print(
            f"| {tool} | {scheme} | {r['quantize_s']:.1f} | {r['total_s']:.1f} | {r['rss']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    res_file = args.work / "results.json"  # merged across invocations (one row per tool/scheme)
    merged = json.loads(res_file.read_text()) if res_file.is_file() else {}
    merged.update({f"{t}/{s}": r for (t, s), r in results.items()})
    res_file.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    main()
