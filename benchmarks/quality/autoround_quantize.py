"""auto-round (Intel, SignRound: sign-gradient rounding offsets + clip tuning) on the same calibration tokens
as fp8ptq, for the issue-37 peer comparison. Runs in its own venv (bash benchmarks/setup_autoround_venv.sh)
and writes the tuned model in auto-round's `fake` format: a float checkpoint holding the dequantized
weights, which is what a W4A16 engine computes, scored by `fp8ptq eval quality` like any float model.

    benchmarks/.venv-autoround/bin/python benchmarks/quality/autoround_quantize.py MODEL_DIR CALIB OUT \
        [--setting light|default] [--scheme W4A16|NVFP4A16] [--group-size 64] [--sym]

CALIB: a safetensors file with `input_ids` [N, L] (benchmarks/quality/compare_llmc.py writes one as
WORK/calib.safetensors: fp8ptq's built-in split). light = auto-round's CLI preset (50 iterations, lr 5e-3),
default = its library default (200 iterations); batch size 8 in both. W4A16: INT4 groups of
--group-size (asymmetric unless --sym, as fp8ptq's w4a16); NVFP4A16: auto-round's NVFP4 preset (FP4 E2M1
in groups of 16, FP8 group scales, a global scale per tensor) with its activations left unquantized
(act_bits 16), as compressed-tensors' NVFP4A16 and fp8ptq's nvfp4a16. --iters overrides the setting's
iterations (a smoke run). Prints one JSON line: wall s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from safetensors.torch import load_file

SETTINGS = {"light": {"iters": 50, "lr": 5e-3}, "default": {"iters": 200, "lr": None}}


def scheme_args(scheme: str, group_size: int, sym: bool) -> dict:
    """AutoRound's keyword arguments for the weight format."""
    if scheme == "NVFP4A16":
        # NVFP4's weight fields without its activation ones: the preset's nv_fp4 act_data_type would reset
        # act_bits to 4 (auto_round.schemes._reconcile_bits_and_dtype).
        return {"scheme": {"bits": 4, "group_size": 16, "data_type": "nv_fp", "sym": True, "act_bits": 16}}
    return {"scheme": "W4A16", "bits": 4, "group_size": group_size, "sym": sym}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("out")
    ap.add_argument("--setting", choices=list(SETTINGS), default="light")
    ap.add_argument("--scheme", choices=["W4A16", "NVFP4A16"], default="W4A16")
    ap.add_argument("--group-size", type=int, default=64, help="W4A16's group size (NVFP4's is 16)")
    ap.add_argument("--iters", type=int, default=None, help="override the setting's iterations")
    ap.add_argument("--sym", action="store_true", help="symmetric groups (default: asymmetric, as fp8ptq's w4a16)")
    args = ap.parse_args()

    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = load_file(args.calib)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    settings = dict(SETTINGS[args.setting], **({"iters": args.iters} if args.iters else {}))
    t = time.perf_counter()
    ar = AutoRound(
        model,
        tok,
        **scheme_args(args.scheme, args.group_size, args.sym),
        dataset=[ids[i : i + 1] for i in range(ids.shape[0])],
        nsamples=ids.shape[0],
        seqlen=ids.shape[1],
        batch_size=min(8, ids.shape[0]),
        device_map="cpu",
        **{k: v for k, v in settings.items() if v is not None},
    )
    ar.quantize_and_save(args.out, format="fake")
    print(
        json.dumps(
            {
                "setting": args.setting,
                "scheme": args.scheme,
                "wall_s": time.perf_counter() - t,
                "tokens": list(ids.shape),
            }
        )
    )


if __name__ == "__main__":
    main()
