"""GGUF K-quants (ops/kquant.py): the block layout checked against gguf-py's own dequantization, and the
block search against the 32-block round-to-nearest types of about the same size."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quants

from fp8ptq.conversion.gguf_mix import decode, encode, tensor_type
from fp8ptq.ops.kquant import BYTES, QMAX, SUB, dequantize_k, pack_k, quantize_k, unpack_k

KINDS = ("Q4_K", "Q5_K", "Q6_K")


def _weight(rows=64, cols=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[:, 5] *= 10  # an outlier column, as real weights have
    w[3, :256] = 0.0  # an all-zero super-block
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_layout_is_gguf_pys(kind):
    w = _weight()
    blocks = quantize_k(kind, w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (64, 2 * BYTES[kind])
    ref = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType[kind]))
    assert torch.equal(dequantize_k(kind, blocks), ref)  # our decoding is gguf-py's, bit for bit
    p = unpack_k(kind, blocks)
    assert int(p["q"].min()) >= 0 and int(p["q"].max()) <= QMAX[kind]
    assert p["scale"].shape == (64, 512 // SUB[kind])
    assert torch.equal(pack_k(kind, p["q"], p["d"], p["sc"], p.get("dmin"), p.get("m")), blocks)
    assert torch.equal(ref[3, :256], torch.zeros(256))  # zeros stay zeros


def test_random_bytes_round_trip():
    """Any bytes decode and re-encode to themselves (every bit of the layout is placed), but the fp16 d/dmin."""
    g = torch.Generator().manual_seed(1)
    for kind in KINDS:
        raw = torch.randint(0, 256, (4, 3 * BYTES[kind]), dtype=torch.uint8, generator=g)
        p = unpack_k(kind, raw)
        again = pack_k(kind, p["q"], p["d"], p["sc"], p.get("dmin"), p.get("m"))
        body = slice(4, None) if kind != "Q6_K" else slice(0, 208)
        a, b = raw.reshape(4, 3, -1)[..., body], again.reshape(4, 3, -1)[..., body]
        assert torch.equal(a, b), kind


def _rel(kind, w):
    data = encode(kind, w)
    return float((decode(kind, data) - w).norm() / w.norm())


def _rel_reference(kind, w):
    """gguf-py's reference quantizer (llama.cpp's `quantize_row_*_ref`: scale from the block's extreme)."""
    t = GGMLQuantizationType[kind]
    back = torch.from_numpy(quants.dequantize(quants.quantize(w.numpy(), t), t))
    return float((back - w).norm() / w.norm())


def test_search_beats_round_to_nearest_of_the_same_bits():
    w = _weight(cols=1024)
    q4k, q5k, q6k = _rel("Q4_K", w), _rel("Q5_K", w), _rel("Q6_K", w)
    # 4.5 bits/weight beats the reference's 5 (Q4_1) and 4.5 (Q4_0)
    assert q4k < _rel_reference("Q4_1", w) < _rel_reference("Q4_0", w)
    assert q5k < _rel_reference("Q5_1", w) and q6k < q5k < q4k
    assert q6k < 0.3 * q4k  # two bits more: about a quarter of the error


def test_importance_moves_error_off_important_columns():
    w = _weight(cols=512)
    imp = torch.ones(512)
    imp[::4] = 50.0  # a quarter of the columns matter 50x
    plain = dequantize_k("Q4_K", quantize_k("Q4_K", w)) - w
    weighted = dequantize_k("Q4_K", quantize_k("Q4_K", w, imp)) - w
    hot = slice(None, None, 4)
    assert weighted[:, hot].pow(2).sum() < 0.8 * plain[:, hot].pow(2).sum()


def test_rows_not_a_multiple_of_256_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k("Q4_K", torch.zeros(2, 576))


