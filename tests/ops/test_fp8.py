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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_fp8_rows_matches_quantize_fp8(dtype):
    """The streaming packer: chunk boundaries (rows not a multiple of the chunk), an all-zero row and a
    per-tensor scale all give exactly quantize_fp8's codes and choose_fp8_scale's scales."""
    from fp8ptq.ops.fp8 import pack_fp8_rows

    w = (torch.randn(150, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    w[7] = 0
    codes, scale, err, norm = pack_fp8_rows(w, rows=64)
    ref_scale = choose_fp8_scale(w, CHANNEL)
    ref = quantize_fp8(w, ref_scale, CHANNEL)
    assert torch.equal(scale, ref_scale) and torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))
    deq = dequantize(ref, ref_scale, CHANNEL)
    assert err == pytest.approx(float(((deq - w.float()) ** 2).sum()), rel=1e-4)
    assert norm == pytest.approx(float((w.float() ** 2).sum()), rel=1e-5)
    t = choose_fp8_scale(w, TENSOR)
    codes_t, scale_t, _, _ = pack_fp8_rows(w, t, rows=64)
    assert torch.equal(scale_t, t) and torch.equal(
        codes_t.view(torch.uint8), quantize_fp8(w, t, TENSOR).view(torch.uint8)
    )
