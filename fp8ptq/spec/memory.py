"""Memory plan for serving with and without speculation (SpecMemo's question: what fits?).

Pure arithmetic over numbers read from checkpoint headers (no tensor is loaded):
- weights: the sum of every tensor's bytes in the safetensors files (read from the headers);
- KV cache per token: 2 (K and V) · layers · kv_heads · head_dim · bytes of the KV dtype (scales are
  per tensor/layer: negligible);
- with speculation, the draft's weights and its own KV cache for the same tokens, and γ extra KV
  slots per sequence in both caches (the drafted tokens the target verifies).
The usable budget is device memory × utilization (vLLM's --gpu-memory-utilization, default 0.9) minus
a fixed activation/workspace reserve; what is left after weights holds the KV cache.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from fp8ptq.spec import SpecError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
KV_BYTES = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


def parse_size(text: str | int) -> int:
    """'24GiB', '80GB', '1.5 TiB', '512MiB', or a plain number of bytes -> bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise SpecError(
            f"cannot read the memory size '{text}'", fix="write e.g. 24GiB, 80GB, 512MiB or a number of bytes"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise SpecError(f"memory size '{text}' is not positive", fix="pass a positive size such as 24GiB")
    return int(value)


def safetensors_bytes(model_dir: Path) -> int:
    """Bytes of all tensors in a directory's *.safetensors files, from their headers only."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SpecError(f"'{model_dir}' has no *.safetensors files", fix="pass a Hugging Face model directory")
    total = 0
    for f in files:
        with open(f, "rb") as h:
            (n,) = struct.unpack("<Q", h.read(8))
            header = json.loads(h.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                total += info["data_offsets"][1] - info["data_offsets"][0]
    return total


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know about one model."""

    weight_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str  # a key of KV_BYTES

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.kv_dtype)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    if kv_dtype not in KV_BYTES:
        raise SpecError(f"unknown KV cache dtype '{kv_dtype}'", fix=f"use one of {', '.join(sorted(KV_BYTES))}")
    return 2 * layers * kv_heads * head_dim * KV_BYTES[kv_dtype]


def draft_shape(draft: str | None, kv_dtype: str = "auto") -> ModelShape | None:
    """The draft's shape, as model_shape reads it; None where speculation adds no draft weights of its own
    (no draft; n-gram, suffix and MTP: the proposer's `model_free`)."""
    from fp8ptq.spec.proposers import proposer_class

    if draft is None or proposer_class(draft).model_free:
        return None
    from fp8ptq.models.loader import resolve_model

    return model_shape(resolve_model(draft).path, kv_dtype)


def model_shape(model_dir: Path, kv_dtype: str = "auto") -> ModelShape:
    """Read config.json + safetensors headers. kv_dtype 'auto': fp8 if the checkpoint carries a
    kv_cache_scheme, else the config's torch dtype (bf16 when absent)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if kv_dtype == "auto":
        qc = cfg.get("quantization_config") or {}
        kv_dtype = "fp8" if qc.get("kv_cache_scheme") else str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelShape(
        safetensors_bytes(model_dir),
        cfg["num_hidden_layers"],
        cfg.get("num_key_value_heads", heads),
        head_dim,
        kv_dtype,
    )


@dataclass(frozen=True)
class MemoryPlan:
    device_bytes: int
    usable_bytes: int  # device × utilization − reserve
    target_weight_bytes: int
    draft_weight_bytes: int
    target_kv_per_token: int
    draft_kv_per_token: int
    gamma: int
    context: int
    batch: int
    # what the requested (context, batch) needs, and whether it fits
    need_plain: int
    need_spec: int
    fits_plain: bool
    fits_spec: bool
    # the largest context at `batch`, and the largest batch at `context` (0 = not even one)
    max_context_plain: int
    max_context_spec: int
    max_batch_plain: int
    max_batch_spec: int

    def as_dict(self) -> dict:
        return asdict(self)


def plan(
    target: ModelShape,
    draft: ModelShape | None,
    device_bytes: int,
    *,
    context: int,
    batch: int,
    gamma: int,
    utilization: float = 0.9,
    reserve_bytes: int = 0,
) -> MemoryPlan:
    """Bytes needed for `batch` sequences of `context` tokens, plain and with speculation, and the
    largest context / batch that fit. With speculation each sequence holds context + γ tokens in the
    target's cache and in the draft's."""
    if not 0 < utilization <= 1:
        raise SpecError(f"utilization {utilization} is not in (0, 1]", fix="pass e.g. 0.9")
    if context < 1 or batch < 1:
        raise SpecError(f"context {context} and batch {batch} must be ≥ 1", fix="pass positive numbers")
    if draft is not None and gamma < 1:
        raise SpecError(f"--gamma {gamma} must be ≥ 1 (draft tokens per step)", fix="pass e.g. --gamma 4")
    usable = int(device_bytes * utilization) - reserve_bytes
    t_kv = target.kv_bytes_per_token()
    d_w = draft.weight_bytes if draft else 0
    d_kv = draft.kv_bytes_per_token() if draft else 0
    g = gamma if draft else 0
    need_plain = target.weight_bytes + batch * context * t_kv
    need_spec = target.weight_bytes + d_w + batch * (context + g) * (t_kv + d_kv)
    kv_room_plain = usable - target.weight_bytes
    kv_room_spec = usable - target.weight_bytes - d_w
    tokens_plain = max(kv_room_plain, 0) // t_kv
    tokens_spec = max(kv_room_spec, 0) // (t_kv + d_kv)
    return MemoryPlan(
        device_bytes=device_bytes,
        usable_bytes=usable,
        target_weight_bytes=target.weight_bytes,
        draft_weight_bytes=d_w,
        target_kv_per_token=t_kv,
        draft_kv_per_token=d_kv,
        gamma=g,
        context=context,
        batch=batch,
        need_plain=need_plain,
        need_spec=need_spec,
        fits_plain=need_plain <= usable,
        fits_spec=need_spec <= usable,
        max_context_plain=max(tokens_plain // batch, 0),
        max_context_spec=max(tokens_spec // batch - g, 0),
        max_batch_plain=tokens_plain // context,
        max_batch_spec=tokens_spec // (context + g),
    )
