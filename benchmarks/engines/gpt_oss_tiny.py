"""Simulated KL of tiny gpt-oss exports against the float model (what tests/contracts asserts, printed):
a random gpt-oss from transformers' GptOssConfig with the adapter's `tiny` sizes, quantized per recipe on
4 x 64 calibration tokens, compared on 4 x 64 built-in evaluation tokens.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/engines/gpt_oss_tiny.py fp8-kv8 fp8-dynamic w8a8-int8 w4a16 [--work DIR]

Prints one JSON line per recipe (kl, top1, quantize seconds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.data import load_samples
    from fp8ptq.eval.quality import compare, load_simulated
    from fp8ptq.models.loader import open_hf_dir
    from fp8ptq.models.synthetic import write_random, write_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-gpt-oss-tiny"))
    a = ap.parse_args()
    tok = a.work / "tok" if (a.work / "tok").exists() else write_tokenizer(a.work / "tok")
    src = a.work / "model"
    if not (src / "config.json").exists():
        write_random(src, "gpt_oss", tok)
    ids = load_samples("builtin", open_hf_dir(src).tokenizer(), 4, 64, "evaluation")
    ref = load_simulated(open_hf_dir(src), simulate=False).model
    for recipe in a.recipes:
        out, start = a.work / recipe, time.time()
        cfg = QuantizeConfig(
            model=str(src), recipe=recipe, output=out, num_samples=4, seq_len=64, eval_samples=0, overwrite=True
        )
        quantize(cfg)
        q = compare(ref, load_simulated(open_hf_dir(out)).model, ids)
        print(json.dumps({"recipe": recipe, "kl": q["kl"], "top1": q.get("top1"), "quantize_s": time.time() - start}))


if __name__ == "__main__":
    main()
