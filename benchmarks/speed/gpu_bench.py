"""One command: fp8ptq vs llm-compressor on a synthetic Llama-3-8B-shaped model, same tokens, same evaluator.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/speed/gpu_bench.py --device cuda --layers 8 [--num-samples 64 \
        --seq-len 512] [--eval-samples 4] [--work /tmp/fp8ptq-gpubench] [--no-llmc] [--json out.json]

The model (fp8ptq.models.synthetic: hidden 4096, intermediate 14336, 32/8 heads, vocab 128256 by
default, random bf16 weights with a few outlier channels) and its 1024-token tokenizer are written
once under --work; both tools get the same calibration tokens (the built-in calibration split, seed 0,
also saved to calib.safetensors for llm-compressor). Runs, each in its own process:

  fp8ptq fp8-kv8 --weights rtn   vs  llm-compressor fp8-kv8 (QuantizationModifier "FP8" + FP8 KV oneshot)
  fp8ptq fp8-kv8 (GPTQ, default) vs  llm-compressor fp8-kv8-gptq (GPTQModifier "FP8" + FP8 KV)
  fp8ptq w4a16 --group-size 64   vs  llm-compressor w4a16-g64-gptq (GPTQModifier)
  fp8ptq fp8-kv8 GPTQ with FP8PTQ_GPTQ_KERNEL=eager (on CUDA only: the column loop the fused kernel replaced)
  fp8ptq w4a16 with llm-compressor's algorithm (benchmarks/recipes/w4a16-sym-minmax-gptq-act.yaml: symmetric,
      min-max groups, static act-order): the matched pair of llm-compressor's w4a16-g64-gptq

in that order (PLAN; --plan picks entries), pairs side by side; each row is scored and written to --json
as it finishes. --repeats N runs the plan N times, tools alternating, and reports medians (every sample
kept in the JSON); KL is computed once per row (the export is the same each repeat). CUDA is
initialised before both tools' timers; the process wall includes it for both.

Per run: the tool's own calibrate+quantize wall time, the process wall time, peak GPU memory
(torch.cuda.max_memory_allocated in the tool's process; on --device cpu the process's peak RSS) and
the KL of the export against the unquantized model from fp8ptq's streaming evaluator (`eval quality`
numerics, on --device) over --eval-samples held-out samples. llm-compressor runs from
benchmarks/.venv-llmc (bash benchmarks/setup_llmc_venv.sh; --llmc-python to point elsewhere); without it
the table has fp8ptq's rows only and says so. With `--device cpu` and tiny sizes (--hidden 64 ...) the
whole command runs in a test (tests/benchmarks/test_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the shared probe.py
from probe import child  # noqa: E402

LLMC_PY = ROOT / "benchmarks" / ".venv-llmc" / "bin" / "python"
# llm-compressor 0.14's W4A16 GPTQ (symmetric, min-max groups, GPTQModifier's default static act-order)
MATCHED_W4A16 = ROOT / "benchmarks" / "recipes" / "w4a16-sym-minmax-gptq-act.yaml"

# One fp8ptq quantize in a fresh process; prints {"timings", "peak_mib", "memory"} as its last line.
FP8PTQ_RUN = """
import json, resource, sys
import torch
from fp8ptq.api import QuantizeConfig, quantize
a = json.loads(sys.argv[1])
cuda = a["device"].startswith("cuda")
if cuda:  # CUDA initialised before the tool's timer, as for llm-compressor
    torch.empty(1, device=a["device"])
    torch.cuda.reset_peak_memory_stats()
