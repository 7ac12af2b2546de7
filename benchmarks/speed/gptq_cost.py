"""One Linear through the code quantize runs (`quantize_group`: GPTQ's solve and the error report) at a real
model's width, on the CPU: seconds, peak RSS and the reported output error, for before/after comparisons
of the solver's cost (run each checkout with its own PYTHONPATH, alternating).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/speed/gptq_cost.py --shape 4096x14336 --recipe fp8-kv8
    # the solve alone (ops.gptq.gptq on the recipe's grid): its peak above its inputs, in Hessians
    PYTHONPATH=$PWD .venv/bin/python benchmarks/speed/gptq_cost.py --shape 4096x14336 --solve-only

The Hessian is built from random inputs with a few outlier channels (8 x 1024 tokens): what matters here
is its size, not its values. Llama-3-8B's down_proj is 4096 x 14336 (its Hessian 784 MiB in fp32).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from fp8ptq.ops.gptq import gptq
from fp8ptq.quantization.weights import quantize_group, weight_grid
from fp8ptq.recipe import load_recipe


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x14336", help="out x in of the Linear")
    ap.add_argument("--recipe", default="fp8-kv8", help="its weights and calibration (GPTQ settings)")
    ap.add_argument("--solve-only", action="store_true", help="time ops.gptq.gptq alone (no error report)")
    a = ap.parse_args(argv)
    out, n = map(int, a.shape.split("x"))
    torch.manual_seed(0)
    r = load_recipe(a.recipe)
    W = torch.randn(out, n) * 0.02
    H = torch.zeros(n, n)
    for _ in range(8):
        X = torch.randn(1024, n)
        X[:, :: max(1, n // 8)] *= 20
        H.addmm_(X.T, X, alpha=2.0)
    del X
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    cal = r.calibration
    if a.solve_only:
        grid = weight_grid(r.scheme.weights, cal, W, r.scheme.input_activations is None)
        gptq(W, H, grid, block_size=cal.gptq_block_size, damp=cal.gptq_damp, act_order=cal.gptq_act_order)
        report = {}
    else:
        report = quantize_group({"linear": W}, r.scheme.weights, cal, H)["linear"].report
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {
        "shape": a.shape,
        "recipe": a.recipe,
        "seconds": round(time.perf_counter() - t, 2),
        "solve_only": a.solve_only,
        "peak_rss_mib": round(peak / 1024),
        "peak_rss_mib_before": round(before / 1024),
        "peak_above_inputs_hessians": round((peak - before) * 1024 / H.nbytes, 2),
        "output_rel_err": report.get("output_rel_err"),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
