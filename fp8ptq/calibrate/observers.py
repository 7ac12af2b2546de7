"""Observers: turn an observed tensor into a per-tensor FP8 scale. Registry: name -> function.

minmax: scale = amax / 448 (nothing clipped).
mse:    adaptive search over clip ratios r in [0.5, 1]; scale = r * amax / 448 minimising the
        reconstruction MSE ||fq(x) - x||^2 on up to `max_rows` rows (deterministic subsample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fp8ptq.ops.fp8 import fake_quant_fp8, scale_from_amax
from fp8ptq.ops.granularity import TENSOR, reduce_amax


@dataclass(frozen=True)
class ScaleChoice:
    scale: torch.Tensor  # [1] fp32
    amax: float
    clip_ratio: float  # scale * 448 / amax; 1.0 means nothing clipped


OBSERVERS: dict[str, Callable[[torch.Tensor], ScaleChoice]] = {}


def observer(name: str):
    def register(fn):
        assert name not in OBSERVERS, name
        OBSERVERS[name] = fn
        return fn

    return register


@observer("minmax")
def minmax(x: torch.Tensor) -> ScaleChoice:
    amax = reduce_amax(x, TENSOR)
    return ScaleChoice(scale_from_amax(amax), float(amax), 1.0)


@observer("mse")
def mse(x: torch.Tensor, ratios: torch.Tensor | None = None, max_rows: int = 16384) -> ScaleChoice:
    amax = reduce_amax(x, TENSOR)
    rows = x.reshape(-1, x.shape[-1]).float()
    if rows.shape[0] > max_rows:
        step = rows.shape[0] // max_rows
        rows = rows[::step][:max_rows]
    ratios = torch.linspace(0.5, 1.0, 26) if ratios is None else ratios
    best, best_err = 1.0, float("inf")
    for r in ratios.tolist():
        s = scale_from_amax(amax * r)
        err = float((fake_quant_fp8(rows, s, TENSOR) - rows).pow(2).mean())
        if err < best_err:
            best, best_err = r, err
    return ScaleChoice(scale_from_amax(amax * best), float(amax), best)
