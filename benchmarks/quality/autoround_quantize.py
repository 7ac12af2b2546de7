"""auto-round (Intel, SignRound: sign-gradient rounding offsets + clip tuning) on the same calibration tokens
as fp8ptq, for the issue-37 peer comparison. Runs in its own venv (bash benchmarks/setup_autoround_venv.sh)
and writes the tuned model in auto-round's `fake` format: a float checkpoint holding the dequantized
weights, which is what a W4A16 engine computes, scored by `fp8ptq eval quality` like any float model.

    benchmarks/.venv-autoround/bin/python benchmarks/quality/autoround_quantize.py MODEL_DIR CALIB OUT \
        [--setting light|default] [--group-size 64] [--sym]

CALIB: a safetensors file with `input_ids` [N, L] (benchmarks/quality/compare_llmc.py writes one as
WORK/calib.safetensors: fp8ptq's built-in split). light = auto-round's CLI preset (50 iterations, lr 5e-3),
default = its library default (200 iterations); batch size 8 in both. Prints one JSON line: wall s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from safetensors.torch import load_file

SETTINGS = {"light": {"iters": 50, "lr": 5e-3}, "default": {"iters": 200, "lr": None}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("out")
    ap.add_argument("--setting", choices=list(SETTINGS), default="light")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sym", action="store_true", help="symmetric groups (default: asymmetric, as fp8ptq's w4a16)")
    args = ap.parse_args()

    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = load_file(args.calib)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    t = time.perf_counter()
    ar = AutoRound(
        model,
        tok,
        scheme="W4A16",
        bits=4,
        group_size=args.group_size,
        sym=args.sym,
        dataset=[ids[i : i + 1] for i in range(ids.shape[0])],
        nsamples=ids.shape[0],
        seqlen=ids.shape[1],
        batch_size=min(8, ids.shape[0]),
        device_map="cpu",
        **{k: v for k, v in SETTINGS[args.setting].items() if v is not None},
    )
    ar.quantize_and_save(args.out, format="fake")
    print(json.dumps({"setting": args.setting, "wall_s": time.perf_counter() - t, "tokens": list(ids.shape)}))


if __name__ == "__main__":
    main()
