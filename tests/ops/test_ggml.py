"""GGUF Q4_0 / Q8_0 blocks <-> integer codes and scales, checked against gguf-py's own (de)quantizers,
and llama.cpp's q/k row permutation against transformers' inverse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8ptq.ops.ggml import dequantize_groups, pack_q4_0, pack_q8_0, permute_qk, unpack_q4_0, unpack_q8_0


def _weights(rows=6, cols=96, seed=0) -> np.ndarray:
    g = np.random.default_rng(seed)
    w = g.standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (d = 0)
    w[1, 40] = 50.0  # an outlier block
    w[2, :32] = -np.abs(w[2, :32])  # a block whose extreme is negative (Q4_0's d > 0); others d < 0
    return w


@pytest.mark.parametrize("qtype, unpack, pack", [("Q4_0", unpack_q4_0, pack_q4_0), ("Q8_0", unpack_q8_0, pack_q8_0)])
def test_codes_reproduce_gguf(qtype, unpack, pack):
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[qtype]
    blocks = quants.quantize(_weights(), t)
    codes, scale = unpack(torch.from_numpy(blocks))
    assert codes.dtype == torch.int8 and scale.shape == (6, 3)
    lo, hi = (-8, 7) if qtype == "Q4_0" else (-127, 127)
    assert int(codes.min()) >= lo and int(codes.max()) <= hi
    # the codes times the scales are gguf's dequantization, bit for bit
    assert torch.equal(dequantize_groups(codes, scale), torch.from_numpy(quants.dequantize(blocks, t)))
    # and pack back to the same bytes
    assert np.array_equal(pack(codes, scale).numpy(), blocks)
    if qtype == "Q4_0":  # d is signed in Q4_0
        assert bool((scale < 0).any()) and bool((scale > 0).any())


def test_permutation_is_undone_by_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    for heads, kv in ((4, 4), (4, 2)):
        w = torch.arange(kv * 8 * 3).reshape(kv * 8, 3)  # head_dim 8
        rows = permute_qk(w, kv)
        assert not torch.equal(rows, w)
        proc = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv})
        name = "blk.0.attn_k.weight" if kv != heads else "blk.0.attn_q.weight"
        back = proc.process(weights=rows.numpy(), name=name).weights
        assert np.array_equal(back, w.numpy())
