"""`convert --to gguf --gguf-type T`: which GGML type each matrix gets, and its blocks.

The mixes are llama.cpp's own (`llama_tensor_get_type_impl` and `tensor_type_fallback` in
src/llama-quant.cpp of the llama.cpp vendored by llama-cpp-python 0.3.36), for the dense families fp8ptq
writes to GGUF (llama, mistral, qwen2, qwen3, gemma3):
  default        Q4_K_M -> Q4_K, Q5_K_M -> Q5_K, Q6_K / Q8_0 / Q4_0 -> themselves
  output         (and token_embd when the embedding is tied): Q8_0 when its rows are not a multiple of the
                 default type's block, else Q6_K (Q8_0 stays Q8_0)
  attn_v         Q4_K_M, Q5_K_M: Q6_K in the layers `use_more_bits` picks (the first and last eighth, and
  ffn_down       every third in between)
  attn_qkv       (fused) Q4_K_M -> Q5_K, Q5_K_M -> Q6_K
  fallback       a row length that is not a multiple of 256: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0
                 (and F16 when not a multiple of 32) -- SmolLM2's 576-wide rows take this path
Vectors (norms, biases) are F32 as llama.cpp writes them.

Blocks: Q4_K / Q5_K / Q6_K by fp8ptq's search (ops/kquant.py), Q4_0 / Q5_0 / Q5_1 by the same
scan per 32-block (ops/kquant.py `quantize_block32`; llama.cpp's reference sets the scale from the block's
extreme), Q8_0 by gguf-py's reference quantizer (`gguf.quants.quantize`).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from fp8ptq.errors import OptionError
from fp8ptq.ops.kquant import K_TYPES

FTYPES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0", "Q4_0": "Q4_0"}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def check_ftype(ftype: str) -> None:
    if ftype not in FTYPES:
        raise OptionError(f"unknown --gguf-type '{ftype}'", fix=f"use one of: {', '.join(FTYPES)}")


def block_size(ggml_type: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][0]


def nbytes(ggml_type: str, shape) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return int(np.prod(shape)) // block * size


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(ftype: str, gguf_name: str, shape, n_layers: int, tied: bool) -> tuple[str, str]:
    """(GGML type, why when not the default) of a 2-D weight `gguf_name` [rows, cols] under `ftype`."""
    new = FTYPES[ftype]
    cols = shape[-1]
    why = ""
    m = _LAYER.match(gguf_name)
    layer = int(m.group(1)) if m else -1
    if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
        new = "Q8_0" if cols % block_size(new) else new if new == "Q8_0" else "Q6_K"
        why = "output"
    elif ftype in ("Q4_K_M", "Q5_K_M") and (".attn_v." in gguf_name or ".ffn_down." in gguf_name):
        if _more_bits(layer, n_layers):
            new, why = "Q6_K", "more bits (use_more_bits)"
    elif ".attn_qkv." in gguf_name and ftype in ("Q4_K_M", "Q5_K_M"):
        new, why = {"Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}[ftype], "fused qkv"
    if cols % block_size(new):
        fallback = FALLBACK.get(new, new)
        if cols % block_size(fallback):
            fallback = "F16"
        why = f"{why + '; ' if why else ''}rows of {cols} not a multiple of {block_size(new)}: {new} -> {fallback}"
        new = fallback
    return new, why


def encode(ggml_type: str, weight: torch.Tensor, importance: torch.Tensor | None = None) -> np.ndarray:
    """weight [rows, cols] (GGUF row order) -> the GGUF bytes [rows, cols / block * type size] uint8."""
    if ggml_type in K_TYPES:
        from fp8ptq.ops.kquant import quantize_k

        return quantize_k(ggml_type, weight, importance).numpy()
    if ggml_type in ("Q4_0", "Q5_0", "Q5_1"):
        from fp8ptq.ops.kquant import quantize_block32

        return quantize_block32(ggml_type, weight, importance).numpy()
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(weight.float().numpy(), GGMLQuantizationType[ggml_type])


def decode(ggml_type: str, data: np.ndarray) -> torch.Tensor:
    """The GGUF bytes of `encode` -> fp32 [rows, cols], as gguf-py dequantizes them."""
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[ggml_type]).astype(np.float32))
