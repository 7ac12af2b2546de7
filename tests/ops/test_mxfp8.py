"""MXFP8 (ops/mx.py) against compressed-tensors' own pieces: its E8M0 weight scale rule
(`generate_mx_scales(num_bits=8)`) and its mxfp8-quantized compressor decompressing our fake-quant bit
for bit (RTN, the MSE exponent choice, GPTQ); the dynamic activation scale is the smallest power of two
that keeps every value of a group within E4M3's 448 (vLLM's rule)."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

from fp8ptq.ops.gptq import gptq
from fp8ptq.ops.mx import choose_mxfp8_scale, fake_quant_mxfp8, fake_quant_mxfp8_act, mxfp8_act_scale, mxfp8_grid

from helpers import mx_round_trip, mx_rtn, vllm_venv_prints

ARGS = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype="uint8")


def _rtn(w: torch.Tensor, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return mx_rtn(w, choose_mxfp8_scale, fake_quant_mxfp8, mse)


def _ct_round_trip(fake: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    stored = {"weight": (torch.float8_e4m3fn, tuple(fake.shape)), "weight_scale": (torch.uint8, tuple(scale.shape))}
    return mx_round_trip("mxfp8-quantized", ARGS, fake, scale, stored)


def test_minmax_scale_is_compressed_tensors_rule():
    torch.manual_seed(0)
    amax = (torch.rand(4096) * torch.logspace(-6, 4, 4096)).to(torch.bfloat16)
    amax = torch.cat([amax, torch.tensor([1.0, 1.5, 1.75, 1.749, 448.0, 449.0, 512.0], dtype=torch.bfloat16)])
    ours = choose_mxfp8_scale(torch.stack([amax.float(), torch.zeros_like(amax).float()], dim=-1))
    ct = torch.exp2(generate_mx_scales(amax.reshape(-1, 1), num_bits=8).float() - 127)
    assert torch.equal(ours, ct)
    assert ((amax.float().reshape(-1, 1) / ours) <= 448).all()  # min-max never saturates E4M3


@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("shape", [(64, 128), (48, 32)])
def test_compressor_decompresses_our_weights_exactly(shape, mse):
    torch.manual_seed(1)
    w = torch.randn(shape) * torch.logspace(-30, 3, shape[1])  # groups of very different size
    w[0, :32] = 0.0
    w[1, :32] = 1e30
    fake, scale = _rtn(w, mse)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # powers of two
    assert torch.equal(fake[0, :32], torch.zeros(32))
    assert torch.equal(_ct_round_trip(fake, scale), fake)


def test_mse_exponent_never_worse_than_the_rule():
    """E4M3 is floating point: both exponents give every normal value the same absolute step, so the lower
    one only adds saturation and the choice differs only for groups with subnormal-range values (why the
    MXFP8 recipes keep weight_observer: minmax). Here half the groups hold values down to 1e-6 of their max."""
    torch.manual_seed(2)
    w = torch.randn(512, 32) * torch.rand(512, 1) * 10
    w[::2, 1:] *= 1e-4
    w[:, 0] = w[:, 0].sign() * w.abs().amax(-1) * 1.8  # the top value's mantissa >= 1.75: the rule takes the upper
    err = lambda mse: (_rtn(w, mse)[0] - w).square().sum(-1)  # noqa: E731
    assert (err(True) <= err(False)).all()


def test_activation_scale_is_the_smallest_power_of_two_within_448():
    torch.manual_seed(4)
    amax = torch.cat([torch.rand(20000) * torch.logspace(-30, 30, 20000), torch.tensor([448.0, 449.0, 896.0, 1.0])])
    s = mxfp8_act_scale(amax)
    assert torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5))
    assert (amax / s <= 448).all() and (amax / (s / 2) > 448).all()
    assert mxfp8_act_scale(torch.zeros(1)).item() == 2.0**-127  # all-zero group: the smallest E8M0 scale


def test_dynamic_activations_are_per_group_of_32():
    torch.manual_seed(5)
    x = torch.randn(3, 5, 64)
    x[0, 0, 32:] *= 1000  # one loud group does not coarsen its neighbour
    q = fake_quant_mxfp8_act(x)
    assert q.shape == x.shape and q.dtype == x.dtype
    quiet = fake_quant_mxfp8_act(x[0, 0, :32].reshape(1, 32))
    assert torch.equal(q[0, 0, :32], quiet.reshape(32))
    rel = ((q - x).norm() / x.norm()).item()
    assert 0 < rel < 0.04  # E4M3: 3 mantissa bits


@pytest.mark.parametrize("mse", [False, True])
def test_gptq_on_the_mx_grid_exports_exactly_and_helps(mse):
    torch.manual_seed(3)
    W = torch.randn(64, 128)
    X = torch.randn(1024, 128) @ (torch.eye(128) + 0.3 * torch.randn(128, 128))
    H = 2 * X.T @ X
    r = gptq(W, H, mxfp8_grid(mse))
    assert r.scale.shape == (64, 4)
    assert torch.equal(_ct_round_trip(r.weight, r.scale), r.weight)
    rtn, _ = _rtn(W, mse)
    err = lambda q: float((((q - W) @ H) * (q - W)).sum())  # noqa: E731
    assert err(r.weight) < 0.9 * err(rtn)


_VLLM_CHECK = """
import sys, torch
from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch
from fp8ptq.ops.mx import fake_quant_mxfp8_act
torch.manual_seed(0)
x = (torch.randn(64, 256) * torch.logspace(-8, 8, 256)).to(torch.bfloat16)
x[3, :32] = 0
q, s = _mxfp8_e4m3_quantize_torch(x)
deq = (q.float().view(64, 8, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)).view(64, 256)
print(torch.equal(deq, fake_quant_mxfp8_act(x.float())))
"""


@pytest.mark.slow  # needs .venv-vllm
def test_dynamic_activations_are_vllms_own_quantizer():
    """vLLM 0.32's reference MXFP8 quantizer (the one its kernels are tested against), in its own venv,
    gives the same values as fp8ptq's simulation, bit for bit."""
    assert vllm_venv_prints(_VLLM_CHECK) == "True"


def test_weight_only_fp8_scales_are_bf16_and_never_saturate():
    from fp8ptq.ops.fp8 import fp8_grid, scale_up_to
    from fp8ptq.ops.granularity import CHANNEL

    torch.manual_seed(6)
    w = torch.randn(256, 64) * torch.logspace(-3, 3, 256).reshape(-1, 1)
    grid = fp8_grid(CHANNEL, scale_dtype=torch.bfloat16)
    s, _ = grid.choose(w)
    assert torch.equal(s, s.to(torch.bfloat16).float())
    assert (w.abs().amax(-1, keepdim=True) / s <= 448).all()  # rounded up: the largest value still fits
    assert torch.equal(scale_up_to(s, None), s)
    fp32, _ = fp8_grid(CHANNEL).choose(w)
    assert ((s - fp32) / fp32).abs().max() < 2**-7 and (s >= fp32).all()
