"""Per-tensor symmetric grids for static activation and KV scales: the largest code and a fake-quant.

Observers (calibrate/observers.py) choose a scale against a grid; the engine's static input and KV
quantizers apply one. x ~= q * scale, scale = amax / qmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fp8ptq.ops.fp4 import FP4_MAX, fake_quant_nvfp4_act
from fp8ptq.ops.fp8 import FP8_MAX, MIN_SCALE, fake_quant_fp8
from fp8ptq.ops.granularity import TENSOR
from fp8ptq.ops.intq import fake_quant_int


@dataclass(frozen=True)
class Grid:
    """A per-tensor symmetric quantization grid: largest code and fake-quant(x, scale)."""

    name: str
    qmax: float
    fake_quant: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    pow2: bool = False  # scales rounded up to a power of two (a reciprocal stored exactly: NVFP4's divisor)

    def scale(self, amax: float | torch.Tensor) -> torch.Tensor:
        a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
        s = (a / self.qmax).clamp_min(MIN_SCALE)
        return torch.exp2(torch.ceil(torch.log2(s))) if self.pow2 else s


FP8_GRID = Grid("fp8", FP8_MAX, lambda x, s: fake_quant_fp8(x, s, TENSOR))
# NVFP4 activations: the per-tensor scale maps amax to 448 * 6 (FP8 group scale max x FP4 max); the
# checkpoint stores its reciprocal (input_global_scale), exact for a power of two.
NVFP4_ACT_GRID = Grid("nvfp4", FP8_MAX * FP4_MAX, fake_quant_nvfp4_act, pow2=True)
INT8_GRID = Grid("int8", 127.0, lambda x, s: fake_quant_int(x, s, None, TENSOR, 8))
