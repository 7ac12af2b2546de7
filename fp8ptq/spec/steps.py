"""One-step primitives the speculative loop, the proposers and the cost measurement share: the next
token of a distribution, and the median wall time of a step (`measure.py`'s module doc)."""

from __future__ import annotations

import statistics
import time

import torch

from fp8ptq.spec.models import LoadedModel, crop, step_logits
from fp8ptq.spec.sampling import probs as to_probs


def pick_token(logits: torch.Tensor, temperature: float, g: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """The next token: argmax at temperature 0, else a sample from the tempered distribution (also returned)."""
    if temperature == 0:
        return int(logits.argmax()), None
    p = to_probs(logits, temperature)
    return int(torch.multinomial(p.cpu(), 1, generator=g)), p


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


def timed_step(m: LoadedModel, cache, ids: list[int], held: int, device: str):
    """A callable feeding `ids` after a cache of `held` positions, synchronised, then rolled back."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def f():
        step_logits(m, ids, cache, device)
        sync()
        crop(cache, held)

    return f
