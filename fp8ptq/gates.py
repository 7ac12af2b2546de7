"""Quality gates: `kl<=0.05`, `top1>=0.9`, `mmlu_pro_delta>=-1.0` — checked against a run's metrics.

A gate is METRIC OP THRESHOLD with OP one of <=, >=, <, >. Metric names and units (documented in
README and docs/ci.md):

  kl                      mean KL(reference || quantized) per token, nats
  top1                    top-1 next-token agreement with the reference, fraction 0..1
  ppl                     perplexity of the quantized model on the held-out split
  ppl_ratio               ppl / ppl of the reference
  size_ratio              output bytes / source bytes (all tensors: a large float embedding moves it)
  weight_bits             stored bits per weight of the quantized Linears, scales included (the same on
                          any model: FP8 ~8.0, INT4 group 64 with bf16 scales ~4.25)
  worst_linear_rel_err    largest per-Linear relative output error seen in calibration
  <task>                  an lm-eval task's score, percent (e.g. mmlu_pro)
  <task>_delta            that score minus the baseline's, percentage points
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

from fp8ptq.errors import RecipeError

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
_GATE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    value: float | None  # None: the run did not produce this metric
    passed: bool

    @property
    def margin(self) -> float | None:
        """How far inside (+) or outside (-) the threshold the value is, in the metric's units."""
        if self.value is None:
            return None
        diff = self.value - self.gate.threshold
        return -diff if self.gate.op in ("<=", "<") else diff

    def describe(self) -> str:
        if self.value is None:
            return f"{self.gate}: FAILED (the run produced no '{self.gate.metric}')"
        verdict = "passed" if self.passed else "FAILED"
        return f"{self.gate}: {verdict}, {self.gate.metric} = {self.value:.6g} (margin {self.margin:+.4g})"

    @classmethod
    def from_dict(cls, d: dict) -> GateResult:
        return cls(Gate(d["metric"], d["op"], d["threshold"]), d["value"], d["passed"])

    def as_dict(self) -> dict:
        return {
            "gate": str(self.gate),
            "metric": self.gate.metric,
            "op": self.gate.op,
            "threshold": self.gate.threshold,
            "value": self.value,
            "passed": self.passed,
            "margin": self.margin,
        }


def parse_gate(text: str) -> Gate:
    m = _GATE.match(text)
    if not m:
        raise RecipeError(
            f"gate '{text}' is not METRIC OP NUMBER",
            fix="write e.g. 'kl<=0.05', 'top1>=0.9' or 'mmlu_pro_delta>=-1.0' (ops: <=, >=, <, >)",
        )
    threshold = float(m.group(3))
    if not math.isfinite(threshold):  # 1e999 reads as inf: a gate that can never fail
        raise RecipeError(f"gate '{text}': the threshold is not a finite number", fix="write a finite threshold")
    return Gate(m.group(1), m.group(2), threshold)


def parse_gates(texts) -> list[Gate]:
    return [parse_gate(t) for t in texts]


def check(gates: list[Gate], metrics: dict[str, float]) -> list[GateResult]:
    """Evaluate every gate. A gate whose metric is missing (or NaN) fails: a gate never passes silently."""
    results = []
    for g in gates:
        value = metrics.get(g.metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            results.append(GateResult(g, None, False))
        else:
            results.append(GateResult(g, float(value), bool(_OPS[g.op](float(value), g.threshold))))
    return results


QUALITY_METRICS = ("kl", "top1", "ppl", "ppl_ratio")  # need the quality check
QUANTIZE_METRICS = QUALITY_METRICS + (
    "size_ratio",
    "weight_bits",
    "worst_linear_rel_err",
)  # what Manifest.metrics() can produce
EVAL_METRICS = QUALITY_METRICS + ("size_ratio", "weight_bits")  # `eval quality` on an existing checkpoint


def check_task_gates(gates: list[Gate], tasks) -> None:
    """Refuse, before a (long) lm-eval run, a gate that run cannot produce."""
    for g in gates:
        if not any(g.metric == t or g.metric.startswith(t + "_") for t in tasks):
            raise RecipeError(
                f"gate '{g}': this evaluation produces no '{g.metric}'",
                fix=f"gate on {', '.join(f'{t}, {t}_delta' for t in tasks)} (or a {tasks[0]}_<subtask>)",
            )
