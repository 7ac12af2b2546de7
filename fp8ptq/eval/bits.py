"""Stored bits per weight of a checkpoint's quantized Linears: the size measure that means the same on any
model (a 262k-token embedding kept float moves a whole-checkpoint size ratio, not this).

Every Linear a compressed-tensors config group targets counts with all it stores for that group (codes,
scales, zero points, global scales, act-order's g_idx, input scales) over its weight's element count; a
targeted Linear stored as plain float counts at its float width. Read from the config and the safetensors
headers only, so it is the same number for fp8ptq's own exports and anyone else's.
"""

from __future__ import annotations

import math

import torch

from fp8ptq.eval.quality import group_scheme_for, read_quantization_config
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import build_skeleton
from fp8ptq.quantization.schemes import stored_tensors


def weight_bits(src: ModelSource) -> float | None:
    """Mean stored bits per weight over the Linears the checkpoint's quantization config targets; None for
    a checkpoint without one, or one whose groups target no Linear."""
    raw = getattr(src.config, "quantization_config", None)
    if raw is None:
        return None
    qcfg = read_quantization_config(src, raw)
    model = build_skeleton(src.config)
    stored = params = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        scheme = group_scheme_for(name, module, qcfg)
        if scheme is None:
            continue
        fmt = getattr(scheme, "format", None) or qcfg.format
        keys = {*stored_tensors(scheme, fmt), "weight", "weight_g_idx"}
        held = [f"{name}.{k}" for k in sorted(keys) if src.has(f"{name}.{k}")]
        if not held:
            continue  # a module the skeleton builds but the checkpoint does not hold (an untied head's twin)
        stored += sum(src.tensor_bytes(n) for n in held)
        params += math.prod(module.weight.shape)
    src.close()
    return 8 * stored / params if params else None
