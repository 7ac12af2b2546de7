"""Exact speculative sampling: chi-square goodness of fit against the target distribution, negative controls."""

from __future__ import annotations

import pytest
import torch

from fp8ptq.spec import sampling
from fp8ptq.spec.sampling import PAD, chi_square_gof, residual, verify, verify_batch, verify_greedy

P_MIN = 1e-3  # a correct sampler fails this 1 time in 1000; the wrong ones give p-values ~1e-50


def _chain(V: int, seed: int, zeros: bool = False) -> torch.Tensor:
    """A random Markov transition matrix [V, V] (rows sum to 1); zeros=True blanks some entries."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(V, V, generator=g, dtype=torch.float64) ** 3 + 0.01
    if zeros:
        m = m * (torch.rand(V, V, generator=g, dtype=torch.float64) > 0.3)
        m[:, 0] += 0.05  # every row keeps some mass
    return m / m.sum(-1, keepdim=True)


def _speculative_chain(P, Q, gamma: int, length: int, n: int, seed: int, start: int = 0) -> torch.Tensor:
    """Generate n sequences of `length` tokens from the Markov chain P by speculative decoding with the
    draft chain Q (γ drafts a step, repeated until each row has `length` tokens). Returns [n, length]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n, length + gamma + 1), PAD, dtype=torch.long)
    filled = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), start, dtype=torch.long)
    rows = torch.arange(n)
    while bool((filled < length).any()):
        drafted, q_rows, ctx = [], [], last
        for _ in range(gamma):
            q_i = Q[ctx]
            x = torch.multinomial(q_i, 1, generator=g).squeeze(-1)
            drafted.append(x)
            q_rows.append(q_i)
            ctx = x
        d = torch.stack(drafted, 1) if gamma else torch.zeros(n, 0, dtype=torch.long)
        q = torch.stack(q_rows, 1) if gamma else torch.zeros(n, 0, P.shape[0], dtype=torch.float64)
        p = P[torch.cat([last.unsqueeze(1), d], 1)]  # p_i = P[token before position i]
        accepted, tokens = verify_batch(p, q, d, g)
        for j in range(gamma + 1):
            take = (j <= accepted) & (filled < length)
            out[rows[take], filled[take]] = tokens[take, j]
            filled = filled + take.long()
        last = out[rows, (filled - 1).clamp_min(0)]
    return out[:, :length]


def _joint_probs(P, length: int, start: int = 0) -> torch.Tensor:
    V = P.shape[0]
    joint = P[start]
    for _ in range(length - 1):
        joint = (joint.unsqueeze(-1) * P.reshape((1,) * (joint.dim() - 1) + (V, V))).reshape(*joint.shape, V)
    return joint


def _joint_pvalue(seqs: torch.Tensor, P, length: int) -> float:
    V = P.shape[0]
    flat = torch.zeros(V**length, dtype=torch.long)
    code = torch.zeros(seqs.shape[0], dtype=torch.long)
    for j in range(length):
        code = code * V + seqs[:, j]
    flat.index_add_(0, code, torch.ones_like(code))
    return chi_square_gof(flat, _joint_probs(P, length))[2]


@pytest.mark.parametrize("gamma", [1, 3])
def test_speculative_output_has_the_target_distribution(gamma):
    """Three consecutive tokens (6^3 = 216 cells, 60k sequences): covers accepted drafts, residual
    resamples and bonus tokens, which all occur at positions 1..3 with γ = 1 or 3."""
    V, L = 6, 3
    P, Q = _chain(V, 1), _chain(V, 2, zeros=True)
    seqs = _speculative_chain(P, Q, gamma, L, 60_000, seed=10 + gamma)
    assert _joint_pvalue(seqs, P, L) > P_MIN


