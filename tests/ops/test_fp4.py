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
