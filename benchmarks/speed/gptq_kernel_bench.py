"""GPTQ solve alone, on Llama-3-8B shapes: fp8ptq's eager column loop vs its fused Triton block kernel
(ops.gptq_kernel) vs llm-compressor's `quantize_weight` (0.14, its own Triton block kernel where it has
one), with the same W, H and scales; checks the kernel against the eager loop bit for bit.

    PYTHONPATH=$PWD python3 benchmarks/speed/gptq_kernel_bench.py --device cuda --json out.json
    # tiny smoke run on the CPU (the kernel then runs only under TRITON_INTERPRET=1):
    PYTHONPATH=$PWD python3 benchmarks/speed/gptq_kernel_bench.py --device cpu --shapes 64x128 --no-eager-big

Rows: shape x grid, each with seconds for eager / kernel / llm-compressor (median of --repeats after one
warm-up, CUDA synchronised), the kernel's speedup and `bit_equal`. llm-compressor's FP8 grids take
fp8ptq's own scale (the same grid, so the solves are the same algorithm); its INT4 row is symmetric
group-128 min-max with static act-order, fp8ptq's is asymmetric group-128 with act-order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from fp8ptq.ops import gptq as G
from fp8ptq.ops import gptq_kernel
from fp8ptq.ops.fp4 import mxfp4_grid, nvfp4_global_scale, nvfp4_grid
from fp8ptq.ops.fp8 import fp8_block_grid, fp8_grid
from fp8ptq.ops.granularity import CHANNEL, TENSOR, group
from fp8ptq.ops.hessian import hessian_partial
from fp8ptq.ops.intq import int_grid

# [out, in] of Llama-3-8B's Linears (q/k/v fused, gate/up fused, o, down)
SHAPES = "6144x4096,28672x4096,4096x4096,4096x14336"
GRIDS = ("fp8-tensor", "fp8-channel", "int4-g128-actorder", "fp8-block128")
# not in the default run (its time budget predates them): --grids names them
MORE_GRIDS = ("nvfp4-actorder", "mxfp4-actorder", "int4-g128-lazy")


def _grid(name: str, W: torch.Tensor):
    if name == "nvfp4-actorder":  # nvfp4a16's grid (its scale search: recipe weight_observer hessian_mse)
        return nvfp4_grid(nvfp4_global_scale(W), mse=True, hessian=True), {"act_order": True}
    if name == "mxfp4-actorder":
        return mxfp4_grid(mse=True, hessian=True), {"act_order": True}
    if name == "int4-g128-lazy":  # GPTQ without act-order: one kernel launch per group
        return int_grid(4, False, group(128)), {}
    if name == "fp8-tensor":
        return fp8_grid(TENSOR), {}
    if name == "fp8-channel":
        return fp8_grid(CHANNEL), {}
    if name == "int4-g128-actorder":
        return int_grid(4, False, group(128)), {"act_order": True}
    return fp8_block_grid(128, 128), {"static_groups": True}


def _timed(fn, device, repeats: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _llmc(W, H, grid_name, params, device, repeats):
    """llm-compressor's solver on the same problem: (seconds, its weights) or (None, why not)."""
    try:
        from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs
        from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    except Exception as e:  # noqa: BLE001 - the row says why
        return None, f"no llm-compressor: {e}"
    if grid_name not in ("fp8-tensor", "fp8-channel", "int4-g128-actorder"):
        return None, "not compared"
    if grid_name.startswith("fp8"):
        strategy = "tensor" if grid_name == "fp8-tensor" else "channel"
        args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)
        scale = params[0].reshape(1, -1) if strategy == "tensor" else params[0].reshape(1, -1, 1)
        zp = torch.zeros_like(scale, dtype=torch.float8_e4m3fn)
    else:
        args = QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=128, symmetric=True, actorder=ActivationOrdering.STATIC
        )
        amax = W.abs().reshape(W.shape[0], -1, 128).amax(-1)
        scale = (amax / 7.5).clamp_min(1e-8).unsqueeze(0)
        zp = torch.zeros_like(scale, dtype=torch.int8)
    Hn = H / H.diagonal().mean()  # it expects a normalised Hessian; damping is relative anyway
    try:
        s, q = _timed(
            lambda: quantize_weight(W[None].clone(), Hn[None].clone(), scale, zp, None, args), device, repeats
        )
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:300]}"
    return s, q[0][0].float()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--grids", default=",".join(GRIDS), help=f"also: {', '.join(MORE_GRIDS)}")
    ap.add_argument("--tokens", type=int, default=4096, help="rows of X behind the Hessian")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-eager-big", action="store_true", help="skip the eager loop above 16M weights")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sweep", default="", help="tiles to time on the first shape's fp8-tensor solve: 16x2,32x4,...")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    torch.manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        out, n = map(int, shape.split("x"))
        W = (torch.randn(out, n, device=device) * 0.02).bfloat16().float()
        X = torch.randn(a.tokens, n, device=device)
        X[:, :: max(1, n // 8)] *= 20  # a few outlier input channels, as real activations have
        H = hessian_partial(X)
        del X
        for name in a.grids.split(","):
            grid, kw = _grid(name, W)
            row = {"shape": shape, "grid": name, "kernel_available": gptq_kernel.available(device)}
            os.environ["FP8PTQ_GPTQ_KERNEL"] = "auto"
            _, ref = _timed(lambda: G.gptq(W, H, grid, **kw), device, 1)  # warm-up (Triton compiles here)
            row["kernel_s"], k = _timed(lambda: G.gptq(W, H, grid, **kw), device, a.repeats)
            if not (a.no_eager_big and out * n > 1 << 24):
                os.environ["FP8PTQ_GPTQ_KERNEL"] = "eager"
                row["eager_s"], e = _timed(lambda: G.gptq(W, H, grid, **kw), device, max(1, a.repeats - 2))
                os.environ["FP8PTQ_GPTQ_KERNEL"] = "auto"
                row["bit_equal"] = torch.equal(k.weight.view(torch.int32), e.weight.view(torch.int32)) and torch.equal(
                    k.scale, e.scale
                )
                row["max_abs_diff"] = float((k.weight - e.weight).abs().max())
                row["speedup"] = row["eager_s"] / row["kernel_s"]
            row["llmc_s"], q = _llmc(W, H, name, (k.scale, k.zero_point), device, a.repeats)
            if isinstance(q, torch.Tensor):  # how far its answer is from fp8ptq's (same grid for the FP8 rows)
                row["llmc_rel_diff"] = float((q - k.weight).norm() / k.weight.norm())
            else:
                row["llmc_note"] = q
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                a.json.write_text(json.dumps({"device": str(device), "tile": gptq_kernel.TILE, "rows": rows}, indent=2))
        for tile in filter(None, a.sweep.split(",")) if shape == a.shapes.split(",")[0] else ():
            before, gptq_kernel.TILE = gptq_kernel.TILE, tuple(map(int, tile.split("x")))
            grid, _ = _grid("fp8-tensor", W)
            _timed(lambda: G.gptq(W, H, grid), device, 1)
            t, _ = _timed(lambda: G.gptq(W, H, grid), device, a.repeats)
            rows.append({"shape": shape, "grid": "fp8-tensor", "tile": tile, "kernel_s": t})
            print(json.dumps(rows[-1]), flush=True)
            gptq_kernel.TILE = before
    return rows


if __name__ == "__main__":
    main()
