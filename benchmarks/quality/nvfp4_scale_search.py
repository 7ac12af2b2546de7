"""NVFP4 weight-scale search on SmolLM2's Linears: summed squared weight error of min-max FP8 group
scales, of the shrink-only clip search (DEFAULT_SHRINK_GRID) and of fp8ptq's search that also tries
larger scales (NVFP4_SCALE_SEARCH, up to amax -> 4 instead of 6). Weight error only (no GPTQ, no data).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quality/nvfp4_scale_search.py [--layers 40]
"""

from __future__ import annotations

import argparse

import torch
from safetensors import safe_open

from fp8ptq.models.loader import resolve_model
from fp8ptq.ops.fp4 import NVFP4_SCALE_SEARCH, fake_quant_nvfp4, nvfp4_global_scale, nvfp4_search_scale
from fp8ptq.ops.intq import DEFAULT_SHRINK_GRID


def search_error(w: torch.Tensor, gs: torch.Tensor, factors: tuple[float, ...]) -> float:
    eff = nvfp4_search_scale(w, gs, factors)  # the recipes' own search (min-max alone when factors is empty)
    return float((fake_quant_nvfp4(w, eff) - w).square().sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=40, help="Linear weights to score (first N)")
    args = ap.parse_args()
    src = resolve_model(args.model)
    f = safe_open(str(sorted(src.path.glob("*.safetensors"))[0]), "pt")
    names = [n for n in f.keys() if "layers." in n and n.endswith("proj.weight")][: args.layers]
    tot = {"min-max": 0.0, "shrink only": 0.0, "fp8ptq (shrink + expand)": 0.0}
    for n in names:
        W = f.get_tensor(n).float()
        gs, w = nvfp4_global_scale(W), W.reshape(-1, 16)
        tot["min-max"] += search_error(w, gs, ())
        tot["shrink only"] += search_error(w, gs, DEFAULT_SHRINK_GRID)
        tot["fp8ptq (shrink + expand)"] += search_error(w, gs, NVFP4_SCALE_SEARCH)
    for k, v in tot.items():
        print(f"{k:28s} {v:10.2f}  ({v / tot['min-max']:.3f} of min-max)")


if __name__ == "__main__":
    main()
