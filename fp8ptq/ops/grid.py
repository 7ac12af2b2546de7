"""Per-tensor symmetric grids for static activation and KV scales: the largest code and a fake-quant.

Observers (calibrate/observers.py) choose a scale against a grid; the engine's static input and KV
quantizers apply one. x ~= q * scale, scale = amax / qmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fp8ptq.ops.fp8 import FP8_MAX, MIN_SCALE, fake_quant_fp8
from fp8ptq.ops.granularity import TENSOR
from fp8ptq.ops.intq import fake_quant_int


@dataclass(frozen=True)
class Grid:
    """A per-tensor symmetric quantization grid: largest code and fake-quant(x, scale)."""

    name: str
    qmax: float
    fake_quant: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def scale(self, amax: float | torch.Tensor) -> torch.Tensor:
        a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
        return (a / self.qmax).clamp_min(MIN_SCALE)


FP8_GRID = Grid("fp8", FP8_MAX, lambda x, s: fake_quant_fp8(x, s, TENSOR))
INT8_GRID = Grid("int8", 127.0, lambda x, s: fake_quant_int(x, s, None, TENSOR, 8))
