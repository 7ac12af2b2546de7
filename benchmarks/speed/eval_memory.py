"""Peak RSS of `fp8ptq eval quality` on synthetic Llama-shaped models 8 vs 32 layers deep: the streaming
evaluator (one decoder layer of each model resident at a time) should be flat in depth; the
whole-model evaluator (`load_simulated` + `compare`, kept for lm-eval/spec/verify) grows with it.

Models: `fp8ptq.models.synthetic.write_synthetic` (hidden 1024, intermediate 4096, 16/4 heads, bf16,
a 1024-token in-process tokenizer so the layers dominate), converted data-free with `fp8-dynamic` (the
candidate); each measurement runs in its own process (benchmarks/probe.py).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/speed/eval_memory.py [--depths 8 32] [--samples 4] [--seq 256]
        [--work /tmp/fp8ptq-evalmem] [--no-whole]

Prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the shared probe.py
from probe import child  # noqa: E402

WHOLE = (
    "import json, sys; from fp8ptq.api import EvalConfig; from fp8ptq import data; "
    "from fp8ptq.eval.quality import compare, load_simulated; from fp8ptq.models.loader import open_hf_dir; "
    "from pathlib import Path; c, r = Path(sys.argv[1]), Path(sys.argv[2]); n, L = int(sys.argv[3]), int(sys.argv[4]); "
    "ids = data.load_samples(data.BUILTIN, open_hf_dir(r).tokenizer(), n, L, 'evaluation', 0); "
    "cand = load_simulated(open_hf_dir(c)); ref = load_simulated(open_hf_dir(r), simulate=False); "
    "print(json.dumps(compare(ref.model, cand.model, ids)))"
)


def build(work: Path, layers: int) -> tuple[Path, Path]:
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.models.synthetic import SyntheticSpec, write_synthetic, write_tokenizer

    tok = work / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        write_tokenizer(tok)
    src, out = work / f"synthetic-{layers}l", work / f"synthetic-{layers}l-fp8-dynamic"
    if not (src / "config.json").is_file():
        write_synthetic(src, tok, SyntheticSpec(layers=layers, vocab=1024))
    if not (out / "config.json").is_file():
        quantize(QuantizeConfig(model=str(src), recipe="fp8-dynamic", output=out, eval_samples=0))
    return src, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-evalmem"))
    ap.add_argument("--no-whole", action="store_true", help="skip the whole-model evaluator")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    for depth in a.depths:
        src, out = build(a.work, depth)
        disk = sum(f.stat().st_size for f in src.glob("*.safetensors")) / (1 << 20)
        cmd = [sys.executable, "-m", "fp8ptq", "eval", "quality", str(out), "--reference", str(src)]
        cmd += ["--num-samples", str(a.samples), "--seq-len", str(a.seq), "--json", "--no-record"]
        meta, lines, err = child(cmd, env)
        if meta["rc"] != 0:
            raise SystemExit(f"eval quality failed:\n{err}")
        kl = json.loads("\n".join(lines))["kl"]
        rows.append((depth, disk, "streaming (`eval quality`)", meta, kl))
        if not a.no_whole:
            meta, lines, err = child([sys.executable, "-c", WHOLE, str(out), str(src), str(a.samples), str(a.seq)], env)
            if meta["rc"] != 0:
                raise SystemExit(f"whole-model evaluator failed:\n{err}")
            rows.append((depth, disk, "whole model (load_simulated + compare)", meta, json.loads(lines[-1])["kl"]))
    print(f"evaluation tokens: {a.samples} x {a.seq}\n")
    print("| layers | bf16 on disk MiB | evaluator | peak RSS MiB | wall s | KL |")
    print("|---:|---:|---|---:|---:|---:|")
    for depth, disk, what, meta, kl in rows:
        print(f"| {depth} | {disk:.0f} | {what} | {meta['rss']:.0f} | {meta['wall']:.1f} | {kl:.6g} |")
    stream = {d: m["rss"] for d, _, w, m, _ in rows if w.startswith("streaming")}
    lo, hi = min(a.depths), max(a.depths)
    if lo != hi:
        print(f"\nstreaming peak RSS {hi} vs {lo} layers: {stream[hi] / stream[lo]:.3f}x (target <= 1.15x)")


if __name__ == "__main__":
    main()
