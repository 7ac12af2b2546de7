"""NVFP4 (ops/fp4.py) against compressed-tensors' own pieces: its E2M1 rounding, its global / group
scale conventions, and its nvfp4-pack-quantized compressor decompressing our fake-quant bit for bit."""

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from fp8ptq.ops.fp4 import cast_e2m1, fake_quant_nvfp4, nvfp4_global_scale, nvfp4_grid, nvfp4_group_scale
from fp8ptq.ops.gptq import gptq

ARGS = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)


def _rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fake, FP8 group scales as fp32 [out, in/16], global scale [1]), as quantization/weights.py runs it."""
    gs = nvfp4_global_scale(w)
    grid = nvfp4_grid(gs)
    groups = w.reshape(-1, 16)
    eff, _ = grid.choose(groups)
    fake = grid.fake_quant(groups, (eff, None)).reshape(w.shape)
    return fake, (eff * gs).to(torch.float8_e4m3fn).float().reshape(w.shape[0], -1), gs


def _ct_round_trip(fake, scale, gs):
    scheme = QuantizationScheme(targets=["Linear"], weights=ARGS)
    comp = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    packed = comp.compress({"weight": fake, "weight_scale": scale, "weight_global_scale": gs}, scheme)
    assert packed["weight_packed"].dtype == torch.uint8 and packed["weight_packed"].shape == (
        fake.shape[0],
        fake.shape[1] // 2,
    )
    assert packed["weight_scale"].dtype == torch.float8_e4m3fn
    return comp.decompress(dict(packed), scheme)["weight"].float()


def test_e2m1_rounding_is_compressed_tensors():
    x = torch.cat([torch.linspace(-7, 7, 4001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])])
    x = x.clamp(-6, 6)
    assert torch.equal(cast_e2m1(x), FP4_E2M1_DATA.cast_to_fp4(x.clone()))


def test_e2m1_rounding_around_every_boundary_and_in_bf16():
    """The step rounding equals compressed-tensors' on a dense sweep and one fp32 ulp on either side of
    every midpoint (ties to even), both signs, and for bf16 inputs; every 97th fp32 bit pattern in
    [0, 6] (denormals included) against the E2M1 table lookup it replaced, signs of zero and NaN too."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 6.0])
    mids = torch.cat([mids, -mids])
    x = torch.cat([torch.linspace(-6, 6, 200_001), mids])
    x = torch.cat([x, torch.nextafter(x, torch.full_like(x, 9)), torch.nextafter(x, torch.full_like(x, -9))]).clamp(
        -6, 6
    )
    assert torch.equal(cast_e2m1(x), FP4_E2M1_DATA.cast_to_fp4(x.clone()))
    xb = x.bfloat16()
    assert cast_e2m1(xb).dtype == torch.bfloat16
    assert torch.equal(cast_e2m1(xb), FP4_E2M1_DATA.cast_to_fp4(xb.float()).bfloat16())
    v = torch.arange(0, 0x40C00001, 97, dtype=torch.int64).to(torch.int32).view(torch.float32)
    v = torch.cat([v, -v, torch.tensor([-0.0, float("nan")])])
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    bounds = torch.where(torch.arange(7) % 2 == 1, torch.nextafter(bounds, torch.zeros(7)), bounds)  # ties to even
    table = values[torch.bucketize(v.abs(), bounds)] * torch.sign(v)
    out = cast_e2m1(v)
    assert torch.equal(out, table) and torch.equal(out.signbit(), table.signbit())


def test_scales_follow_compressed_tensors():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 3
    gs = nvfp4_global_scale(w)
    assert torch.equal(gs, generate_gparam(w.amin().reshape(1), w.amax().reshape(1)))
    lo, hi = w.reshape(32, 4, 16).amin(-1), w.reshape(32, 4, 16).amax(-1)
    args = QuantizationArgs(**{**ARGS.model_dump(), "scale_dtype": torch.float8_e4m3fn})
    ct_scale, _ = calculate_qparams(lo, hi, args, global_scale=gs)
    assert torch.equal(nvfp4_group_scale(w.abs().reshape(32, 4, 16).amax(-1), gs), ct_scale.float())


@pytest.mark.parametrize("shape", [(64, 128), (48, 32), (8, 16)])
def test_compressor_decompresses_our_weights_exactly(shape):
    torch.manual_seed(1)
    w = torch.randn(shape) * torch.logspace(-4, 1, shape[1])  # groups of very different size
    w[0, :16] = 0.0  # an all-zero group: scale 0.125, decodes to 0
    w[1, 16 % shape[1] :][:16] = 1e6  # saturating group
    fake, scale, gs = _rtn(w)
    assert torch.isfinite(scale).all() and (scale > 0).all() and torch.isfinite(gs).all()
    assert torch.equal(fake[0, :16], torch.zeros(16))
    assert torch.equal(_ct_round_trip(fake, scale, gs), fake)


