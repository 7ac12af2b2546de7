"""The arithmetic of calibration's layer passes (`--compute-dtype`), and the fp32 that statistics keep.

The float passes over a layer (what each stage's statistics and the next layer's input come from) may run
in TF32 (fp32 tensors, CUDA tensor-core matmuls with a 10-bit mantissa) or bf16 (the layer's weights and
activations cast); everything GPTQ solves on stays fp32 whatever the passes use: the Hessian partials
(`strict_fp32` around their matmul), the Cholesky factor and the column updates (they run outside the
passes). On a CPU only fp32 and bf16 exist: TF32 is a CUDA matmul mode.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

COMPUTE_DTYPES = ("fp32", "tf32", "bf16")
_LAYER_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}


def layer_dtype(compute: str) -> torch.dtype:
    """The dtype a layer's weights and activations have during the passes."""
    return _LAYER_DTYPE[compute]


def _cuda_matmul():
    return torch.backends.cuda.matmul


@contextmanager
def _fp32_precision(value: str):
    m = _cuda_matmul()
    before = m.fp32_precision
    if before == value:
        yield
        return
    m.fp32_precision = value
    try:
        yield
    finally:
        m.fp32_precision = before


@contextmanager
def pass_precision(compute: str, device: torch.device):
    """Around one float pass: CUDA fp32 matmuls in TF32 when compute == 'tf32' (a no-op elsewhere)."""
    if compute != "tf32" or device.type != "cuda":
        yield
        return
    with _fp32_precision("tf32"):
        yield


@contextmanager
def strict_fp32():
    """IEEE fp32 matmuls inside a TF32 pass (GPTQ's Hessian partials); outside one, nothing to change."""
    if _cuda_matmul().fp32_precision != "tf32":
        yield
        return
    with _fp32_precision("ieee"):
        yield


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are native here (CUDA with bf16; x86 with AVX512-BF16 or AMX), so autocast to
    bf16 is faster than fp32 rather than emulated (AVX2-only CPUs: fp32 is faster)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
