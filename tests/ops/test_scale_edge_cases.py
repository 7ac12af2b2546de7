"""The issue-17 formats' weight scales for all-zero and broken groups, per scheme, on the grids the scheme
handlers build (quantization/schemes/): an all-zero group gets a finite, positive scale and decodes to 0;
a group holding inf or NaN gets the finite scale of its finite values (the broken value is ignored,
every other scale is untouched), so one bad value cannot turn a block, a row or a whole tensor's
scales into NaN/inf. Defence in depth only: the loader refuses such weights (last test)."""

import math

import pytest
import torch

from fp8ptq.errors import NonFiniteError
from fp8ptq.models.loader import check_finite
from fp8ptq.ops.fp4 import mxfp4_grid, nvfp4_global_scale, nvfp4_grid
from fp8ptq.ops.fp8 import fp8_block_grid
from fp8ptq.ops.granularity import finite_values, group
from fp8ptq.ops.intq import fp8_row_group_scales, int_grid

OUT, IN = 32, 64

SCHEMES = {  # name -> weight [OUT, IN] -> the grid its scheme handler builds
    "fp8-block": lambda w: fp8_block_grid(16, 16),
    "nvfp4": lambda w: nvfp4_grid(nvfp4_global_scale(w)),
    "nvfp4-mse": lambda w: nvfp4_grid(nvfp4_global_scale(w), mse=True),
    "mxfp4": lambda w: mxfp4_grid(),
    "mxfp4-mse": lambda w: mxfp4_grid(mse=True),
    "w4a8-fp8": lambda w: int_grid(
        4,
        True,
        group(32),
        mse=True,
        scale_dtype=torch.bfloat16,
        refine=lambda p: (fp8_row_group_scales(p[0]), p[1]),
    ),
}


def _rtn(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [OUT, IN / n] fp32, fake [OUT, IN]) as quantization/weights.py runs a group grid (RTN)."""
    grid = SCHEMES[name](w)
    n = grid.group_size
    cols = [w[:, k : k + n] for k in range(0, IN, n)]
    scales = torch.cat([grid.choose(c)[0] for c in cols], dim=1)
    if grid.refine is not None:
        scales = grid.refine((scales, None))[0]
    fake = torch.cat([grid.fake_quant(c, (scales[:, i : i + 1], None)) for i, c in enumerate(cols)], dim=1)
    return scales, fake


def _weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(OUT, IN) * torch.logspace(-2, 1, IN)


@pytest.mark.parametrize("name", SCHEMES)
def test_all_zero_group_and_tensor_get_finite_positive_scales(name):
    w = _weight()
    w[0, :32] = 0.0  # covers the first group of row 0 for every scheme (16, 32; a 16 x 16 block's row)
    w[:16, :16] = 0.0  # a whole 16 x 16 block (fp8-block)
    scales, fake = _rtn(name, w)
    assert torch.isfinite(scales).all() and (scales > 0).all(), scales
    assert torch.equal(fake[0, :32], torch.zeros(32)) and torch.equal(fake[:16, :16], torch.zeros(16, 16))
    assert torch.isfinite(fake).all()
    scales, fake = _rtn(name, torch.zeros(OUT, IN))
    assert torch.isfinite(scales).all() and (scales > 0).all(), scales
    assert torch.equal(fake, torch.zeros(OUT, IN))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("name", SCHEMES)
def test_a_broken_value_gets_the_scale_of_its_groups_finite_values(name, bad):
    w = _weight()
    clean = w.clone()
    clean[3, 5] = 0.0
    w[3, 5] = bad
    scales, fake = _rtn(name, w)
    want_scales, want_fake = _rtn(name, clean)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert torch.equal(scales, want_scales)  # the broken value is ignored, no other scale moves
    others = torch.ones(OUT, IN, dtype=torch.bool)
    others[3, 5] = False
    assert torch.equal(fake[others], want_fake[others])
    if math.isnan(bad):  # NaN stays visible in the simulated weight
        assert torch.isnan(fake[3, 5])
    else:  # inf saturates to the group's largest code
        assert torch.isfinite(fake[3, 5]) and fake[3, 5].sign() == torch.sign(torch.tensor(bad))


def test_nvfp4_global_scale_ignores_a_stray_inf():
    w = _weight()
    w[0, 0] = 0.0
    want = nvfp4_global_scale(w)
    w[0, 0] = float("inf")  # before: 2688 / inf = 0, a divisor that breaks every group of the tensor
    assert torch.equal(nvfp4_global_scale(w), want) and want.item() > 0
    assert nvfp4_global_scale(torch.full((4, 16), float("nan"))).item() == 1.0


def test_finite_values_is_free_and_identical_for_finite_weights():
    w = _weight()
    assert finite_values(w) is w  # no copy: every existing output stays byte-identical
    assert finite_values(torch.zeros(0, 4)).numel() == 0


def test_the_loader_still_refuses_non_finite_weights():
    with pytest.raises(NonFiniteError, match="non-finite"):
        check_finite("model.layers.0.mlp.down_proj.weight", torch.tensor([[1.0, float("nan")]]))