def test_first_token_and_bonus_token_distributions():
    """One verification step with fixed p, q: the first emitted token ~ p[0]; given all γ accepted, the
    bonus token ~ p[γ]."""
    V, gamma, n = 12, 2, 40_000
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(gamma, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q[0, :3] = 0  # the draft can never propose tokens 0..2 first: only the residual can emit them
    q = q / q.sum(-1, keepdim=True)
    d = torch.stack(
        [torch.multinomial(q[i].expand(n, V), 1, replacement=True, generator=g).squeeze(-1) for i in range(gamma)], 1
    )
    accepted, tokens = verify_batch(p.expand(n, -1, -1), q.expand(n, -1, -1), d, g)
    first = torch.bincount(tokens[:, 0], minlength=V)
    assert chi_square_gof(first, p[0])[2] > P_MIN
    all_in = accepted == gamma
    assert int(all_in.sum()) > 2000
    bonus = torch.bincount(tokens[all_in, gamma], minlength=V)
    assert chi_square_gof(bonus, p[gamma])[2] > P_MIN


@pytest.mark.parametrize("wrong", ["resample_from_p", "inverted_ratio"])
def test_negative_control_wrong_rule_fails(monkeypatch, wrong):
    """The same test must reject a subtly wrong sampler: resampling from p instead of the residual, or
    accepting with min(1, q/p)."""
    V, L, gamma = 6, 3, 3
    P, Q = _chain(V, 1), _chain(V, 2, zeros=True)
    if wrong == "resample_from_p":
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    else:
        monkeypatch.setattr(sampling, "accept_mask", lambda p_x, q_x, u: u * p_x < q_x)
    seqs = _speculative_chain(P, Q, gamma, L, 60_000, seed=13)
    assert _joint_pvalue(seqs, P, L) < 1e-6


def test_greedy_equals_target_argmax():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, 20, generator=g)
    best = p.argmax(-1)
    n, toks = verify_greedy(p, best[:4])
    assert (n, toks) == (4, best.tolist())
    drafted = best[:4].clone()
    drafted[2] = (drafted[2] + 1) % 20
    n, toks = verify_greedy(p, drafted)
    assert (n, toks) == (2, best[:3].tolist())
    assert verify_greedy(p[:1], torch.zeros(0, dtype=torch.long)) == (0, [int(best[0])])


def test_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 8, generator=g, dtype=torch.float64), -1)
    # p == q: every draft is accepted (u < 1 and u·q < p = q)
    for _ in range(50):
        d = torch.multinomial(p[:3], 1, generator=g).squeeze(-1)
        n, toks = verify(p, p[:3].clone(), d, g)
        assert n == 3 and toks[:3] == d.tolist() and len(toks) == 4
    # q(x) = 0 < p(x): accepted (ratio +inf)
    q = p[:1].clone()
    q[0, 5] = 0
    assert verify(p[:2], q, torch.tensor([5]), g)[0] == 1
    # p(x) = 0: never accepted, and the replacement comes from the residual (never x itself)
    p0 = p[:2].clone()
    p0[0, 5] = 0
    p0[0] /= p0[0].sum()
    for _ in range(50):
        n, toks = verify(p0, p[:1].clone(), torch.tensor([5]), g)
        assert n == 0 and toks[0] != 5 and len(toks) == 1
    # γ = 0: one plain sample from p
    n, toks = verify(p[:1], torch.zeros(0, 8, dtype=torch.float64), torch.zeros(0, dtype=torch.long), g)
    assert n == 0 and len(toks) == 1
    # residual: normalised, zero where q ≥ p, falls back to p when p == q
    r = residual(p[0], p[1])
    assert torch.isclose(r.sum(), torch.tensor(1.0, dtype=torch.float64)) and bool((r[p[1] >= p[0]] == 0).all())
    assert torch.equal(residual(p[0], p[0]), p[0])


def test_chi_square_gof_matches_known_values():
    # 2 dof: the survival function is exp(-stat/2)
    stat, dof, pv = chi_square_gof(torch.tensor([30, 50, 20]), torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64))
    assert dof == 2 and abs(stat - (0 + 100 / 40 + 100 / 30)) < 1e-9
    assert abs(pv - torch.exp(torch.tensor(-stat / 2, dtype=torch.float64)).item()) < 1e-9
    assert chi_square_gof(torch.tensor([1, 0]), torch.tensor([0.0, 1.0]))[2] == 0.0
