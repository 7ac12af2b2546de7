import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from fp8ptq.ops.fp8 import choose_fp8_scale, fake_quant_fp8, fp8_grid
from fp8ptq.ops.gptq import GPTQResult, gptq
from fp8ptq.ops.granularity import CHANNEL, TENSOR, group
from fp8ptq.ops.hessian import accumulate_hessian, hessian_partial
from fp8ptq.ops.intq import choose_int_qparams, fake_quant_int, int_grid, quantize_int


def _correlated_inputs(n=2048, d=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) / d**0.5 + torch.eye(d)
    return torch.randn(n, d, generator=g) @ mix


def _out_err(W, Q, X):
    return float(((X @ (W - Q).T) ** 2).mean())


def test_gptq_beats_rtn_on_the_fp8_grid():
    X = _correlated_inputs()
    W = torch.randn(48, 96)
    H, n = accumulate_hessian(None, X, 0)
    assert n == X.shape[0]
    for g in (TENSOR, CHANNEL):
        s = choose_fp8_scale(W, g).reshape(-1, 1)
        rtn = fake_quant_fp8(W, s, g)
        q = gptq(W, H, fp8_grid(g, scale=s)).weight
        # every entry is on the grid ...
        assert torch.equal(fake_quant_fp8(q, s, g), q)
        # ... and the output error is clearly lower than round-to-nearest
        assert _out_err(W, q, X) < 0.8 * _out_err(W, rtn, X)


def test_gptq_act_order_and_dead_columns():
    X = _correlated_inputs(d=32)
    X[:, 5] = 0  # a dead input channel
    W = torch.randn(8, 32)
    H, _ = accumulate_hessian(None, X, 0)
    q = gptq(W, H, fp8_grid(TENSOR), act_order=True).weight
    assert torch.all(q[:, 5] == 0)
    assert torch.isfinite(q).all()


def test_hessian_running_mean_matches_batch():
    X = torch.randn(100, 8)
    H1, n1 = accumulate_hessian(None, X[:30], 0)
    H1, n1 = accumulate_hessian(H1, X[30:], n1)
    H2, _ = accumulate_hessian(None, X, 0)
    assert n1 == 100 and torch.allclose(H1, H2, atol=1e-5)


# --- the generalised solver ----------------------------------------------------------------------


def _old_gptq_quantize(W, H, fake_quant_col, block_size=128, damp=0.01, act_order=False):
    """The implementation before the integer-grid rewrite, verbatim (minus the thread guard), as the
    reference the solver must reproduce bit for bit (inputs without dead columns)."""
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    n = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    order = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(n, device=W.device)
    W = W[:, order]
    H = H[order][:, order]
    Q = torch.zeros_like(W)
    eye = torch.eye(H.shape[0])
    mean_diag = torch.diag(H).mean().clamp_min(1e-12)
    L = torch.linalg.cholesky(H + damp * mean_diag * eye)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            q = fake_quant_col(w, int(order[i1 + i]))
            Q[:, i1 + i] = q
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q[:, torch.argsort(order)]


def _setup(out=48, d=128, seed=0):
    X = _correlated_inputs(d=d, seed=seed)
    W = torch.randn(out, d, generator=torch.Generator().manual_seed(seed + 1))
    H, _ = accumulate_hessian(None, X, 0)
    return W, H, X


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("g", [TENSOR, CHANNEL])
def test_solver_reproduces_the_original_implementation(g, act_order):
    W, H, _ = _setup(out=40, d=160)  # 160 columns: two blocks, the second partial
    s = choose_fp8_scale(W, g).reshape(-1, 1)
    col = lambda c, _j: fake_quant_fp8(c.unsqueeze(1), s, g)[:, 0]  # noqa: E731
    old = _old_gptq_quantize(W, H, col, act_order=act_order)
    # the grid API on the same FP8 grid gives the original bits, plus the scale it used
    r = gptq(W, H, fp8_grid(g), act_order=act_order)
    assert torch.equal(r.weight, old) and torch.equal(r.scale.reshape(-1, 1), s) and r.zero_point is None
    shared = gptq(W, H, fp8_grid(g, scale=s), act_order=act_order)  # a fixed (e.g. fused-group) scale
    assert torch.equal(shared.weight, old)