def test_mix_is_llama_cpps():
    """Q4_K_M as llama.cpp's llama_tensor_get_type gives it (src/llama-quant.cpp), 32 layers."""
    n = 32
    more = [
        i for i in range(n) if tensor_type("Q4_K_M", f"blk.{i}.ffn_down.weight", (4096, 14336), n, False)[0] == "Q6_K"
    ]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert tensor_type("Q4_K_M", "blk.5.attn_q.weight", (4096, 4096), n, False)[0] == "Q4_K"
    assert tensor_type("Q4_K_M", "blk.2.attn_v.weight", (1024, 4096), n, False)[0] == "Q6_K"
    assert tensor_type("Q4_K_M", "output.weight", (128256, 4096), n, False)[0] == "Q6_K"
    assert tensor_type("Q4_K_M", "token_embd.weight", (128256, 4096), n, False)[0] == "Q4_K"
    assert tensor_type("Q4_K_M", "token_embd.weight", (49152, 576), 30, True) == ("Q8_0", "output")
    t, why = tensor_type("Q4_K_M", "blk.4.attn_q.weight", (576, 576), 30, True)
    assert t == "Q5_0" and "not a multiple of 256" in why  # SmolLM2's rows: llama.cpp's fallback
    assert tensor_type("Q6_K", "blk.4.ffn_down.weight", (576, 1536), 30, True)[0] == "Q6_K"
    assert tensor_type("Q5_K_M", "blk.4.ffn_up.weight", (1536, 576), 30, True)[0] == "Q5_1"
    assert tensor_type("Q8_0", "blk.0.attn_q.weight", (48, 48), 2, True)[0] == "F16"  # not even 32-blocks


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q5_1"])
def test_32_blocks_searched_beat_the_reference_quantizer(kind):
    """gguf-py decodes fp8ptq's 32-blocks (the layout is llama.cpp's) to a closer weight than its own
    reference quantizer (scale from the block's extreme) makes."""
    from fp8ptq.ops.kquant import quantize_block32

    w = _weight(cols=256)
    ours = torch.from_numpy(quants.dequantize(quantize_block32(kind, w).numpy(), GGMLQuantizationType[kind]))
    ref_blocks = quants.quantize(w.numpy(), GGMLQuantizationType[kind])
    ref = torch.from_numpy(quants.dequantize(ref_blocks, GGMLQuantizationType[kind]))
    assert quantize_block32(kind, w).shape == ref_blocks.shape
    weight = w.abs() + w.reshape(64, -1, 32).pow(2).mean(-1, keepdim=True).sqrt().expand(-1, -1, 32).reshape(64, -1)
    err = lambda v: float((weight * (v - w) ** 2).sum())  # noqa: E731 -- the error the search minimises
    assert err(ours) < err(ref) and float((ours - w).norm()) < 1.02 * float((ref - w).norm())


def test_q5_0_is_an_int8_grid_exactly():
    from fp8ptq.ops.ggml import dequantize_groups, unpack_q5_0

    w = _weight(cols=256)
    blocks = quants.quantize(w.numpy(), GGMLQuantizationType.Q5_0)
    codes, scale = unpack_q5_0(torch.from_numpy(blocks))
    assert int(codes.min()) >= -16 and int(codes.max()) <= 15
    ref = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q5_0))
    assert torch.equal(dequantize_groups(codes, scale), ref)


@pytest.mark.parametrize("kind", KINDS)
def test_k_quants_onto_the_int8_grid(kind):
    from fp8ptq.ops.ggml import dequantize_groups
    from fp8ptq.ops.kquant import int8_grid

    w = _weight()
    blocks = quantize_k(kind, w)
    codes, scale = int8_grid(kind, blocks)
    v = dequantize_k(kind, blocks)
    back = dequantize_groups(codes, scale)
    assert not torch.equal(back, v) and int(codes.abs().max()) <= 127
    step = scale.repeat_interleave(32, dim=1)
    assert bool(((back - v).abs() <= step / 2 * (1 + 1e-5)).all())  # within half an INT8 step
    assert float((back - v).norm() / v.norm()) < 0.01 < float((v - w).norm() / w.norm())  # well inside Q*_K's own error
