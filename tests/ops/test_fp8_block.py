"""Block FP8 (one scale per B x B tile of a weight): min-max scales, the per-row group grid RTN and GPTQ
use, and compressed-tensors' own float-quantized compressor decompressing our weights bit for bit."""

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from fp8ptq.ops.fp8 import FP8_MAX, block_row_scale, choose_fp8_scale, fake_quant_fp8, fp8_block_grid
from fp8ptq.ops.gptq import gptq
from fp8ptq.ops.granularity import block


def _ct_round_trip(w: torch.Tensor, scale: torch.Tensor, b: int) -> torch.Tensor:
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[b, b])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = BaseCompressor.get_value_from_registry("float-quantized")
    packed = comp.compress({"weight": w, "weight_scale": scale}, scheme)
    assert packed["weight"].dtype == torch.float8_e4m3fn and packed["weight"].shape == w.shape
    return comp.decompress(dict(packed), scheme)["weight"]


def _rtn(w: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fake, block scales) through the group grid, as quantization/weights.py runs it."""
    grid = fp8_block_grid(b, b)
    cols = [w[:, k : k + b] for k in range(0, w.shape[1], b)]
    params = [grid.choose(c) for c in cols]
    fake = torch.cat([grid.fake_quant(c, p) for c, p in zip(cols, params)], dim=1)
    return fake, torch.cat([p[0] for p in params], dim=1)[::b]


@pytest.mark.parametrize("shape, b", [((128, 256), 64), ((64, 64), 32), ((96, 32), 32), ((256, 128), 128)])
def test_block_grid_is_compressed_tensors_block_fp8(shape, b):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 2, shape[1])  # columns over 5 decades: scales differ per block
    w[:b, :b] = 0.0  # an all-zero block
    fake, scale = _rtn(w, b)
    assert scale.shape == (shape[0] // b, shape[1] // b)
    assert torch.equal(scale, choose_fp8_scale(w, block(b, b)))
    assert torch.equal(fake, fake_quant_fp8(w, scale, block(b, b)))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(fake[:b, :b], torch.zeros(b, b))
    assert torch.equal(_ct_round_trip(fake, scale, b), fake)


def test_block_scale_is_block_amax_over_448():
    w = torch.zeros(64, 64)
    w[3, 40] = -896.0  # block (0, 1)
    w[40, 3] = 1e-30  # block (1, 0): tiny but finite
    s = choose_fp8_scale(w, block(32, 32))
    assert s[0, 1] == 2.0 and s[1, 0] > 0 and torch.isfinite(s).all()
    assert torch.equal(block_row_scale(w[:, 32:], 32)[:32], torch.full((32, 1), 2.0))
    assert fake_quant_fp8(w, s, block(32, 32))[3, 40] == -FP8_MAX * 2.0


def test_saturation_inf_and_nan_are_visible():
    w = torch.randn(64, 64)
    w[0, 0] = float("nan")
    w[40, 40] = float("inf")
    s = choose_fp8_scale(w, block(32, 32))
    assert torch.isnan(s[0, 0]) and torch.isinf(s[1, 1])  # never a finite scale hiding a broken block
    assert torch.isfinite(s[0, 1]) and torch.isfinite(s[1, 0])


@pytest.mark.parametrize("b", [16, 32])
def test_gptq_on_the_block_grid_exports_bit_exactly_and_helps(b):
    torch.manual_seed(1)
    W = torch.randn(64, 128)
    X = torch.randn(512, 128) * torch.linspace(0.1, 4, 128)
    H = 2 * X.T @ X
    r = gptq(W, H, fp8_block_grid(b, b))
    scale = r.scale[::b]
    assert scale.shape == (64 // b, 128 // b)
    assert torch.equal(_ct_round_trip(r.weight, scale, b), r.weight)
    rtn, _ = _rtn(W, b)
    err = lambda q: float((((q - W) @ H) * (q - W)).sum())  # noqa: E731  output error on the inputs
    assert err(r.weight) < err(rtn)


def test_mse_block_scale_never_worse_than_minmax_and_per_block():
    from fp8ptq.ops.fp8 import mse_block_row_scale
    from fp8ptq.ops.granularity import CHANNEL
    from fp8ptq.ops.intq import DEFAULT_SHRINK_GRID

    torch.manual_seed(0)
    w = torch.randn(64, 32) * torch.rand(64, 1) * 3
    w[5, 7] = 40.0  # one outlier: its block clips, the other block keeps its own scale
    mm, mse = block_row_scale(w, 32), mse_block_row_scale(w, 32, DEFAULT_SHRINK_GRID)
    assert mse.shape == mm.shape == (64, 1)
    assert torch.equal(mse[:32], mse[:1].expand(32, 1)) and torch.equal(mse[32:], mse[32:33].expand(32, 1))

    def err(s):
        return (fake_quant_fp8(w, s, CHANNEL) - w).square().reshape(2, -1).sum(-1)

    assert bool((err(mse) <= err(mm)).all()) and bool((mse <= mm).all())
    z = torch.zeros(64, 32)
    assert bool(torch.isfinite(mse_block_row_scale(z, 32, DEFAULT_SHRINK_GRID)).all())