def test_act_order_is_the_natural_solve_of_the_permuted_problem_retries_included():
    # act-order damps and factors H permuted in place (no copy of a permuted copy): the same bits as solving
    # the permuted problem in natural order, also when the first damping fails and a retry re-permutes H
    W, H, _ = _setup(out=24, d=96)
    mean = H.diagonal().mean()
    lam = torch.linalg.eigvalsh(H.double()).min().float()
    Hbad = H - (lam + 0.03 * mean) * torch.eye(96)  # indefinite: 1% damping fails, 10% holds
    order = torch.argsort(torch.diag(Hbad), descending=True, stable=True)
    back = torch.argsort(order)
    for h in (H, Hbad):
        a = gptq(W, h, fp8_grid(TENSOR), act_order=True)
        b = gptq(W[:, order], h[order[:, None], order], fp8_grid(TENSOR))
        assert torch.equal(a.weight, b.weight[:, back]) and a.damp == b.damp
    assert gptq(W, Hbad, fp8_grid(TENSOR), act_order=True).damp == pytest.approx(0.1)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("grid", ["fp8 tensor", "int4 g32", "int8 channel"])
def test_output_error_from_the_solve_equals_the_product(grid, act_order):
    # GPTQResult.out_err (from the solve's scaled errors) is tr(d H d^T) per row, d = W - weight, without
    # the [out, in] x [in, in] product; a dead input (zero H row) adds nothing to either
    W, H, _ = _setup(out=32, d=128)
    H[:, 5] = 0.0
    H[5, :] = 0.0
    g = {
        "fp8 tensor": fp8_grid(TENSOR),
        "int4 g32": int_grid(4, False, group(32)),
        "int8 channel": int_grid(8, True, CHANNEL),
    }
    r = gptq(W, H, g[grid], act_order=act_order)
    d = (r.weight - W).double()
    product = ((d @ H.double()) * d).sum(1)
    assert r.out_err.dtype == torch.float64 and r.out_err.shape == (32,)
    assert torch.allclose(r.out_err, product, rtol=1e-4, atol=0)


INT_GRIDS = [  # (bits, symmetric, granularity)
    (4, True, group(64)),
    (4, False, group(64)),
    (8, True, CHANNEL),
    (8, False, CHANNEL),
    (8, True, TENSOR),
]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits,symmetric,g", INT_GRIDS)
def test_gptq_beats_rtn_and_stays_on_its_grid(bits, symmetric, g, act_order):
    W, H, X = _setup()
    s0, z0 = choose_int_qparams(W, g, bits, symmetric)
    rtn = fake_quant_int(W, s0, z0, g, bits)
    r = gptq(W, H, int_grid(bits, symmetric, g), act_order=act_order)
    assert isinstance(r, GPTQResult) and r.weight.shape == W.shape and r.weight.dtype == torch.float32
    assert r.scale.shape == s0.shape and (r.zero_point is None) == symmetric
    assert r.zero_point is None or (r.zero_point.dtype == torch.int8 and r.zero_point.shape == s0.shape)
    assert _out_err(W, r.weight, X) < 0.8 * _out_err(W, rtn, X)
    # every column lies exactly on its own group's grid, with the params returned
    assert torch.equal(fake_quant_int(r.weight, r.scale, r.zero_point, g, bits), r.weight)
    if g.kind == "group" and act_order:
        # static groups: params of the ORIGINAL W in original column order (no g_idx needed)
        assert torch.equal(r.scale, s0) and (symmetric or torch.equal(r.zero_point, z0))
    if g.kind == "group" and not act_order:
        # lazy groups: the first group sees W untouched, later ones the error-updated weights
        assert torch.equal(r.scale[:, 0], s0[:, 0]) and not torch.equal(r.scale[:, 1], s0[:, 1])
    if g.kind != "group":
        assert torch.equal(r.scale, s0)  # static per-tensor / per-channel params from W


