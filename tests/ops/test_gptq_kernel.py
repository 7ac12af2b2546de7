"""The fused GPTQ block kernel (ops.gptq_kernel) against the eager solver, bit for bit, for every grid the
solver serves (FP8, MXFP8, integer, NVFP4, MXFP4; fixed, static and lazy group params), on the CPU through
Triton's interpreter.

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
from fp8ptq.ops.fp4 import fake_quant_nvfp4, mxfp4_grid, nvfp4_global_scale, nvfp4_grid
from fp8ptq.ops.fp8 import fp8_block_grid, fp8_grid
from fp8ptq.ops.intq import int_grid
from fp8ptq.ops.mx import mxfp8_grid
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
    # lazy groups (params chosen from the error-updated weights as the solve reaches each group): a
    # launch per group, two groups per 64-column block
    "int4 sym g32 lazy": (int_grid(4, True, group(32)), {}),
    "int4 asym g32 mse lazy": (int_grid(4, False, group(32), mse=True), {}),
    "fp8 block 8x32 lazy": (fp8_block_grid(8, 32), {}),
    "mxfp8 hessian-mse, act-order": (mxfp8_grid(mse=True, hessian=True), {"act_order": True}),  # mxfp8a16
    "mxfp8 lazy": (mxfp8_grid(), {}),
    "nvfp4 hessian-mse, act-order": (nvfp4_grid(nvfp4_global_scale(W), True, True), {"act_order": True}),
    "nvfp4 lazy": (nvfp4_grid(nvfp4_global_scale(W)), {}),
    "mxfp4 hessian-mse, act-order": (mxfp4_grid(mse=True, hessian=True), {"act_order": True}),  # mxfp4a16
    "mxfp4 lazy": (mxfp4_grid(), {}),
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
        # what each rounded from (SignRound's start): the kernel writes its register rows back
        "updated": torch.equal(a.updated.view(torch.int32), b.updated.view(torch.int32)),
    }
# the E2M1 rounding alone, on every tie and binade edge, both zeros, saturation and subnormals: one block with
# an identity inverse Hessian (no error reaches another column), against ops.fp4's fake-quant of each value
v = torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e-30, 1e-40, 0.2499, 0.2501, 4.9999])
v = torch.cat([v, -v, v * 0.37, v * 3.3])  # [64]; x 0.37 / 3.3: products that round to bf16
eff = torch.tensor([1.0, 0.37, 0.125, 3.3]).reshape(4, 1)  # per output channel: NVFP4- and MXFP4-like
W1 = (v.reshape(-1, 1) * eff.T).contiguous()  # [64 columns, 4 outputs]: value / eff = v for every output
Q1, E1 = torch.empty_like(W1), torch.empty_like(W1)
grid = K.FusedGrid("fp4", eff, None, torch.zeros(64, dtype=torch.int32))
K.solve_block(W1.clone(), Q1, E1, torch.eye(64), grid, (0, 0, 64))
ties = torch.equal(Q1.view(torch.int32), fake_quant_nvfp4(W1.T, eff).T.contiguous().view(torch.int32))
print(json.dumps([rows, ties]))
"""


def test_kernel_equals_eager_solver_bit_for_bit_for_every_grid():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("FP8PTQ_GPTQ_KERNEL", None)
    r = subprocess.run(
        [str(vllm_python()), "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows, ties = json.loads(r.stdout.strip().splitlines()[-1])
    assert ties  # E2M1's ties to even, both zeros, saturation: the kernel's rounding is fake_quant_nvfp4's
    assert len(rows) == 20
    for name, row in rows.items():
        assert row["weight"] and row["scale"] and row["updated"], (name, row)
        assert row["changed"], name
    assert rows["fp8 tensor"]["negative zeros"] >= 1  # the -0.0 weight came through as -0.0 on both paths


def test_eager_without_a_gpu_or_the_interpreter():
    # the main venv: no Triton, or Triton without the interpreter -> the CPU keeps the eager loop
    assert not gptq_kernel.available(torch.device("cpu"))
