"""Tier 1: outlier statistics, FlattenQuant split math, SmoothQuant folding, exact distributed sums."""

import pytest
import torch

from fp8ptq.dist import ChunkPlan, LocalComm, TreeSum
from fp8ptq.outliers.flatten import apply_flatten, flattened_amax, flattened_width, plan_flatten
from fp8ptq.outliers.smooth import awq_stats, choose_alpha, fold, smooth_scales
from fp8ptq.outliers.stats import ActStats, StatsSpec, massive_activations


def _mlp(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


@pytest.mark.parametrize("seed", [0, 1])
def test_flatten_is_exact_with_multi_way_splits(seed):
    g = torch.Generator().manual_seed(seed)
    h, inter = 32, 48
    gate, up, down = (
        torch.randn(inter, h, generator=g, dtype=torch.float64),
        torch.randn(inter, h, generator=g, dtype=torch.float64),
        torch.randn(h, inter, generator=g, dtype=torch.float64),
    )
    amax = torch.rand(inter, generator=g)
    amax[5] = 100.0  # one huge channel must be split many ways
    plan = plan_flatten(amax, flattened_width(inter, 20, multiple=8))
    assert plan.width == 72 and int(plan.pieces[5]) > 2
    x = torch.randn(16, h, generator=g, dtype=torch.float64)
    g2, u2, d2 = apply_flatten(gate, up, down, plan)
    assert g2.shape == (72, h) and d2.shape == (h, 72)
    torch.testing.assert_close(_mlp(x, g2, u2, d2), _mlp(x, gate, up, down), rtol=1e-12, atol=1e-12)
    # each piece of a k-way split carries a_c / k: the intermediate's max shrinks exactly as planned
    a = torch.nn.functional.silu(x @ g2.T) * (x @ u2.T)
    a_old = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    for c in (5,):
        cols = (plan.src == c).nonzero().flatten()
        torch.testing.assert_close(a[:, cols].sum(1), a_old[:, c])
        torch.testing.assert_close(a[:, cols[0]], a_old[:, c] / len(cols))


def test_flatten_plan_minimises_the_max_and_pads():
    amax = torch.tensor([8.0, 3.0, 1.0, 1.0])
    plan = plan_flatten(amax, 8)  # 4 extra pieces: 8 -> 4 ways (2.0), 3 -> 2 ways (1.5)
    assert plan.pieces.tolist() == [4, 2, 1, 1] and flattened_amax(amax, plan) == 2.0
    capped = plan_flatten(torch.tensor([8.0, 1.0]), 8, max_pieces=3)  # cannot spend 6 extra: zero padding
    assert capped.pieces.tolist() == [3, 3] and (capped.mult == 0).sum() == 2
    gate = torch.randn(2, 4)
    g2, u2, d2 = apply_flatten(gate, torch.randn(2, 4), torch.randn(4, 2), capped)
    assert (g2[-2:] == 0).all() and (u2[-2:] == 0).all() and (d2[:, -2:] == 0).all()
    assert flattened_width(1536, 128, 128, 1) == 1664 and flattened_width(1536, 1, 128, 2) == 1792


def test_smooth_fold_is_exact_and_alpha_search_can_decline():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    x[:, 3] *= 30  # an outlier channel
    norm = torch.rand(16, generator=g) + 0.5
    ws = [torch.randn(24, 16, generator=g), torch.randn(8, 16, generator=g)]
    s = smooth_scales(x.abs().amax(0), torch.stack([w.abs().amax(0) for w in ws]).amax(0), 0.5)
    new_norm, new_ws, s_eff = fold(norm, ws, s, torch.float32)
    for w, w2 in zip(ws, new_ws):  # (x * norm / s_eff) @ (W * s_eff)^T == (x * norm) @ W^T
        torch.testing.assert_close((x * new_norm) @ w2.T, (x * norm) @ w.T, rtol=1e-5, atol=1e-4)
    # bf16-stored norm: s_eff absorbs the rounding, so the pair stays exact
    nb, wb, _ = fold(norm, ws, s, torch.bfloat16)
    assert torch.equal(nb, nb.to(torch.bfloat16).float())
    torch.testing.assert_close((x * nb) @ wb[0].T, (x * norm) @ ws[0].T, rtol=1e-5, atol=1e-4)

    def int8(t, amax):
        sc = amax / 127
        return (t / sc).round().clamp(-128, 127) * sc

    best, errors = choose_alpha(x * norm, (x * norm).abs().amax(0), ws, (0.5, 0.8), int8, lambda w: w)
    assert best is not None and errors[f"{best:g}"] < errors["none"]
    # without outliers and with exact weights smoothing cannot beat "none" by much: it may decline
    y = torch.randn(64, 16, generator=g)
    best2, errors2 = choose_alpha(y, y.abs().amax(0), ws, (0.5,), int8, lambda w: w)
    assert (best2 is None) == (errors2["none"] <= errors2["0.5"])


def test_awq_scales_protect_salient_input_channels_of_weight_only_int4():
    """AWQ (smooth.method awq): with inputs left unquantized, scaling the channels that carry large mean
    |x| up before 4-bit group rounding (and x down, folded) lowers the layer's output error; the search
    takes the best alpha, and its stats are mean |x| and the row-relative mean |W| per input channel."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)
    x[:, :4] *= 20  # salient channels
    ws = [torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)]
    x_mean, w_mean = awq_stats(x, ws)
    torch.testing.assert_close(x_mean, x.abs().mean(0))
    w = torch.cat(ws)
    torch.testing.assert_close(w_mean, (w.abs() / w.abs().amax(1, keepdim=True)).mean(0))

    def int4_g16(w):
        q = w.reshape(w.shape[0], -1, 16)
        sc = q.abs().amax(-1, keepdim=True) / 7
        return ((q / sc).round().clamp(-8, 7) * sc).reshape(w.shape)

    best, errors = choose_alpha(x, x_mean, ws, (0.25, 0.5, 0.75), lambda t, _a: t, int4_g16, w_stat=w_mean)
    assert best is not None and errors[f"{best:g}"] < 0.9 * errors["none"]
    # unquantized inputs (act_quant None): the same errors from the Gram matrix, the same choice
    best_g, errors_g = choose_alpha(x, x_mean, ws, (0.25, 0.5, 0.75), None, int4_g16, w_stat=w_mean)
    assert best_g == best and errors_g.keys() == errors.keys()
    for name, err in errors.items():
        assert abs(errors_g[name] - err) <= 1e-4 * err, name


def test_actstats_chunks_equal_one_pass_and_summary():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, 16, generator=g)
    x[:, :, 7] *= 20
    spec = StatsSpec(rows=64, moments=True, sample_top=2)
    whole = ActStats(spec, 16, 8 * 32, 32)
    whole.update(0, 0, x)
    whole.reduce(LocalComm())
    parts = ActStats(spec, 16, 8 * 32, 32)
    for c in range(4):
        parts.update(c, 2 * c, x[2 * c : 2 * c + 2])
    parts.reduce(LocalComm())
    assert torch.equal(whole.channel_amax, parts.channel_amax)
    assert torch.equal(whole.rows, parts.rows) and whole.rows.shape[0] == 64
    torch.testing.assert_close(whole.moments, parts.moments)
    s = parts.summary()
    assert s["top_channels"][0]["channel"] == 7 and s["outlier_channels"] >= 1
    assert s["top_channel_stability"]["7"] == 1.0 and s["max_over_p99"] >= 1.0 and s["kurtosis"] > 3
    h = torch.randn(2, 8, 16, generator=g)
    h[1, 0, 4] = 5000.0
    m = massive_activations(h, first_sample=10)
    assert m and m[0]["sample"] == 11 and m[0]["position"] == 0 and m[0]["channel"] == 4


class _FakeComm:
    """Simulates W ranks inside one process: gather returns the parts the other 'ranks' computed."""

    def __init__(self, parts):
        self.parts, self.world, self.rank = parts, len(parts), 0

    def gather(self, t):
        return self.parts


@pytest.mark.parametrize("chunks", [3, 5, 6, 7, 8])
@pytest.mark.parametrize("world", [2, 4])
def test_treesum_is_split_independent(chunks, world):
    g = torch.Generator().manual_seed(chunks)
    vals = [torch.randn(64, generator=g) * 10 ** torch.randint(-3, 4, (64,), generator=g) for _ in range(chunks)]
    one = TreeSum()
    for c, v in enumerate(vals):
        one.add(c, v)
    ref = one.total(LocalComm())
    locals_ = []
    for r in range(world):
        t = TreeSum()
        for c in ChunkPlan(chunks, 1, r, world).owned():
            t.add(c, vals[c])
        locals_.append(t.local())
    assert torch.equal(TreeSum().total(_FakeComm(locals_)), ref)
    # a plain left-to-right sum differs in the last bits for some splits: the tree is what makes it exact
    assert torch.allclose(sum(vals), ref, rtol=1e-5)
