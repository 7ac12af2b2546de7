"""Tier 3: GGUF <-> compressed-tensors on the real SmolLM2-135M-Instruct.

The packaged GGUF is Q4_1 (not a symmetric grid) with a Q8_0 embedding, so the exact path is shown on a
Q4_0 GGUF of the same model written here with gguf-py's own quantizer (what llama.cpp's `quantize` makes
for Q4_0), and the packaged file shows the re-quantize path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8ptq.api import ConvertConfig, EvalConfig, convert, evaluate_quality
from fp8ptq.models.gguf_files import alias_gguf

from helpers import read_config

pytestmark = pytest.mark.slow


def test_real_q4_0_gguf_to_ct_and_back_is_exact(smol_q4_0, tmp_path):
    from gguf import GGUFReader

    gguf, ct, report = smol_q4_0  # conftest: the GGUF and its conversion, shared with test_convert_vllm.py
    s = report.summary
    assert (s["exact"], s["exact_int4"], s["dequantized"]) == (210, 210, 1), s  # the Q8_0 embedding: bf16
    assert read_config(ct)["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    # the same numbers as transformers' dequantization of the GGUF (in bf16, as `convert --to hf` writes it)
    q = evaluate_quality(EvalConfig(model=str(ct), reference=str(gguf), num_samples=2, seq_len=128))
    assert q.kl < 1e-3 and q.top1 > 0.98, q
    back = tmp_path / "back.gguf"
    report = convert(ConvertConfig(source=ct, output=back, to="gguf"))
    assert report.summary["exact_q4_0"] == 210 and report.summary["worst_scale_fp16_rel_err"] == 0.0
    a = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    same = sum(
        np.array_equal(np.asarray(t.data), np.asarray(a[t.name].data))
        for t in GGUFReader(str(back)).tensors
        if t.tensor_type.name == "Q4_0"
    )
    assert same == 210


def test_real_q4_1_gguf_is_requantized_with_a_recipe(tmp_path):
    report = convert(
        ConvertConfig(
            source=alias_gguf("smollm2-135m"), output=tmp_path / "fp8", to="compressed-tensors", recipe="fp8-dynamic"
        )
    )
    s = report.summary
    assert (s["exact"], s["requantized"]) == (0, 210), s
    assert 0 < s["worst_requantized_rel_err"] < 0.1, s
    kinds = {r["gguf_type"] for r in report.tensors if r["action"] == "requantized"}
    assert kinds == {"Q4_1"}
    q = evaluate_quality(EvalConfig(model=str(tmp_path / "fp8"), reference="smollm2-135m", num_samples=2, seq_len=128))
    assert q.kl < 0.1, q  # FP8-dynamic of the dequantized Q4_1 weights vs those weights
    assert torch.isfinite(torch.tensor(q.kl))


def test_real_w4a16_gguf_recipe_to_gguf_keeps_quality(tmp_path, recipe_export):
    """quantize -r w4a16-gguf (the recipe test's run, conftest.recipe_export), convert --to gguf:
    transformers reads the GGUF back and its KL to the float model equals the checkpoint's simulated KL
    within 2% (the codes are the same; only the scales are rounded to fp16 and the GGUF goes through
    transformers' bf16 dequantization)."""
    ct, gguf = recipe_export("w4a16-gguf")[0], tmp_path / "smol.Q4_0.gguf"
    report = convert(ConvertConfig(source=ct, output=gguf, to="gguf"))
    s = report.summary
    assert (s["exact"], s["exact_q4_0"], s["dequantized"]) == (210, 210, 0), s
    assert s["worst_scale_fp16_rel_err"] <= 2**-11, s  # 0 measured: fp8ptq stores bf16-valued scales
    # 2 x 128 tokens, as the other conversions here: measured relative differences 0.31% (2 x 128), 0.08%
    # (4 x 256) against the 2% allowed; the time is mostly transformers reading the GGUF, not the tokens
    q_ct = evaluate_quality(EvalConfig(model=str(ct), reference="smollm2-135m", num_samples=2, seq_len=128))
    q_gguf = evaluate_quality(EvalConfig(model=str(gguf), reference="smollm2-135m", num_samples=2, seq_len=128))
    assert abs(q_gguf.kl - q_ct.kl) <= 0.02 * q_ct.kl, (q_ct.kl, q_gguf.kl)
