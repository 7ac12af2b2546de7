"""Observers: turn activation statistics into a static per-tensor scale. Registry: name -> function.

An observer reads an `ActStats` (outliers/stats.py, the one statistics code path) and a grid (FP8 or
INT8: its max code and its fake-quant function), and returns the scale (x ~= q * scale).

minmax:   scale = amax / qmax (nothing clipped).
mse:      adaptive search over clip ratios r in [0.5, 1]: scale = r * amax / qmax minimising the
          reconstruction MSE ||fq(x) - x||^2 on the statistics' row subsample.
constant: scale = 1.0 whatever the data (KV caches only): what vLLM uses for a checkpoint that carries
          no KV scales and what ModelOpt writes by default; the statistics still report amax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fp8ptq.ops.grid import Grid
from fp8ptq.outliers.stats import ActStats, StatsSpec


@dataclass(frozen=True)
class ScaleChoice:
    scale: torch.Tensor  # [1] fp32
    amax: float
    clip_ratio: float  # scale * qmax / amax; 1.0 means nothing clipped


OBSERVERS: dict[str, Callable[[ActStats, Grid], ScaleChoice]] = {}
# What each observer needs collected during calibration.
OBSERVER_STATS: dict[str, StatsSpec] = {}


def observer(name: str, needs: StatsSpec = StatsSpec()):
    def register(fn):
        assert name not in OBSERVERS, name
        OBSERVERS[name] = fn
        OBSERVER_STATS[name] = needs
        return fn

    return register


@observer("minmax")
def minmax(stats: ActStats, grid: Grid) -> ScaleChoice:
    amax = stats.amax
    return ScaleChoice(grid.scale(amax), amax, 1.0)


@observer("mse", needs=StatsSpec(rows=16384))
def mse(stats: ActStats, grid: Grid, ratios: torch.Tensor | None = None) -> ScaleChoice:
    amax = stats.amax
    rows = stats.rows
    assert rows is not None, "mse observer needs a row subsample (StatsSpec.rows)"
    ratios = torch.linspace(0.5, 1.0, 26) if ratios is None else ratios
    best, best_err = 1.0, float("inf")
    for r in ratios.tolist():
        s = grid.scale(amax * r)
        err = float((grid.fake_quant(rows, s) - rows).pow(2).mean())
        if err < best_err:
            best, best_err = r, err
    return ScaleChoice(grid.scale(amax * best), amax, best)


@observer("constant")
def constant(stats: ActStats, grid: Grid) -> ScaleChoice:
    amax = stats.amax
    return ScaleChoice(torch.ones(1, dtype=torch.float32), amax, grid.qmax / amax if amax > 0 else 1.0)
