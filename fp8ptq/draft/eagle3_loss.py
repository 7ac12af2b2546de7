"""The EAGLE-3 training objective (draft-train --kind eagle3, `eagle3_train`): the training-time-test unroll
of the head over a batch of captured sequences, the target's distribution as the teacher, the loss rows, and
the regularisers (noise on the aux states, the EAGLE-1 feature-regression term)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Teacher:
    """The target's distribution over the kept ids at a position, from its final feature there."""

    weight: torch.Tensor  # [N, H] the target's LM-head rows of the kept ids

    def log_probs(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [n, H]: what the target's LM head reads (eagle3_data's capture) -> [n, N] log-probs."""
        return F.log_softmax(F.linear(normed.float(), self.weight.float()), -1)


def ttt_mask(T: int, k: int, device) -> torch.Tensor:
    """[T, (k+1)·T] bool: query i of step k sees step-0 keys j ≤ i - k and step-s keys j = i - k + s."""
    i = torch.arange(T, device=device).view(-1, 1)
    j = torch.arange(T, device=device).view(1, -1)
    blocks = [j <= i - k] + [j == i - k + s for s in range(1, k + 1)]
    return torch.cat(blocks, 1)


def loss_rows(lens: torch.Tensor, loss_from: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] bool: index i is trained on (it predicts token i + 2, the target's distribution at i + 1)."""
    idx = torch.arange(T, device=lens.device).view(1, -1)
    return (idx <= (lens - 3).view(-1, 1)) & (idx >= loss_from.view(-1, 1))


@dataclass(frozen=True)
class Objective:
    """What a training step minimises: `steps` TTT steps of KL, plus the regularisers."""

    steps: int = 3
    aux_noise: float = 0.0  # σ of N(0, σ²·rms²) added to each aux layer's state (rms: that state's at the row)
    feature_loss: float = 0.0  # weight of SmoothL1(the head's norm(out_k), what the target's LM head read)
    seed: int = 0

    @classmethod
    def of(cls, cfg) -> Objective:
        """From an Eagle3TrainConfig."""
        return cls(cfg.ttt_steps, cfg.aux_noise, cfg.feature_loss, cfg.seed)


def noisy(aux: torch.Tensor, n_layers: int, sigma: float, gen: torch.Generator | None) -> torch.Tensor:
    """aux [B, T, n·H] with Gaussian noise of σ times each layer's RMS at each position (scale-free: the
    target's layers differ in scale by orders of magnitude)."""
    if sigma <= 0:
        return aux
    x = aux.unflatten(-1, (n_layers, -1))
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    z = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
    return (x + sigma * rms * z).flatten(-2)


def ttt_loss(head, batch: dict, obj: Objective, teacher: Teacher, device: str, step: int = 0) -> torch.Tensor:
    """Σ_k 0.8^k · (mean KL(target ‖ head) + feature_loss · SmoothL1) over the loss rows of step k (the
    module docstring); the head's logits and the teacher's are computed at those rows only. The noise of
    step `step` is a pure function of (seed, step), so a resumed run draws what it would have."""
    lens, lf = batch["lens"].to(device), batch["loss_from"].to(device)
    T = int(lens.max())
    ids = batch["ids"][:, :T].to(device)
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)  # token i + 1 at index i
    pos = torch.arange(T, device=device)
    gen = torch.Generator(device=device).manual_seed(obj.seed * 1_000_003 + step) if obj.aux_noise > 0 else None
    aux = noisy(batch["aux"][:, :T].to(device).float(), len(head.s.layer_ids), obj.aux_noise, gen)
    hid = head.fuse(aux)
    rows0 = loss_rows(lens, lf, T)
    at = torch.full(rows0.shape, -1, dtype=torch.long, device=device)
    at[rows0] = torch.arange(int(rows0.sum()), device=device)
    b, i = rows0.nonzero(as_tuple=True)
    with torch.no_grad():
        t_feat = batch["normed"].to(device)[b, i + 1].float()  # [n, H]
        t_logp = teacher.log_probs(t_feat)  # [n, N]
        t_p = t_logp.exp()
    idx = torch.arange(T, device=device).view(1, -1)
    keys, vals, total, wsum = [], [], 0.0, 0.0
    for k in range(obj.steps):
        past = None if k == 0 else (torch.cat(keys, 2), torch.cat(vals, 2))
        out, _, (kk, vv) = head.block(nxt, hid, pos, past, ttt_mask(T, k, device), logits=False)
        keys.append(kk)
        vals.append(vv)
        valid = rows0 & (idx >= k)
        if valid.any():
            feat = head.norm(out[valid])
            q = F.log_softmax(head.lm_head(feat).float(), -1)
            r = at[valid]
            term = (t_p[r] * (t_logp[r] - q)).sum(-1).mean()
            if obj.feature_loss > 0:
                term = term + obj.feature_loss * F.smooth_l1_loss(feat.float(), t_feat[r])
            total = total + 0.8**k * term
            wsum += 0.8**k
        hid = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)  # step k+1 at i reads out_k[i - 1]
    return total / max(wsum, 1e-9)