def test_static_groups_without_act_order_and_mse_grid():
    W, H, X = _setup()
    g = group(32)
    s0, _ = choose_int_qparams(W, g, 4, True)
    r = gptq(W, H, int_grid(4, True, g), static_groups=True)
    fixed = gptq(W, H, int_grid(8, True, CHANNEL, params=choose_int_qparams(W, CHANNEL, 8, True)))
    assert torch.equal(fixed.weight, gptq(W, H, int_grid(8, True, CHANNEL)).weight)
    assert torch.equal(r.scale, s0) and torch.equal(fake_quant_int(r.weight, r.scale, None, g, 4), r.weight)
    m = gptq(W, H, int_grid(4, True, g, mse=True))
    assert torch.equal(fake_quant_int(m.weight, m.scale, None, g, 4), m.weight)
    assert _out_err(W, m.weight, X) < _out_err(W, fake_quant_int(W, s0, None, g, 4), X)


def test_group_not_aligned_with_blocks():
    """group 96 with block 128: lazy groups round the block down to 96 so params see updated weights."""
    W, H, X = _setup(d=192)
    g = group(96)
    r = gptq(W, H, int_grid(4, False, g), block_size=128)
    assert r.scale.shape == (48, 2)
    assert torch.equal(fake_quant_int(r.weight, r.scale, r.zero_point, g, 4), r.weight)
    with pytest.raises(ValueError, match="does not divide"):
        gptq(W, H, int_grid(4, False, group(64 + 16)))  # 80 does not divide 192


def test_hessian_scale_invariance_and_partial_sums():
    W, H, X = _setup()
    grid = int_grid(4, False, group(32))
    ref = gptq(W, H, grid)
    # scaling H by a power of 4 is exact in floating point: bit-identical result
    for c in (4.0, 1 / 16, 4.0**8):
        r = gptq(W, H * c, grid)
        assert torch.equal(r.weight, ref.weight) and torch.equal(r.scale, ref.scale)
    # an unnormalised sum of per-chunk partials 2 X^T X, added in a fixed order
    parts = [hessian_partial(X[i : i + 300]) for i in range(0, X.shape[0], 300)]
    Hsum = torch.zeros_like(H)
    for p in parts:
        Hsum += p
    Hacc, n = accumulate_hessian(None, X[:1000], 0, mean=False)
    Hacc, n = accumulate_hessian(Hacc, X[1000:], n, mean=False)
    assert n == X.shape[0] and torch.allclose(Hsum, Hacc, rtol=1e-5, atol=1e-2)
    assert torch.allclose(Hsum / n, H, rtol=1e-4, atol=1e-4)
    rs = gptq(W, Hsum, grid)
    # not bit-identical (the scale is not a power of 4, and GPTQ amplifies last-bit differences into
    # different roundings), but the same quality
    assert abs(_out_err(W, rs.weight, X) / _out_err(W, ref.weight, X) - 1) < 0.02
    assert torch.equal(fake_quant_int(rs.weight, rs.scale, rs.zero_point, group(32), 4), rs.weight)


def test_dead_columns_are_zero_and_reported():
    X = _correlated_inputs(d=64)
    X[:, [5, 40]] = 0
    W = torch.randn(16, 64)
    H, _ = accumulate_hessian(None, X, 0)
    for grid, kw in [
        (int_grid(4, False, group(32)), {}),
        (int_grid(4, True, group(32)), {"act_order": True}),
        (int_grid(8, True, CHANNEL), {}),
    ]:
        r = gptq(W, H, grid, **kw)
        assert r.dead_columns == 2 and r.damp == 0.01
        assert torch.all(r.weight[:, [5, 40]] == 0) and torch.isfinite(r.weight).all()
    # dead inputs are excluded from the range: params equal those of W with the dead columns zeroed
    Wz = W.clone()
    Wz[:, [5, 40]] = 0
    r = gptq(W, H, int_grid(4, True, group(32)), act_order=True)
    assert torch.equal(r.scale, choose_int_qparams(Wz, group(32), 4, True)[0])
    # H scale invariance holds with dead columns too (their diagonal is filled with the live mean)
    grid = int_grid(4, False, group(32))
    assert torch.equal(gptq(W, H * 16, grid).weight, gptq(W, H, grid).weight)


