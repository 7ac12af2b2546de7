"""GGUF's two symmetric block formats as integer codes and scales, and llama.cpp's q/k row permutation.

Q4_0 and Q8_0 (ggml-common.h, gguf-py 0.19 `gguf.quants`): a row of `in` weights is cut into blocks
of 32 consecutive weights; a block is an fp16 scale d followed by its codes.
  Q4_0: 18 bytes = d + 16 bytes of nibbles; byte j holds weight j (low nibble) and weight j+16 (high
        nibble); value = d * (nibble - 8), so the signed code q = nibble - 8 is in [-8, 7].
  Q8_0: 34 bytes = d + 32 int8 codes; value = d * q, q in [-127, 127].
Both are symmetric integer grids with group size 32: the same numbers as compressed-tensors' INT4 /
INT8 `strategy: group, group_size: 32, symmetric: true` with weight_scale = d. d is signed (ggml's
Q4_0 quantizer sets d = max / -8 with the block's extreme value, sign included); the codes and d are
carried as they are, so d * q is reproduced exactly (fp16 d times a small integer is exact in fp32).

Everything here works on torch tensors of rows: blocks [rows, n_blocks * block_bytes] uint8 <->
codes [rows, n_blocks * 32] int8 and scales [rows, n_blocks] fp32.
"""

from __future__ import annotations

import torch

BLOCK = 32
Q4_0_BYTES = 2 + BLOCK // 2
Q8_0_BYTES = 2 + BLOCK
Q5_0_BYTES = 2 + 4 + BLOCK // 2  # d, 32 fifth bits, nibbles


def _split(blocks: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, nb * nbytes] uint8 -> (d fp32 [rows, nb], payload uint8 [rows, nb, nbytes - 2])."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, nbytes)
    d = b[..., :2].contiguous().view(torch.float16).reshape(rows, -1).float()
    return d, b[..., 2:]


def f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[...] float -> [..., 2] uint8: each value as little-endian fp16 (GGUF's d, dmin, m)."""
    return x.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def _join(d: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    rows = payload.shape[0]
    return torch.cat([f16_bytes(d.reshape(rows, -1)), payload], dim=-1).reshape(rows, -1)


def nibbles(u: torch.Tensor) -> torch.Tensor:
    """[..., 32] values in [0, 15] -> [..., 16] uint8: byte j = value j (low nibble), value j + 16 (high)."""
    u = u.to(torch.int64)
    return (u[..., : BLOCK // 2] | (u[..., BLOCK // 2 :] << 4)).to(torch.uint8)


def unpack_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 rows -> (codes int8 in [-8, 7] [rows, in], scale fp32 [rows, in/32])."""
    d, qs = _split(blocks, Q4_0_BYTES)
    lo, hi = qs & 0x0F, qs >> 4
    codes = torch.cat([lo, hi], dim=-1).to(torch.int8) - 8  # weights 0..15 then 16..31 of each block
    return codes.reshape(blocks.shape[0], -1), d


def pack_q4_0(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(codes int in [-8, 7] [rows, in], scale [rows, in/32], exactly fp16-representable) -> Q4_0 rows."""
    rows = codes.shape[0]
    u = (codes.to(torch.int16) + 8).reshape(rows, -1, BLOCK)
    return _join(scale, nibbles(u))


def unpack_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> (codes int8 [rows, in], scale fp32 [rows, in/32])."""
    d, qs = _split(blocks, Q8_0_BYTES)
    return qs.contiguous().view(torch.int8).reshape(blocks.shape[0], -1), d


def pack_q8_0(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(codes int in [-128, 127] [rows, in], scale [rows, in/32]) -> Q8_0 rows."""
    rows = codes.shape[0]
    qs = codes.to(torch.int8).reshape(rows, -1, BLOCK).view(torch.uint8)
    return _join(scale, qs)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """codes [rows, in] * scale [rows, in/group] -> fp32 [rows, in] (what gguf's dequantize computes)."""
    rows = codes.shape[0]
    return (codes.float().reshape(rows, -1, group) * scale.float().reshape(rows, -1, 1)).reshape(rows, -1)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF row order of q_proj / k_proj (rows = n_head * head_dim) -> llama.cpp's (its convert_hf_to_gguf.py
    `LlamaModel.permute`: per head, rows [0, d/2) and [d/2, d) interleaved for its RoPE). Works on codes,
    scales or weights alike: only rows move."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpack_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 rows (22 bytes per 32: d fp16, 4 bytes of fifth bits, 16 bytes of nibbles; value = d * (q - 16))
    -> (codes int8 in [-16, 15] [rows, in], scale fp32 [rows, in/32]): an INT8 group-32 grid, exactly."""
    d, rest = _split(blocks, Q5_0_BYTES)
    qh = rest[..., :4].to(torch.int64)
    bits = (qh << (8 * torch.arange(4))).sum(-1, keepdim=True)  # one little-endian uint32 per block
    qs = rest[..., 4:].to(torch.int64)
    lo = torch.cat([qs & 15, qs >> 4], dim=-1)
    q = lo | (((bits >> torch.arange(BLOCK)) & 1) << 4)
    return (q - 16).to(torch.int8).reshape(blocks.shape[0], -1), d
