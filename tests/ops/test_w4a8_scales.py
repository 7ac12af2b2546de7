"""W4A8-FP8 group scales: on the per-row FP8 grid vLLM 0.32's Hopper W4A8 kernel re-quantizes them to,
exact in bf16, finite for all-zero rows, and exported bit-exactly by compressed-tensors."""

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from fp8ptq.ops.gptq import gptq
from fp8ptq.ops.granularity import group
from fp8ptq.ops.intq import fp8_row_group_scales, int_grid


def _vllm_w4a8_scales(s: torch.Tensor) -> torch.Tensor:
    """What vLLM 0.32 computes from bf16 group scales [out, G]: quant_utils.convert_bf16_scales_to_fp8
    with QuantFP8(per token).forward_native (scale = amax / 448 floored at 1 / (448 * 512), x * 1/scale,
    clamp, cast), then codes / 8 cast again and the row scale * 8 (CutlassW4A8LinearKernel)."""
    x = s.to(torch.bfloat16)
    r = (x.abs().amax(-1, keepdim=True).float() / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    codes = (x.float() * r.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (codes.float() / 8.0).to(torch.float8_e4m3fn).float() * (r * 8.0)


@pytest.mark.parametrize("lo, hi", [(1e-3, 0.05), (1e-6, 1.0), (3e-3, 4e-3), (0.5, 80.0)])
def test_scales_survive_the_engines_fp8_requantization(lo, hi):
    torch.manual_seed(0)
    s = torch.rand(256, 24) * (hi - lo) + lo
    t = fp8_row_group_scales(s)
    assert torch.equal(t.to(torch.bfloat16).float(), t)  # stored losslessly in bf16
    assert torch.equal(_vllm_w4a8_scales(t), t)
    normal = s >= s.amax(-1, keepdim=True) / 3000  # code >= 1/8 of the row's FP8 scale grid
    assert float((t / s - 1)[normal].abs().max()) <= 1 / 16 + 1e-3  # 4-bit r, 3-bit mantissa codes: <= 1/16
    assert (t[~normal] >= s[~normal]).all()  # smaller groups are rounded up to code 1/8, never clipped harder


def test_all_zero_rows_keep_finite_scales():
    s = torch.full((4, 8), torch.finfo(torch.float32).tiny * 2**23)  # the scale floor of an all-zero row
    t = fp8_row_group_scales(s)
    assert torch.isfinite(t).all() and (t > 0).all()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_fp8_group_scales_exports_bit_exactly(act_order):
    torch.manual_seed(2)
    W = torch.randn(64, 256) * torch.logspace(-2, 0, 64).unsqueeze(1)
    X = torch.randn(512, 256)
    refine = lambda p: (fp8_row_group_scales(p[0]), p[1])  # noqa: E731
    grid = int_grid(4, True, group(128), mse=True, scale_dtype=torch.bfloat16, refine=refine)
    r = gptq(W, 2 * X.T @ X, grid, act_order=act_order)
    assert torch.equal(_vllm_w4a8_scales(r.scale), r.scale)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=128, symmetric=True)
    acts = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    comp = BaseCompressor.get_value_from_registry("pack-quantized")
    packed = comp.compress({"weight": r.weight, "weight_scale": r.scale}, scheme)
    assert packed["weight_packed"].dtype == torch.int32
    assert torch.equal(comp.decompress(dict(packed), scheme)["weight"], r.weight)
