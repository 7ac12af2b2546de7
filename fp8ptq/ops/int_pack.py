"""The int32 packings of GPTQ and AWQ checkpoints, unpacked to unsigned integer codes (docs/formats.md).

GPTQ (AutoGPTQ 0.7 / GPTQModel 2.x `pack`, read by vLLM 0.32 `auto_gptq.py`): `qweight` int32 [in/k, out]
holds k = 32/bits codes of consecutive input rows per word, row i*k+j at bits [j*bits, (j+1)*bits);
`qzeros` int32 [groups, out/k] packs k output columns per word the same way.
AWQ (AutoAWQ 0.2 GEMM, vLLM 0.32 `auto_awq.py`): `qweight` int32 [in, out/8] and `qzeros` [groups, out/8]
pack 8 output columns per word in the order [0, 2, 4, 6, 1, 3, 5, 7]: the nibble at position p holds
column AWQ_ORDER[p], so column j is at position AWQ_REVERSE[j] = [0, 4, 1, 5, 2, 6, 3, 7][j].
"""

from __future__ import annotations

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE = [AWQ_ORDER.index(j) for j in range(8)]


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> its 32/bits unsigned fields [R, C, 32/bits] (int32, low bits first)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed along dim 0 (GPTQ qweight): [R, C] -> [R * 32/bits, C]."""
    f = _fields(words, bits)
    return f.permute(0, 2, 1).reshape(-1, words.shape[1])


def unpack_cols(words: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Packed along dim 1 (GPTQ qzeros; AWQ qweight/qzeros with order=AWQ_REVERSE): [R, C] -> [R, C * 32/bits]."""
    f = _fields(words, bits)
    if order is not None:
        f = f[..., order]
    return f.reshape(words.shape[0], -1)


def trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """True when every input column i is in group i // group_size (no act-order reordering)."""
    want = torch.arange(g_idx.numel()) // group_size
    return bool(torch.equal(g_idx.long(), want))
