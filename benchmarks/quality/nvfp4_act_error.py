"""How much each Linear type's output moves when its input is rounded to NVFP4 (W4A4's activations).

On the float model and the built-in calibration rows, every decoder Linear's input x is fake-quantized
as vLLM's W4A4 kernel does (groups of 16, FP8 E4M3 group scales computed at run time under a static
per-tensor global scale) and the squared output error ||Q(x) W^T - x W^T||^2 is summed per Linear type,
divided by the output's energy ||x W^T||^2. Columns: the static per-tensor scale (1 / input_global_scale)
at the min-max power of two (what fp8ptq calibrates, x 1) and multiples of it (below 1: the largest groups
saturate), and exact group scales (no FP8 rounding: what any static scale could at best buy).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/nvfp4_act_error.py
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from fp8ptq.data import load_samples
from fp8ptq.models.loader import resolve_model
from fp8ptq.ops.fp4 import FP4_MAX, NVFP4_GROUP, cast_e2m1, fake_quant_nvfp4_act
from fp8ptq.ops.grid import NVFP4_ACT_GRID

SHIFTS = (-2, -1, 0, 1, 2)


def exact_group_scales(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, NVFP4_GROUP).float()
    eff = (rows.abs().amax(-1, keepdim=True) / FP4_MAX).clamp_min(1e-30)
    return (cast_e2m1((rows / eff).clamp(-FP4_MAX, FP4_MAX)) * eff).reshape(x.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(args.model)
    ids = load_samples("builtin", AutoTokenizer.from_pretrained(src.path), args.num_samples, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def hook(kind: str):
        def observe(m, a):
            x = a[0].reshape(-1, a[0].shape[-1]).float()
            w = m.weight.float()
            y = x @ w.T
            d = acc[kind]
            d["energy"] += float(y.pow(2).sum())
            s0 = NVFP4_ACT_GRID.scale(x.abs().max())
            for k in SHIFTS:
                d[f"x {2.0**-k:g}"] += float((fake_quant_nvfp4_act(x, s0 * 2.0**-k) @ w.T - y).pow(2).sum())
            d["exact"] += float((exact_group_scales(x) @ w.T - y).pow(2).sum())

        return observe

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not model.lm_head:
            m.register_forward_pre_hook(hook(name.rsplit(".", 1)[-1]))
    with torch.inference_mode():
        for i in range(0, len(ids), 2):
            model(ids[i : i + 2])
    cols = [f"x {2.0**-k:g}" for k in SHIFTS] + ["exact"]
    print(
        f"{args.model}, {args.num_samples} x {args.seq_len} built-in calibration tokens: squared output error / output energy"
    )
    print(
        "| Linear | " + " | ".join(f"static scale {c}" if c != "exact" else "exact group scales" for c in cols) + " |"
    )
    print("|---|" + "---:|" * len(cols))
    for kind, d in acc.items():
        print(f"| {kind} | " + " | ".join(f"{d[c] / d['energy']:.5f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
