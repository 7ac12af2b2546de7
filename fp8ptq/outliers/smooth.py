"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights, exactly.

For a Linear group fed by an RMSNorm (q/k/v after input_layernorm, gate/up after
post_attention_layernorm): x' = x / s, W' = W * s (per input channel). Folding 1/s into the norm's
weight keeps the function unchanged, so the transform is exact before quantization. With
s_j = max|x_j|^alpha / max|W_j|^(1-alpha), alpha trades activation range for weight range; here it
is chosen per layer and per group by the *measured* quantized-output error on a calibration
subsample (no smoothing is always a candidate, so smoothing is only applied where it helps).
"""

from __future__ import annotations

from typing import Callable

import torch

_EPS = 1e-5
RESCORE = 3  # candidates scored again with the recipe's weight rounding after a cheaper screen


def smooth_scales(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-input-channel s (float32 [C]); channels never active keep s = 1."""
    a = act_amax.float().clamp_min(_EPS)
    w = weight_amax.float().clamp_min(_EPS)
    s = (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-4, max=1e4)
    return torch.where(act_amax > 0, s, torch.ones_like(s))


def fold(
    norm_weight: torch.Tensor,
    weights: list[torch.Tensor],
    s: torch.Tensor,
    stored_dtype: torch.dtype,
    offset: float = 0.0,
):
    """Fold s into the norm (rounded to the dtype the checkpoint stores it in) and the weights.

    The norm weight is what the engine loads in `stored_dtype`, so the effective scale is the one that
    rounding leaves: s_eff = norm / round(norm / s). Using s_eff for the weights keeps the pair exact.
    offset: the norm multiplies by (offset + w) (Gemma's RMSNorm: 1), so w' = (offset + w) / s - offset.
    Returns (new norm weight fp32 holding stored_dtype values, new weights, s_eff)."""
    if offset:
        eff = norm_weight.float() + offset
        stored = (eff / s.to(eff.device) - offset).to(stored_dtype).float()
        new_eff = stored + offset
        s_eff = torch.where(new_eff != 0, eff / new_eff, torch.ones_like(eff))
        return stored, [w.float() * s_eff.to(w.device)[None, :] for w in weights], s_eff
    norm = norm_weight.float()
    new_norm = (norm / s.to(norm.device)).to(stored_dtype).float()
    s_eff = torch.where(new_norm != 0, norm / new_norm, torch.ones_like(norm))
    return new_norm, [w.float() * s_eff.to(w.device)[None, :] for w in weights], s_eff


def quantized_output_error(
    rows: torch.Tensor,
    refs: list[torch.Tensor],
    weights: list[torch.Tensor],
    s: torch.Tensor,
    act_quant: Callable[[torch.Tensor, float], torch.Tensor],
    weight_quant: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """||Q_a(x/s) Q_w(W s)^T - x W^T||^2 summed over the group, on calibration rows x [r, C].
    act_quant(x, amax) fake-quantizes x with a scale covering amax (static) or per token (dynamic).
    refs: the float outputs x W^T per weight (computed once by the caller: the same for every s)."""
    xs = rows / s[None, :]
    xq = act_quant(xs, float(xs.abs().max()))
    err = 0.0
    for ref, w in zip(refs, weights):
        err += float((xq @ weight_quant(w.float() * s[None, :]).T - ref).pow(2).sum())
    return err


def gram_output_error(
    gram: torch.Tensor,
    weights: list[torch.Tensor],
    s: torch.Tensor,
    weight_quant: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """quantized_output_error where the inputs stay unquantized (weight-only schemes: AWQ), from the rows'
    Gram matrix G = x^T x [C, C] instead of the rows: x/s Q(W s)^T - x W^T = x D^T with D = Q(W s)/s - W, so
    the error is sum(D G * D). The same quantity in fewer operations (out x C x C, not rows x C x out) and
    no [rows, out] temporaries; fp32 sums in another order (relative differences ~1e-6)."""
    err = 0.0
    for w in weights:
        d = weight_quant(w.float() * s[None, :]).div_(s[None, :]).sub_(w.float())
        err += float((d @ gram).mul_(d).sum())
    return err


def weight_amax(weights: list[torch.Tensor]) -> torch.Tensor:
    """SmoothQuant's weight statistic: max |W| per input channel over the group's Linears."""
    return torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)


def awq_stats(rows: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's statistics per input channel: mean |x| over the calibration rows, and the mean over the
    group's output rows of |W| relative to its row's max (llm-compressor's duo scaling); the scales are
    then smooth_scales(x_mean, w_mean, alpha) = x_mean^alpha / w_mean^(1 - alpha)."""
    w = torch.cat([w.float() for w in weights])
    rel = w.abs() / w.abs().amax(dim=1, keepdim=True).clamp_min(_EPS)
    return rows.float().abs().mean(dim=0), rel.mean(dim=0)


def choose_alpha(
    rows: torch.Tensor,
    act_amax: torch.Tensor,
    weights: list[torch.Tensor],
    alphas,
    act_quant,
    weight_quant,
    *,
    screen_quant=None,
    w_stat: torch.Tensor | None = None,
) -> tuple[float | None, dict]:
    """The alpha with the smallest measured error (None: no smoothing won). Returns (alpha, errors).

    act_amax / w_stat: the activation and weight statistics the scales come from (SmoothQuant: max |x|
    and, by default, max |W| per channel; AWQ: awq_stats). act_quant None: the inputs stay unquantized
    (weight-only schemes), scored by gram_output_error.
    screen_quant: a cheaper weight rounding (min-max scales where the recipe searches them): every
    candidate is scored with it first and only the RESCORE best are scored again with weight_quant,
    which decides; errors then holds the final scores and, under "screen", the screening ones."""
    w_amax = weight_amax(weights) if w_stat is None else w_stat
    candidates = {"none": None} | {f"{a:g}": a for a in alphas}  # grid order: ties go to the earlier one
    scales = {
        n: torch.ones(rows.shape[1]) if a is None else smooth_scales(act_amax, w_amax, a) for n, a in candidates.items()
    }
    names = list(candidates)
    if act_quant is None:  # unquantized inputs: every candidate's error from one Gram matrix
        gram = rows.float().T @ rows.float()
        score = lambda n, wq: gram_output_error(gram, weights, scales[n], wq)  # noqa: E731
    else:
        refs = [rows @ w.float().T for w in weights]  # the float outputs, the same for every candidate
        score = lambda n, wq: quantized_output_error(rows, refs, weights, scales[n], act_quant, wq)  # noqa: E731
    screen = None
    if screen_quant is not None:
        screen = {n: score(n, screen_quant) for n in names}
        kept = set(sorted(names, key=screen.__getitem__)[:RESCORE])  # a stable sort: ties keep grid order
        names = [n for n in names if n in kept]
    errors = {n: score(n, weight_quant) for n in names}
    best = min(errors, key=errors.__getitem__)  # the first of equal minima, in grid order
    if screen is not None:
        errors["screen"] = screen
    return candidates[best], errors
