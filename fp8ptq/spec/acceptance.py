"""What measuring speculative decoding yields, typed: one γ's counters (`RunSummary`), one temperature's
runs (`Acceptance`), a whole `spec measure` (`Measurement`: what measure.json holds). spec/measure.py
produces them, spec/recommend.py chooses from them, spec/run.py writes measure.json and reads it back
through validation (fp8ptq/results.py).
The counters follow vLLM's spec-decode metrics (measure.py's docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from fp8ptq.results import read_json
from fp8ptq.spec import SpecError


@dataclass(frozen=True)
class RunSummary:
    """The counters of one γ (or one dynamic-length threshold at γ) over every prompt."""

    gamma: int
    drafts: int  # verification steps with at least one drafted token
    drafted: int
    accepted: int
    per_pos_accepted: list[int]  # accepted count per draft position
    per_pos_reached: list[int]  # drafts that proposed a token at position i
    alpha_per_pos: list[float]  # per_pos_accepted / per_pos_reached
    alpha: float  # accepted / drafted
    tau: float  # emitted / target_forwards: tokens per target forward
    emitted: int  # tokens emitted by verification steps (the prefill token excluded)
    target_forwards: int
    k_hist: dict[str, int]  # drafted tokens k (as a string: a JSON key) -> steps that drafted k
    threshold: float | None = None  # the dynamic draft length's confidence threshold, if any
    tau_se: float | None = None  # τ's standard error: bootstrap over the prompts (None: fewer than 2 prompts)
    alpha_conditional: list[float] = field(default_factory=list)  # P(position i accepted | i - 1 accepted)
    per_prompt: list[list[int]] = field(default_factory=list)  # [emitted, target_forwards] per prompt, in order

    def steps(self) -> dict[int, int]:
        """k_hist with integer keys (recommend.speedup_from_steps)."""
        return {int(k): v for k, v in self.k_hist.items()}


def bootstrap_taus(runs: list[list[list[int]]] | list[list[tuple[int, int]]], resamples: int = 2000):
    """τ = Σ emitted / Σ forwards of each run over `resamples` draws of its prompts with replacement, the
    same draw for every run (fixed seed: a measurement's numbers are reproducible). runs: per run, the
    [emitted, forwards] of each prompt, the same prompts in the same order. Returns [runs, resamples]."""
    import torch

    x = torch.tensor(runs, dtype=torch.float64)  # [runs, prompts, 2]
    pick = torch.randint(0, x.shape[1], (resamples, x.shape[1]), generator=torch.Generator().manual_seed(0))
    sums = x[:, pick].sum(2)  # [runs, resamples, 2]
    return sums[..., 0] / sums[..., 1].clamp_min(1)


def paired_tau_difference(a: RunSummary, b: RunSummary, resamples: int = 2000) -> tuple[float, float]:
    """τ(b) − τ(a) and its standard error, both measured on the same prompts: one bootstrap draw of prompts
    resamples both runs alike, so what the prompts share cancels — far tighter than the two runs' own
    errors combined when the proposers are alike."""
    if len(a.per_prompt) != len(b.per_prompt) or len(a.per_prompt) < 2:
        raise SpecError(
            f"a paired comparison needs the same prompts, ≥ 2, with per-prompt counts (got {len(a.per_prompt)} "
            f"and {len(b.per_prompt)})",
            fix="measure both with the same --prompts/--num-prompts/--max-tokens with this fp8ptq (older "
            "measure.json files lack per-prompt counts)",
        )
    taus = bootstrap_taus([a.per_prompt, b.per_prompt], resamples)
    return float(b.tau - a.tau), float((taus[1] - taus[0]).std())


@dataclass(frozen=True)
class Acceptance:
    """measure.measure_acceptance at one temperature: a RunSummary per γ, and per threshold."""

    runs: tuple[RunSummary, ...]
    threshold_runs: tuple[RunSummary, ...]
    temperature: float
    max_tokens: int
    prompts: int
    seed: int


@dataclass(frozen=True)
class Measurement:
    """`spec measure`'s result, written by `--save` (and into a recommendation's folder as run.MEASURE_FILE)
    and read back by `spec recommend --measured` through validation (fp8ptq/results.py)."""

    SCHEMA: ClassVar[str] = "spec-measure"
    SCHEMA_VERSION: ClassVar[int] = 1

    target: str
    target_path: str  # the target's resolved directory (an alias resolved to the cache)
    draft: str
    trimmed: bool  # a VocabTrim draft model (proposers.Proposer.vocab_trimmed)
    config: dict  # the MeasureConfig as run, prompt_ids left out
    prompt_ids: list[list[int]]  # the prompts as token ids (chat template applied)
    by_temperature: dict[str, Acceptance]  # str(temperature) -> its runs
    costs: dict  # recommend.Costs.as_dict()
    timings: dict[str, float]
    costs_by_batch: dict[str, dict] = field(default_factory=dict)  # str(batch size) -> Costs.as_dict() (--batch-sizes)


def read_measurement(path: Path) -> Measurement:
    """A `spec measure --save` file, validated (a SpecError naming the file and the bad field otherwise)."""
    return read_json(
        path, Measurement, error=SpecError, fix="pass the file written by `fp8ptq spec measure --save FILE`"
    )
