"""One-step primitives the speculative loop, the proposers and the cost measurement share: the next
token of a distribution, and the median wall time of a step (`measure.py`'s module doc)."""

from __future__ import annotations

import statistics
import time

import torch

from fp8ptq.spec.models import LoadedModel, crop, new_cache
from fp8ptq.spec.sampling import probs as to_probs


def pick_token(logits: torch.Tensor, temperature: float, g: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """The next token: argmax at temperature 0, else a sample from the tempered distribution (also returned)."""
    if temperature == 0:
        return int(logits.argmax()), None
    p = to_probs(logits, temperature)
    return int(torch.multinomial(p.cpu(), 1, generator=g)), p


def draft_chain(last: torch.Tensor, gamma: int, threshold: float | None, sample, step) -> tuple[list, list]:
    """The drafted steps of a draft on the target's hidden states (EAGLE-3 head, MTP layer), after its first
    pass: from that pass's last logits, up to γ tokens, each sampled (sample(logits) -> (id, q row)) and fed
    back (step(id, k) -> the next logits) unless it is the last; drafting stops where the max probability is
    below `threshold` (dynamic draft length)."""
    drafted, q_rows = [], []
    for k in range(gamma):
        if threshold is not None and float(torch.softmax(last.float(), -1).max()) < threshold:
            break
        tok, q = sample(last)
        drafted.append(tok)
        q_rows.append(q)
        if k == gamma - 1:
            break
        last = step(tok, k)
    return drafted, q_rows


def median_time(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()  # warm-up: allocator, lazy init
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_ids(context: list[int], max_k: int) -> list[int]:
    """max_k token ids to time steps with: the context's last max_k (repeated when it is shorter)."""
    return context[-max_k:] if len(context) >= max_k else (context * max_k)[:max_k]


def prefilled_cache(m: LoadedModel, context: list[int], device: str, batch: int = 1):
    """A KV cache holding `context` (in each of `batch` rows), for timing steps after it."""
    cache = new_cache(m.model)
    with torch.inference_mode():
        m.model(input_ids=torch.tensor([context] * batch, device=device), past_key_values=cache, use_cache=True)
    return cache


def timed_step(m: LoadedModel, cache, ids: list[int], held: int, device: str, batch: int = 1):
    """A callable feeding `ids` (to each of `batch` rows) after a cache of `held` positions, its logits in
    fp32 (as step_logits gives them), synchronised, then rolled back."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    x = torch.tensor([ids] * batch, dtype=torch.long, device=device)

    def f():
        with torch.inference_mode():
            m.model(input_ids=x, past_key_values=cache, use_cache=True).logits.float()
        sync()
        crop(cache, held)

    return f
