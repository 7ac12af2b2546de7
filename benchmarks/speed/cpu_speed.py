"""Calibrate+quantize time against one plain fp32 forward over the same tokens, in the same process.

    .venv/bin/python benchmarks/speed/cpu_speed.py [--recipe fp8-kv8] [--weights default rtn gptq] [--repeat 2]
        [--num-samples 64 --seq-len 512] [--model smollm2-135m] [--profile 25]

Each repeat times, back to back so both see the same machine load: (1) one plain `model.model(...)`
forward of the transformers model in fp32 over the calibration tokens, batches of 8 (the "floor":
what any calibration must at least run once), then (2) `fp8ptq.api.quantize` of the same model with
the same tokens and no quality check (`eval_samples=0`), once per --weights choice; the ratio is the manifest's `quantize_s`
(calibration + quantization + writing the layers) over the floor. `--profile N` prints the N
functions with the most own time in the quantize call (cProfile). Prints one markdown row per repeat.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def forward_floor(model_dir: Path, ids, batch: int = 8) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        t = time.perf_counter()
        for i in range(0, ids.shape[0], batch):
            m.model(ids[i : i + batch])
        return time.perf_counter() - t


def quantize_once(args, weights: str | None, out: Path, profile: int) -> float:
    from fp8ptq.api import QuantizeConfig, quantize

    cfg = QuantizeConfig(
        model=args.model,
        recipe=args.recipe,
        output=out,
        overwrite=True,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        eval_samples=0,
        weights=weights,
        device=args.device,
    )
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    manifest = quantize(cfg)
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(profile)
        print(s.getvalue())
    return float(manifest.timings["quantize_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="fp8-kv8")
    ap.add_argument("--weights", nargs="+", choices=["default", "rtn", "gptq"], default=["default"])
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--skip-floor", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from fp8ptq.data import load_samples
    from fp8ptq.models.loader import resolve_model

    src = resolve_model(args.model)
    ids = load_samples("builtin", src.tokenizer(), args.num_samples, args.seq_len, "calibration", seed=0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print("| repeat | recipe | weights | forward fp32 s | calibrate+quantize s | ratio |")
    print("|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="cpu-speed-") as tmp:
        for r in range(args.repeat):
            floor = float("nan") if args.skip_floor else forward_floor(src.path, ids)
            for w in args.weights:
                q = quantize_once(args, None if w == "default" else w, Path(tmp) / "out", args.profile if r == 0 else 0)
                print(f"| {r + 1} | {args.recipe} | {w} | {floor:.1f} | {q:.1f} | {q / floor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
