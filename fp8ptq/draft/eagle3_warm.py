"""Linear warm start of an EAGLE-3 head, fitted in closed form on the captured hidden states.

A head trained from random weights spends its first hundreds of steps finding the target's output space;
on a 2-core CPU that is most of the budget (BENCHMARKS.md, EAGLE-3 training). Here the head starts as the best
linear predictor of what the target's LM head will read one position later:

    final_{i+1}  ≈  W · fc_input(aux_i)  +  B · n(embed(token_{i+1}))        (ridge regression)

`final` is the target's last residual stream over its RMS (captured beside the aux states), so the
head's norm (the target's final norm) and LM-head rows (the target's) turn the prediction into the
target's next-next-token logits. W becomes fc. B, the contribution of the token the head is given,
can only enter through attention (in vLLM's layer the embedding feeds q/k/v only), so it is built as a
self-attention: q and k read the same whitened projection of the token's embedding (a position scores
highest against itself and other occurrences of the same token, whose values are equal), v and o_proj
hold a rank-(kv_heads · head_dim) factorisation of B. o_proj's rows beyond that path and down_proj
start at zero: the untrained head computes exactly the regression when its attention is one-hot on
the same token, and training refines everything from there.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from fp8ptq.spec import SpecError

# Self-attention sharpness: scores are SHARP · |P e|² / sqrt(head_dim) ≈ 8 · SHARP for the same token with a
# whitened 64-dim P; other tokens score ~N(0, SHARP²)-ish, so the same-token weight dominates without
# saturating the softmax (its gradients then still let training learn to read the context).
SHARP = 3.0


def _features(head, shard: dict, embed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, n_in] (fc's normalised input at i, then the normalised embedding of token i + 1) and y [n, H]
    (the target's final feature at i + 1) over every position i with a successor."""
    if "final" not in shard:
        raise SpecError(
            "the work dir holds hidden states captured before fp8ptq recorded the target's final feature",
            fix="train without --resume (or delete the work dir) so the capture runs again",
        )
    T = shard["aux"].shape[1]
    live = torch.arange(T - 1).view(1, -1) < (shard["lens"] - 1).view(-1, 1)
    dev = head.fc.weight.device
    x = head.fc_input(shard["aux"][:, :-1][live].float().to(dev))
    if embed:
        tok = shard["ids"][:, 1:][live].to(dev)
        x = torch.cat([x, head.midlayer.input_layernorm(head.embed_tokens(tok).float())], -1)
    return x.cpu(), shard["final"][:, 1:][live].float()


@torch.no_grad()
def linear_warm_start(
    head, work: Path, n_shards: int, seed: int, *, embed: bool = True, max_tokens: int = 200_000, ridge: float = 1e-3
) -> dict:
    """Fit and install the warm start (module docstring) from up to `max_tokens` positions of the work dir's
    shards. Returns the number of positions and the regression's R² (uncentred, on the fitted positions)."""
    H = head.s.hidden
    n_fc = head.fc.in_features
    n_in = n_fc + (H if embed else 0)
    xtx = torch.zeros(n_in, n_in, dtype=torch.float64)
    xty = torch.zeros(n_in, H, dtype=torch.float64)
    yy, n = 0.0, 0
    for s in torch.randperm(n_shards, generator=torch.Generator().manual_seed(seed)).tolist():
        x, y = _features(head, load_file(str(work / f"shard-{s:05d}.safetensors")), embed)
        xtx += (x.T @ x).double()  # fp32 products per shard (a few thousand rows), fp64 sums across shards
        xty += (x.T @ y).double()
        yy += float(y.double().pow(2).sum())
        n += x.shape[0]
        if n >= max_tokens:
            break
    d = xtx.diagonal().clamp_min(1e-12).sqrt()  # solve on unit-scale columns: ridge relative to each input's size
    a = xtx / d.view(-1, 1) / d.view(1, -1) + ridge * torch.eye(n_in, dtype=torch.float64)
    w = torch.linalg.solve(a, xty / d.view(-1, 1)) / d.view(-1, 1)  # [n_in, H]
    resid = yy - 2 * float((w * xty).sum()) + float((w * (xtx @ w)).sum())
    layer = head.midlayer
    head.fc.weight.copy_(w[:n_fc].T.float())
    layer.mlp.down_proj.weight.zero_()
    layer.self_attn.o_proj.weight.zero_()
    if embed:
        _self_attention(head, w[n_fc:].T.float())
    return {"tokens": n, "r2": 1.0 - resid / max(yy, 1e-12), "embed": embed}


def _self_attention(head, b: torch.Tensor) -> None:
    """Install attn(x)_i ≈ b · n(embed(token_{i+1})) (b [H, H]) for a one-hot same-token attention."""
    s, attn = head.s, head.midlayer.self_attn
    hd, rep, H = s.head_dim, s.heads // s.kv_heads, s.hidden
    r = min(s.kv_heads * hd, H)
    u, sv, vh = torch.linalg.svd(b.double())
    left = (u[:, :r] * sv[:r].sqrt()).float()  # [H, r]
    right = (sv[:r].sqrt().view(-1, 1) * vh[:r]).float()  # [r, H]
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        m.weight.zero_()  # the hidden half (columns H:) stays zero: the path reads the embedding only
    attn.v_proj.weight[:r, :H] = right
    for h in range(s.heads):  # head h reads kv group h // rep (Attention.attend's repeat_interleave)
        g = h // rep
        lo, hi = g * hd, min((g + 1) * hd, r)
        if hi > lo:
            attn.o_proj.weight[:, h * hd : h * hd + hi - lo] = left[:, lo:hi] / rep
    p = _whitening(head, hd)
    for h in range(s.heads):
        attn.q_proj.weight[h * hd : (h + 1) * hd, :H] = SHARP**0.5 * p
    for g in range(s.kv_heads):
        attn.k_proj.weight[g * hd : (g + 1) * hd, :H] = SHARP**0.5 * p


def _whitening(head, k: int) -> torch.Tensor:
    """[k, H]: the top-k principal directions of the normalised embeddings of the draft vocabulary, each
    scaled to unit variance, so |P n(e)|² ≈ k for a typical token and distinct tokens are near-orthogonal."""
    rows = head.draft_to_target(torch.arange(head.s.draft_vocab, device=head.d2t.device))
    e = head.midlayer.input_layernorm(head.embed_tokens(rows).float()).double()
    e = e - e.mean(0, keepdim=True)
    vals, vecs = torch.linalg.eigh(e.T @ e / max(1, e.shape[0] - 1))
    top = vals.flip(0)[:k].clamp_min(1e-8)
    return (vecs.flip(1)[:, :k] / top.sqrt()).T.float()
