"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023) as pure functions over probabilities.

One verification step: the draft proposed γ tokens x_1..x_γ, x_i sampled from q_i (the draft's
distribution after the prefix and x_<i); the target scored the prefix + drafts in one forward and gave
p_1..p_{γ+1}. For i = 1..γ: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection sample a replacement from the residual norm(max(0, p_i − q_i)) and stop. If all γ are
accepted, sample a bonus token from p_{γ+1}. The tokens emitted are then distributed exactly as if they
had been sampled from the target one at a time (tests/spec/test_spec_sampling.py checks this with a
chi-square test, and that a wrong rule fails it). Greedy mode: accept while x_i == argmax p_i, then
emit argmax p at the first mismatch (or the bonus position) — the output equals the target's greedy
output token for token.

Shapes: V vocabulary, γ drafted tokens, B independent sequences (the batched form exists so tests can
draw 10^5 samples quickly; the measurement loop uses B = 1).
"""

from __future__ import annotations

import math

import torch

PAD = -1  # token slot after the emitted ones in a batched result


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) over the last dim. Where p == q (nothing left), fall back to p: a rejection
    cannot happen there (p(x) ≥ q(x) for every x the draft can propose), so the choice never matters."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def accept_mask(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept x with probability min(1, p(x)/q(x)), given u ~ U[0, 1): u·q < p is that event without a
    division. It also handles the corners: q(x) = 0 < p(x) accepts, p(x) = 0 never accepts."""
    return u * q_x < p_x


def verify_batch(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched verification. p [B, γ+1, V], q [B, γ, V], drafted [B, γ] (int64).

    Returns (accepted [B] in 0..γ, tokens [B, γ+1]): row b emits tokens[b, :accepted[b]+1] (the
    accepted drafts, then the residual sample or the bonus token); the rest is PAD."""
    B, g1, V = p.shape
    gamma = g1 - 1
    assert q.shape == (B, gamma, V) and drafted.shape == (B, gamma), (p.shape, q.shape, drafted.shape)
    if gamma == 0:
        return torch.zeros(B, dtype=torch.long), torch.multinomial(p[:, 0], 1, generator=generator)
    idx = drafted.unsqueeze(-1)
    p_x = p[:, :gamma].gather(-1, idx).squeeze(-1)
    q_x = q.gather(-1, idx).squeeze(-1)
    u = torch.rand(B, gamma, generator=generator, dtype=p.dtype)
    ok = accept_mask(p_x, q_x, u)
    accepted = ok.long().cumprod(-1).sum(-1)  # length of the accepted prefix
    rows = torch.arange(B)
    at = accepted.clamp_max(gamma - 1)
    # Rejected at position n: sample from the residual there; all accepted: the bonus from p[γ].
    dist = torch.where((accepted == gamma).unsqueeze(-1), p[rows, gamma], residual(p[rows, at], q[rows, at]))
    final = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    tokens = torch.full((B, g1), PAD, dtype=torch.long)
    keep = torch.arange(gamma).unsqueeze(0) < accepted.unsqueeze(1)
    tokens[:, :gamma] = torch.where(keep, drafted, PAD)
    tokens[rows, accepted] = final
    return accepted, tokens


def verify(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, list[int]]:
    """One sequence: p [γ+1, V], q [γ, V], drafted [γ]. Returns (accepted count, emitted tokens)."""
    n, tokens = verify_batch(p.unsqueeze(0), q.unsqueeze(0), drafted.reshape(1, -1), generator)
    n = int(n[0])
    return n, tokens[0, : n + 1].tolist()


def verify_greedy(p: torch.Tensor, drafted: torch.Tensor) -> tuple[int, list[int]]:
    """Greedy: p [γ+1, V] (probabilities or logits), drafted [γ]. Accept while drafted == argmax p."""
    best = p.argmax(-1)
    gamma = drafted.numel()
    match = (best[:gamma] == drafted.reshape(-1)).long()
    n = int(match.cumprod(0).sum()) if gamma else 0
    return n, drafted.reshape(-1)[:n].tolist() + [int(best[n])]


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sampling distribution at a temperature (> 0), in fp32 or wider."""
    return torch.softmax(logits.double() / temperature, dim=-1)


# --- statistics for the exactness tests (pure, no scipy needed) ---


def chi_square_gof(
    counts: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """Pearson chi-square goodness of fit of observed counts to expected probabilities (same shape).

    Cells with an expected count below min_expected are pooled into one cell (the chi-square
    approximation needs it); a count in a cell of probability 0 gives p-value 0. Returns (statistic,
    degrees of freedom, p-value); the p-value is the chi-square survival function,
    Q(dof/2, stat/2) = torch.special.gammaincc."""
    counts = counts.reshape(-1).double()
    probs_ = expected_probs.reshape(-1).double()
    n = counts.sum()
    if bool(((probs_ == 0) & (counts > 0)).any()):
        return math.inf, 0, 0.0
    exp = probs_ * n
    small = exp < min_expected
    obs_cells = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp_cells = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    live = exp_cells > 0
    obs_cells, exp_cells = obs_cells[live], exp_cells[live]
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    dof = int(obs_cells.numel()) - 1
    if dof < 1:
        return stat, dof, 1.0
    pvalue = float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    return stat, dof, pvalue


def verify_drafts(t_logits: torch.Tensor, drafted: list[int], q_rows: list, temperature: float, g) -> tuple:
    """Accept a prefix of `drafted` against the target's logits [k+1, V]: greedy match at T = 0, else the
    speculative-sampling rule with the draft's rows q (shared by the draft-model and EAGLE-3 loops)."""
    d = torch.tensor(drafted, dtype=torch.long)
    if temperature == 0:
        return verify_greedy(t_logits, d.to(t_logits.device))
    p = probs(t_logits, temperature).cpu()
    q = torch.stack([r.cpu() for r in q_rows]).to(p.dtype) if drafted else p.new_zeros(0, p.shape[-1])
    return verify(p, q, d, g)