def test_all_zero_tensor_has_finite_scales_and_nan_is_visible():
    fake, scale, gs = _rtn(torch.zeros(4, 32))
    assert gs.item() == 1.0 and (scale == 0.125).all() and torch.equal(fake, torch.zeros(4, 32))
    w = torch.randn(4, 32)
    w[2, 3] = float("nan")
    clean = torch.where(torch.isnan(w), 0.0, w)  # the global scale is that of the finite values (see
    assert torch.equal(nvfp4_global_scale(w), nvfp4_global_scale(clean))  # test_scale_edge_cases.py)
    eff = nvfp4_group_scale(clean.abs().reshape(-1, 16).amax(-1, keepdim=True), torch.ones(1))
    assert torch.isnan(fake_quant_nvfp4(w.reshape(-1, 16), eff)).any()  # the broken group stays visible


def test_gptq_on_the_fp4_grid_exports_exactly_and_helps():
    torch.manual_seed(3)
    W = torch.randn(64, 128)
    X = torch.randn(1024, 128) @ (torch.eye(128) + 0.3 * torch.randn(128, 128))  # correlated inputs
    H = 2 * X.T @ X
    gs = nvfp4_global_scale(W)
    r = gptq(W, H, nvfp4_grid(gs))
    scale = (r.scale * gs).to(torch.float8_e4m3fn).float()
    assert torch.equal(_ct_round_trip(r.weight, scale, gs), r.weight)
    rtn, _, _ = _rtn(W)
    err = lambda q: float((((q - W) @ H) * (q - W)).sum())  # noqa: E731
    assert err(r.weight) < 0.9 * err(rtn)


def test_w4a4_activation_grid():
    from fp8ptq.ops.grid import NVFP4_ACT_GRID

    torch.manual_seed(4)
    x = torch.randn(3, 5, 64) * 7
    s = NVFP4_ACT_GRID.scale(x.abs().amax())
    assert torch.equal(1.0 / (1.0 / s), s) and torch.frexp(s)[0].item() == 0.5  # power of two
    assert s * 448 * 6 >= x.abs().amax() > s * 448 * 3  # at most one binade of headroom lost
    y = NVFP4_ACT_GRID.fake_quant(x, s)
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = ((y - x).norm() / x.norm()).item()
    assert 0.02 < rel < 0.15  # 4-bit float groups of 16
    assert torch.equal(NVFP4_ACT_GRID.fake_quant(torch.zeros(2, 32), s), torch.zeros(2, 32))
    x[0, 0, 3] = float("nan")
    assert torch.isnan(NVFP4_ACT_GRID.fake_quant(x, s)).any()


def test_mse_group_scales_export_exactly_and_never_lose():
    torch.manual_seed(5)
    W = torch.randn(64, 128) * torch.rand(64, 1) * 4
    W[0, :16] = 0.0
    gs = nvfp4_global_scale(W)
    groups = W.reshape(-1, 16)
    errs = {}
    for mse in (False, True):
        grid = nvfp4_grid(gs, mse=mse)
        eff, _ = grid.choose(groups)
        fake = grid.fake_quant(groups, (eff, None)).reshape(W.shape)
        scale = (eff * gs).to(torch.float8_e4m3fn).float().reshape(64, -1)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert torch.equal(_ct_round_trip(fake, scale, gs), fake)
        errs[mse] = (fake - W).reshape(-1, 16).square().sum(-1)
    assert (errs[True] <= errs[False]).all() and errs[True].sum() < 0.95 * errs[False].sum()


def test_scale_search_scores_each_distinct_scale_once_and_chooses_as_the_full_search():
    """nvfp4_search_scale scores each distinct (group, FP8 scale) pair once (best_row_scale); its choice is
    the full search's (best_scale over all 58 factors, first of equal minima), bit for bit, weighted or not,
    including all-zero groups (every candidate ties) and a chunk smaller than the pair count."""
    from fp8ptq.ops.fp4 import NVFP4_SCALE_SEARCH, nvfp4_search_scale
    from fp8ptq.ops.fp8 import best_row_scale, best_scale

    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.rand(1, 256) * 3
    w[5] = 0.0
    gs = nvfp4_global_scale(w)
    groups = w.reshape(-1, 16)
    d = (torch.rand(256) * 5).reshape(1, -1).expand(64, -1).reshape(-1, 16)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    for weight in (None, d):

        def err_of(eff, weight=weight):
            e = (fake_quant_nvfp4(groups, eff) - groups).square()
            return (e if weight is None else e * weight).sum(-1, keepdim=True)

        full = best_scale(lambda f: nvfp4_group_scale(amax * f, gs) / gs, NVFP4_SCALE_SEARCH, err_of)
        assert torch.equal(nvfp4_search_scale(groups, gs, NVFP4_SCALE_SEARCH, weight), full)
    # fewer evaluations: ~15 distinct FP8 scales among the 58 candidates of a group
    calls = []
    cands = torch.tensor([[2.0, 1.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    err = {1.0: 5.0, 2.0: 5.0, 3.0: 4.0}
    pick = best_row_scale(
        cands, lambda r, s: calls.append(len(r)) or torch.tensor([err[float(v)] for v in s[:, 0]]), chunk=2
    )
    assert pick.flatten().tolist() == [3.0, 1.0] and sum(calls) == 4 and max(calls) <= 2
    # a tie between distinct scales keeps the earlier one, as best_scale does
    err[3.0] = 9.0
    assert best_row_scale(cands, lambda r, s: torch.tensor([err[float(v)] for v in s[:, 0]])).flatten().tolist() == [
        2.0,
        1.0,
    ]