m = quantize(QuantizeConfig(**{**a, "output": __import__("pathlib").Path(a["output"])}))
peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"timings": m.timings, "peak_mib": peak, "memory": "GPU" if cuda else "RSS"}))
"""

# llm-compressor's benchmarks/llmc_quantize.py with the peak GPU memory of its process appended.
LLMC_RUN = """
import json, resource, runpy, sys
import torch
sys.argv = [sys.argv[1], *sys.argv[2:]]
cuda = torch.cuda.is_available()
if cuda:  # CUDA initialised before the tool's timer, as for fp8ptq
    torch.empty(1, device="cuda")
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_mib": peak, "memory": "GPU" if cuda else "RSS"}))
"""

# (label, recipe, weights override, group size override, extra environment[, --compute-dtype]); the
# compute dtype defaults to auto (tf32 on CUDA); the fp32/bf16 rows measure what the default changed
FP8PTQ_RUNS = [
    ("fp8-kv8 RTN", "fp8-kv8", "rtn", None, {}),
    ("fp8-kv8 GPTQ (default)", "fp8-kv8", None, None, {}),
    ("fp8-kv8 GPTQ, eager column loop", "fp8-kv8", None, None, {"FP8PTQ_GPTQ_KERNEL": "eager"}),
    ("w4a16 g64 GPTQ", "w4a16", None, 64, {}),
    ("w4a16 g64 GPTQ, llm-compressor's algorithm", str(MATCHED_W4A16), None, 64, {}),  # the matched pair
    ("fp8-kv8 RTN, fp32 passes", "fp8-kv8", "rtn", None, {}, "fp32"),
    ("fp8-kv8 RTN, bf16 passes", "fp8-kv8", "rtn", None, {}, "bf16"),
    ("fp8-kv8 GPTQ, fp32 passes", "fp8-kv8", None, None, {}, "fp32"),
    ("fp8-kv8 GPTQ, bf16 passes", "fp8-kv8", None, None, {}, "bf16"),
]
LLMC_RUNS = [("fp8-kv8 oneshot", "fp8-kv8"), ("fp8-kv8 GPTQ", "fp8-kv8-gptq"), ("w4a16 g64 GPTQ", "w4a16-g64-gptq")]
PLAN = [("fp8ptq", 0), ("llmc", 0), ("fp8ptq", 1), ("llmc", 1), ("fp8ptq", 3), ("llmc", 2), ("fp8ptq", 2)]
PLAN += [("fp8ptq", 4), ("fp8ptq", 5), ("fp8ptq", 6), ("fp8ptq", 7), ("fp8ptq", 8)]


def build(a) -> tuple[Path, Path]:
    """The synthetic model and the calibration tokens (written once per shape under --work)."""
    import torch
    from safetensors.torch import save_file

    from fp8ptq import data
    from fp8ptq.models.loader import open_hf_dir
    from fp8ptq.models.synthetic import SyntheticSpec, write_synthetic, write_tokenizer

    tok = a.work / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        write_tokenizer(tok)
    spec = SyntheticSpec(
        layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab
    )
    src = a.work / f"llama-{a.layers}l-{a.hidden}h-{a.intermediate}i-{a.heads}q{a.kv_heads}kv-{a.vocab}v"
    if not (src / "config.json").is_file():
        write_synthetic(src, tok, spec)
    ids = data.load_samples(data.BUILTIN, open_hf_dir(src).tokenizer(), a.num_samples, a.seq_len, "calibration", 0)
    calib = a.work / f"calib-{a.num_samples}x{a.seq_len}.safetensors"
    save_file({"input_ids": ids.to(torch.int64).contiguous()}, str(calib))
    return src, calib


def kl_of(out: Path, src: Path, a) -> tuple[float, str]:
    """KL of the export against the unquantized model (fp8ptq's streaming evaluator, `eval quality` numerics)
    on --device; on the CPU if the device run fails (the reason is printed). Returns (KL, where it ran)."""
    from fp8ptq import data
    from fp8ptq.eval.stream import compare_streaming
    from fp8ptq.models.loader import resolve_model

    ref, cand = resolve_model(str(src)), resolve_model(str(out))
    ids = data.load_samples(data.BUILTIN, ref.tokenizer(), a.eval_samples, a.seq_len, "evaluation", 0)
    try:
        return float(compare_streaming(ref, cand, ids, device=a.device)[0]["kl"]), a.device
    except Exception as e:  # noqa: BLE001 -- a benchmark row is still worth its CPU score
        if a.device == "cpu":
            raise
        print(f"KL on {a.device} failed ({type(e).__name__}: {e}); scoring on the CPU", flush=True)
        return float(compare_streaming(ref, cand, ids, device="cpu")[0]["kl"]), "cpu"


def run_fp8ptq(a, src: Path, env: dict, i: int) -> dict:
    label, recipe, weights, group, extra, *dtype = FP8PTQ_RUNS[i]
    out = a.work / f"fp8ptq-{i}-{Path(recipe).stem}-{a.device}"
    cfg = dict(
        model=str(src), recipe=recipe, output=str(out), overwrite=True, num_samples=a.num_samples,
        seq_len=a.seq_len, eval_samples=0, device=a.device, weights=weights, group_size=group,
        compute_dtype=dtype[0] if dtype else "auto",
    )  # fmt: skip
    meta, lines, err = child([sys.executable, "-c", FP8PTQ_RUN, json.dumps(cfg)], {**env, **extra})
    if meta["rc"] != 0:
        raise SystemExit(f"fp8ptq {label} failed:\n{err[-3000:]}")
    r = json.loads(lines[-1])
    quantize_s, process_s = r["timings"]["quantize_s"], meta["wall"]
    return dict(
        tool="fp8ptq", run=label, quantize_s=quantize_s, process_s=process_s, **_mem(r), out=out, timings=r["timings"]
    )


def run_llmc(a, src: Path, calib: Path, env: dict, i: int) -> dict:
    label, scheme = LLMC_RUNS[i]
    out = a.work / f"llmc-{scheme}"
    script = str(ROOT / "benchmarks" / "llmc_quantize.py")
    cmd = [str(a.llmc_python), "-c", LLMC_RUN, script, "--model", str(src), "--calib", str(calib)]
    meta, lines, err = child(cmd + ["--scheme", scheme, "--out", str(out)], env)
    if meta["rc"] != 0:
        raise SystemExit(f"llm-compressor {label} failed:\n{err[-3000:]}")
    run = next(json.loads(x) for x in reversed(lines) if x.startswith("{") and "quantize_wall_s" in x)
    r = json.loads(lines[-1])
    return dict(
        tool="llm-compressor",
        run=label,
        quantize_s=run["quantize_wall_s"],
        process_s=meta["wall"],
        **_mem(r),
        out=out,
    )


def medians(rows: list[dict]) -> list[dict]:
    """One row per (tool, run): median calibrate+quantize and process seconds over its repeats, every sample kept."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["tool"], r["run"]), []).append(r)
    out = []
    for (tool, run), rs in groups.items():
        q, p = [r["quantize_s"] for r in rs], [r["process_s"] for r in rs]
        out.append(
            dict(
                tool=tool, run=run, quantize_s=statistics.median(q), process_s=statistics.median(p), repeats=len(rs),
                quantize_samples=q, process_samples=p, peak_mib=max(r["peak_mib"] for r in rs),
                memory=rs[0]["memory"], kl=rs[0]["kl"],
            )
        )  # fmt: skip
    return out


def _mem(r: dict) -> dict:
    return {"peak_mib": r["peak_mib"], "memory": r["memory"]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-gpubench"))
    ap.add_argument("--no-llmc", action="store_true")
    ap.add_argument("--llmc-python", type=Path, default=LLMC_PY)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--plan", default="", help="comma-separated indices into PLAN: run only those (default: all)")
    ap.add_argument(
        "--repeats", type=int, default=1, help="run the plan this many times, alternating tools; medians are reported"
    )
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    a.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    src, calib = build(a)
    rows: list[dict] = []
    llmc = "not run (--no-llmc)" if a.no_llmc else None
    if llmc is None and not a.llmc_python.is_file():
        llmc = f"not run: no llm-compressor at {a.llmc_python} (bash benchmarks/setup_llmc_venv.sh)"

    kl: dict = {}  # (tool, run) -> KL: the exports of one row are the same from repeat to repeat

    def done(r: dict, repeat: int) -> None:  # each row scored and saved as it finishes: a cut-short run keeps it
        key = (r["tool"], r["run"])
        if key not in kl:
            kl[key] = kl_of(r["out"], src, a)
        r.update(kl=kl[key][0], kl_device=kl[key][1], out=str(r["out"]), repeat=repeat)
        rows.append(r)
        print(json.dumps(r), flush=True)
        if a.json:
            a.json.write_text(json.dumps({"rows": rows, "medians": medians(rows), "llmc": llmc or "run"}, indent=2))

    plan = [PLAN[int(k)] for k in a.plan.split(",")] if a.plan else PLAN
    for repeat in range(a.repeats):
        for tool, i in plan:  # pairs side by side, so a run cut short still has both tools' rows
            if tool == "fp8ptq" and FP8PTQ_RUNS[i][4] and not a.device.startswith("cuda"):
                continue  # the eager-loop row: off the GPU there is no kernel to compare it with
            if tool == "fp8ptq":
                done(run_fp8ptq(a, src, env, i), repeat)
            elif llmc is None:
                done(run_llmc(a, src, calib, env, i), repeat)
    print(
        f"model: {src.name}; calibration {a.num_samples} x {a.seq_len}; device {a.device}; KL over {a.eval_samples} x {a.seq_len}"
    )
    print("| tool | run | calibrate+quantize s (median) | process s (median) | repeats | peak MiB | KL |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for m in medians(rows):
        mib = f"{m['peak_mib']:.0f} ({m['memory']})"
        print(
            f"| {m['tool']} | {m['run']} | {m['quantize_s']:.1f} | {m['process_s']:.1f} | {m['repeats']} | {mib} | {m['kl']:.5f} |"
        )
    if llmc:
        print(f"\nllm-compressor: {llmc}")
    return rows


if __name__ == "__main__":
    main()
