"""What quantizing one decoder layer produces: read by export (writer) and made by calibration or the
data-free path, so both import it from here (below both)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp8ptq.quantization.schemes import LinearScheme


@dataclass
class QuantizedLinear:
    """One Linear's result: fake-quant weight (fp32, on its grid), export params and scheme."""

    weight: torch.Tensor
    params: dict[str, torch.Tensor]  # weight_scale [, weight_zero_point] [, input_scale]
    scheme: LinearScheme
    report: dict


@dataclass
class LayerResult:
    index: int
    prefix: str
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)  # full module name -> result
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # full tensor name -> scale
    float_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # changed by transforms, kept float
    # module name -> (its checkpoint tensors, already in compressed-tensors form; report): data-free FP8
    packed: dict[str, tuple[dict[str, torch.Tensor], dict]] = field(default_factory=dict)
    report: dict = field(default_factory=dict)
