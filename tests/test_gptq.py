import torch

from fp8ptq.ops.fp8 import choose_fp8_scale, fake_quant_fp8
from fp8ptq.ops.gptq import accumulate_hessian, gptq_quantize
from fp8ptq.ops.granularity import CHANNEL, TENSOR


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
        q = gptq_quantize(W, H, lambda col, _j: fake_quant_fp8(col.unsqueeze(1), s, g)[:, 0])
        # every entry is on the grid ...
        assert torch.equal(fake_quant_fp8(q, s, g), q)
        # ... and the output error is clearly lower than round-to-nearest
        assert _out_err(W, q, X) < 0.8 * _out_err(W, rtn, X)


def test_gptq_act_order_and_dead_columns():
    X = _correlated_inputs(d=32)
    X[:, 5] = 0  # a dead input channel
    W = torch.randn(8, 32)
    H, _ = accumulate_hessian(None, X, 0)
    s = choose_fp8_scale(W, TENSOR)
    q = gptq_quantize(W, H, lambda col, _j: fake_quant_fp8(col.unsqueeze(1), s, TENSOR)[:, 0], act_order=True)
    assert torch.all(q[:, 5] == 0)
    assert torch.isfinite(q).all()


def test_hessian_running_mean_matches_batch():
    X = torch.randn(100, 8)
    H1, n1 = accumulate_hessian(None, X[:30], 0)
    H1, n1 = accumulate_hessian(H1, X[30:], n1)
    H2, _ = accumulate_hessian(None, X, 0)
    assert n1 == 100 and torch.allclose(H1, H2, atol=1e-5)
