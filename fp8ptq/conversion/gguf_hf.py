"""GGUF -> Hugging Face safetensors, every tensor dequantized to `--dtype` by transformers' own GGUF
reader (the converter `fp8ptq quantize MODEL.gguf` also uses, through models/loader.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from fp8ptq.models.gguf import check_gguf
from fp8ptq.models.gguf_files import write_gguf_as_hf


def check(cfg, fmt: str) -> None:
    check_gguf(cfg.source)  # a supported architecture, every tensor its metadata builds present and in shape


def write(cfg, fmt: str, checked: None, tmp: Path) -> dict:
    write_gguf_as_hf(cfg.source, tmp, getattr(torch, cfg.dtype))
    return {}


def describe(report: dict) -> str:
    return ""
