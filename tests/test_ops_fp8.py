import pytest
import torch

from fp8ptq.ops.fp8 import FP8_MAX, choose_fp8_scale, dequantize, fake_quant_fp8, quantize_fp8
from fp8ptq.ops.granularity import CHANNEL, TENSOR, TOKEN, reduce_amax


@pytest.mark.parametrize("g", [TENSOR, CHANNEL, TOKEN])
def test_roundtrip_error_is_fp8_relative_precision(g):
    x = torch.randn(64, 128)
    s = choose_fp8_scale(x, g)
    y = fake_quant_fp8(x, s, g)
    # E4M3 has a 3-bit mantissa: relative rounding error <= 2^-4 for normal values.
    big = x.abs() > s.reshape(-1, 1).expand_as(x) * 2**-6 if g != TENSOR else x.abs() > s * 2**-6
    rel = ((y - x).abs() / x.abs())[big]
    assert rel.max() <= 2**-4 + 1e-6
    assert y.dtype == x.dtype


def test_scale_convention_x_equals_q_times_scale():
    x = torch.tensor([[1.0, -2.0, 448.0 * 0.5]])
    s = choose_fp8_scale(x, TENSOR)
    assert torch.allclose(s, torch.tensor([224.0 / 448.0]))
    q = quantize_fp8(x, s, TENSOR)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.allclose(dequantize(q, s, TENSOR), x)


def test_saturates_instead_of_nan():
    x = torch.tensor([[1e6, -1e6, 1.0]])
    q = quantize_fp8(x, torch.tensor([1.0]), TENSOR)
    assert torch.equal(q.float(), torch.tensor([[FP8_MAX, -FP8_MAX, 1.0]]))


def test_zeros_and_empty():
    z = torch.zeros(4, 8)
    s = choose_fp8_scale(z, TENSOR)
    assert torch.isfinite(s).all() and s > 0
    assert torch.equal(fake_quant_fp8(z, s, TENSOR), z)
    assert reduce_amax(torch.zeros(0, 8), TENSOR).shape == (1,)


def test_idempotent():
    x = torch.randn(16, 32)
    s = choose_fp8_scale(x, CHANNEL)
    y = fake_quant_fp8(x, s, CHANNEL)
    assert torch.equal(fake_quant_fp8(y, s, CHANNEL), y)


def test_nan_is_not_hidden():
    x = torch.randn(4, 4)
    x[1, 2] = float("nan")
    assert torch.isnan(reduce_amax(x, TENSOR)).all()


def test_channel_scales_are_per_row():
    x = torch.randn(8, 16) * torch.arange(1, 9).float().unsqueeze(1)
    s = choose_fp8_scale(x, CHANNEL)
    assert s.shape == (8, 1)
    assert torch.allclose(s[:, 0], x.abs().amax(1) / 448)
