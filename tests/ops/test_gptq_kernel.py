"""The fused GPTQ block kernel (ops.gptq_kernel) against the eager solver, bit for bit, for every grid it
serves, on the CPU through Triton's interpreter.

The main venv has no Triton (the CPU wheel of torch does not need it); .venv-vllm has the pinned one
(constraints/vllm.txt: triton 3.9.0, beside the same torch 2.13.0), so the check runs there in one
subprocess with TRITON_INTERPRET=1 set before Triton is imported. fp8ptq.ops imports only torch.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from fp8ptq.engine.vllm import vllm_python
from fp8ptq.ops import gptq_kernel

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import json, os, torch
from fp8ptq.ops import gptq as G, gptq_kernel as K
from fp8ptq.ops.fp8 import fp8_block_grid, fp8_grid
from fp8ptq.ops.intq import int_grid
from fp8ptq.ops.hessian import hessian_partial
from fp8ptq.ops.granularity import TENSOR, CHANNEL, group
assert K.INTERPRET and K.available(torch.device("cpu"))
torch.manual_seed(0)
out, n = 40, 160  # 40 rows: a partial channel tile; 160 columns in blocks of 64: a partial last block
W = torch.randn(out, n) * 0.05
W[:, 3] *= 40  # an outlier input channel
W[5, 0] = -0.0  # a negative zero in the first column (no error reaches it) must keep its sign
W[:, 11] = 1.0  # a dead input (zero Hessian diagonal, below): zeroed before the solve
X = torch.randn(600, n)
X[:, 11] = 0.0
H = hessian_partial(X)
grids = {
    "fp8 tensor": (fp8_grid(TENSOR), {}),
    "fp8 tensor, act-order": (fp8_grid(TENSOR), {"act_order": True}),  # fp8-kv8's default
    "fp8 channel": (fp8_grid(CHANNEL), {}),
    "fp8 channel, fixed scale": (fp8_grid(CHANNEL, torch.full((out,), 2e-4)), {}),
    "fp8 block 8x32, act-order": (fp8_block_grid(8, 32), {"act_order": True}),
    "fp8 block 8x32, static": (fp8_block_grid(8, 32), {"static_groups": True}),
    "int4 asym channel": (int_grid(4, False, CHANNEL), {}),
    "int8 sym tensor": (int_grid(8, True, TENSOR), {}),
    "int8 sym channel, act-order": (int_grid(8, True, CHANNEL), {"act_order": True}),
    "int4 asym g32 mse, act-order": (int_grid(4, False, group(32), mse=True, hessian=True), {"act_order": True}),
    "int4 sym g16 static": (int_grid(4, True, group(16)), {"static_groups": True}),
}
rows = {}
for name, (grid, kw) in grids.items():
    os.environ["FP8PTQ_GPTQ_KERNEL"] = "eager"
    a = G.gptq(W, H, grid, block_size=64, **kw)
    os.environ["FP8PTQ_GPTQ_KERNEL"] = "auto"
    b = G.gptq(W, H, grid, block_size=64, **kw)
    rows[name] = {
        "weight": torch.equal(a.weight.view(torch.int32), b.weight.view(torch.int32)),
        "scale": torch.equal(a.scale, b.scale),
        "negative zeros": int((b.weight.view(torch.int32) == -2147483648).sum()),
        "changed": bool((a.weight != W).any()),
        # what each rounded from (SignRound's start): the kernel's q + err * d against the eager loop's rows
        "updated": bool(torch.allclose(a.updated, b.updated, rtol=1e-5, atol=1e-6)),
    }
print(json.dumps(rows))
"""


def test_kernel_equals_eager_solver_bit_for_bit_for_every_grid():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("FP8PTQ_GPTQ_KERNEL", None)
    r = subprocess.run(
        [str(vllm_python()), "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 11
    for name, row in rows.items():
        assert row["weight"] and row["scale"] and row["updated"], (name, row)
        assert row["changed"], name
    assert rows["fp8 tensor"]["negative zeros"] >= 1  # the -0.0 weight came through as -0.0 on both paths


def test_eager_without_a_gpu_or_the_interpreter():
    # the main venv: no Triton, or Triton without the interpreter -> the CPU keeps the eager loop
    assert not gptq_kernel.available(torch.device("cpu"))