def test_fused_rows_can_be_solved_together():
    """Rows are independent in GPTQ: q/k/v (or gate/up) sharing one H can be stacked into one solve."""
    W, H, _ = _setup()
    W2 = torch.randn(24, W.shape[1])
    grid = int_grid(4, False, group(32))
    a, b = gptq(W, H, grid), gptq(W2, H, grid)
    ab = gptq(torch.cat([W, W2]), H, grid)
    assert torch.equal(ab.weight, torch.cat([a.weight, b.weight]))
    assert torch.equal(ab.scale, torch.cat([a.scale, b.scale]))


@pytest.mark.parametrize(
    "bits,symmetric,g,fmt",
    [
        (4, True, group(64), "pack-quantized"),
        (4, False, group(64), "pack-quantized"),
        (8, True, CHANNEL, "int-quantized"),
    ],
)
def test_gptq_result_exports_bit_exactly(bits, symmetric, g, fmt):
    """compress(GPTQ weight, returned params) -> decompress gives back the GPTQ weight exactly: the
    checkpoint is what was simulated."""
    W, H, _ = _setup()
    r = gptq(W, H, int_grid(bits, symmetric, g), act_order=True)
    args = QuantizationArgs(num_bits=bits, type="int", strategy=g.kind, group_size=g.group_size, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": r.weight, "weight_scale": r.scale}
    if r.zero_point is not None:
        state["weight_zero_point"] = r.zero_point
    comp = BaseCompressor.get_value_from_registry(fmt)
    packed = comp.compress(state, scheme)
    assert torch.equal(comp.decompress(dict(packed), scheme)["weight"], r.weight)
    codes = quantize_int(r.weight, r.scale, r.zero_point, g, bits)
    if fmt == "int-quantized":
        assert torch.equal(packed["weight"], codes)


@pytest.mark.parametrize("kind", ["nvfp4", "int4", "mxfp4"])
def test_hessian_weighted_group_scales(kind):
    """weight_observer hessian_mse: each group's clip is searched on the error weighted by diag(H), so
    that weighted error is never above plain mse's choice; GPTQ with act-order uses those static scales."""
    from fp8ptq.ops.fp4 import fake_quant_nvfp4, mxfp4_grid, nvfp4_global_scale, nvfp4_grid

    torch.manual_seed(0)
    W = torch.randn(32, 64) * torch.rand(1, 64) * 2
    X = torch.randn(512, 64) * torch.linspace(0.1, 5.0, 64)
    H = 2 * X.T @ X
    if kind == "nvfp4":
        grid = nvfp4_grid(nvfp4_global_scale(W), mse=True, hessian=True)
        plain = nvfp4_grid(nvfp4_global_scale(W), mse=True)
        n = 16
    elif kind == "mxfp4":
        grid, plain, n = mxfp4_grid(mse=True, hessian=True), mxfp4_grid(mse=True), 32
    else:
        grid = int_grid(4, True, group(32), mse=True, hessian=True)
        plain = int_grid(4, True, group(32), mse=True)
        n = 32
    rows = W.reshape(-1, n)
    d = H.diagonal().reshape(1, -1).expand(32, -1).reshape(-1, n)
    pw, pp = grid.choose_weighted(rows, d), plain.choose(rows)
    assert plain.choose_weighted is None and not torch.equal(pw[0], pp[0])

    def werr(p):
        return ((grid.fake_quant(rows, p) - rows).square() * d).sum()

    assert werr(pw) < werr(pp)
    r = gptq(W, H, grid, act_order=True)
    assert torch.equal(r.scale, pw[0].reshape(32, -1))  # static: the weighted choice on the original W
    if kind == "nvfp4":
        assert torch.equal(r.weight[:, :16], fake_quant_nvfp4(r.weight[:, :16], r.scale[:, :1]))


def test_hessian_blocks_equal_the_full_product():
    # wide inputs take the symmetric block path: every entry one dot product over the rows, mirrored
    g = torch.Generator().manual_seed(3)
    for width in (64, 513, 576, 1536):
        X = torch.randn(700, width, generator=g)
        H = hessian_partial(X)
        full = 2.0 * (X.T @ X)
        assert H.shape == (width, width) and torch.equal(H, H.T)
        assert torch.allclose(H, full, rtol=1e-5, atol=1e-3), (width, float((H - full).abs().max()))
        Hacc, _ = accumulate_hessian(None, X, 0, mean=False)
        assert torch.equal(Hacc, H)
