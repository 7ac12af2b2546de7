"""Parsing `spec measure` / `recommend` / `compare`'s measuring options into a MeasureConfig (shared by
cli/spec.py and cli/spec_compare.py)."""

from __future__ import annotations

import math

from fp8ptq.cli.common import fail
from fp8ptq.errors import Fp8ptqError


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """'1-8' or '1,2,4' -> (1, ..., 8) / (1, 2, 4)."""
    try:
        if "-" in text and "," not in text:
            lo, hi = (int(x) for x in text.split("-"))
            if hi - lo > 1024:  # checked before the range is built: 1-1000000000 is a typo, not a plan
                fail(Fp8ptqError(f"{what} '{text}' spans {hi - lo + 1} values", fix="write e.g. 1-8 or 1,2,4"))
            vals = tuple(range(lo, hi + 1))
        else:
            vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        fail(Fp8ptqError(f"cannot read {what} '{text}'", fix="write e.g. 1-8 or 1,2,4"))
    if not vals:
        fail(Fp8ptqError(f"{what} '{text}' is empty", fix="write e.g. 1-8 or 1,2,4"))
    return vals


def parse_floats(text: str, what: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        fail(Fp8ptqError(f"cannot read {what} '{text}'", fix="write e.g. 0,1 or 0.3,0.5"))
    bad = [v for v in vals if not math.isfinite(v)]
    if bad:
        fail(Fp8ptqError(f"{what} '{text}' holds {bad[0]}", fix="write finite numbers, e.g. 0,1 or 0.3,0.5"))
    return vals


def measure_config(
    *, target, draft, gammas, temperatures, prompts, num_prompts, max_tokens, thresholds, seed, device, batch_sizes=None
):
    from fp8ptq.spec.run import MeasureConfig

    return MeasureConfig(
        target=target,
        draft=draft,
        gammas=parse_ints(gammas, "--gammas"),
        temperatures=parse_floats(temperatures, "--temperatures"),
        prompts=prompts,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        thresholds=parse_floats(thresholds, "--thresholds") if thresholds else (),
        seed=seed,
        device=device,
        batch_sizes=parse_ints(batch_sizes, "--batch-sizes") if batch_sizes else (),
    )
