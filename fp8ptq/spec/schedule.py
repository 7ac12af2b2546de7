"""γ per decode batch size: vLLM's `num_speculative_tokens_per_batch_size` (vLLM 0.32+, "dynamic speculative
decoding": `vllm/v1/spec_decode/dynamic/utils.py`, read by its scheduler).

Acceptance does not depend on the batch; the costs do. At batch 1 a decode step reads every weight for
one token and verifying γ + 1 tokens costs about as much as one; as the batch grows the target's forward
turns compute-bound and every drafted token is paid for in full, so the best γ falls (to 0: no drafting).
`spec measure --batch-sizes 1,8,32` times the target and the draft at each batch size (measure.py,
`measure_costs(batch=)`, on the device it runs on: measure on the serving GPU for a schedule that holds
there); this module picks the best γ per measured batch size with recommend.choose and makes the ranges vLLM
takes (written by recommend.with_schedule): `[start, end, γ]`, inclusive, the first starting at 1, each
measured size covering the sizes up to the next one (vLLM carries the last γ past the end)."""

from __future__ import annotations

from fp8ptq.spec import SpecError
from fp8ptq.spec.acceptance import Acceptance
from fp8ptq.spec.recommend import Costs, choose


def parse_batch_sizes(sizes) -> tuple[int, ...]:
    """Sorted distinct batch sizes, 1 always included (vLLM's schedule must start at 1); SpecError on < 1."""
    bad = [b for b in sizes if int(b) < 1]
    if bad:
        raise SpecError(f"batch sizes {list(sizes)} must be ≥ 1", fix="e.g. --batch-sizes 1,8,32")
    return tuple(sorted({1, *(int(b) for b in sizes)}))


def per_batch(acc: Acceptance, costs_by_batch: dict[int, Costs]) -> list[dict]:
    """One row per measured batch size: the γ recommend.choose picks under that batch's costs (0 when no γ
    beats plain decoding there), its τ and predicted speedup."""
    rows = []
    for b in sorted(costs_by_batch):
        rec = choose(acc, costs_by_batch[b])
        rows.append(
            {
                "batch": b,
                "gamma": rec.gamma if rec.worth_it else 0,
                "best_gamma": rec.gamma,
                "speedup": rec.speedup,
                "tau": rec.tau,
                "c": costs_by_batch[b].c,
            }
        )
    return rows


def vllm_ranges(rows: list[dict]) -> list[list[int]]:
    """[[start, end, γ], ...]: each measured batch size's γ from it up to the next size − 1 (the last one
    alone: vLLM carries it on), neighbours with the same γ merged."""
    if not rows or rows[0]["batch"] != 1:
        raise SpecError("a batch-size schedule needs batch size 1 measured", fix="include 1 in --batch-sizes")
    out: list[list[int]] = []
    for row, nxt in zip(rows, rows[1:] + [None]):
        end = row["batch"] if nxt is None else nxt["batch"] - 1
        if out and out[-1][2] == row["gamma"]:
            out[-1][1] = end
        else:
            out.append([row["batch"], end, row["gamma"]])
    return out
