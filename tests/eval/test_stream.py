"""Streaming evaluation (one decoder layer at a time) gives the whole-model evaluator's numbers."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.data import load_samples
from fp8ptq.eval.quality import compare, load_simulated
from fp8ptq.eval.stream import compare_streaming
from fp8ptq.models.loader import open_hf_dir

pytestmark = pytest.mark.tiny

# (family, recipe, extra config): input quantizers static and dynamic, FP8 and INT8, the KV cache,
# Gemma's scaled embeddings / sliding layers / logit soft-cap, per-expert Linears, MLA.
CASES = [
    ("llama", "fp8-kv8", {}),
    ("gemma3_text", "fp8-kv8", {"final_logit_softcapping": 30.0}),
    ("qwen3_moe", "fp8-kv8", {}),
    ("deepseek_v3", "w8a8-int8", {}),
    ("phi3", "w4a16-kv8", {}),
]


def _quantized(tmp_path, src, recipe):
    out = tmp_path / recipe
    quantize(QuantizeConfig(model=str(src), recipe=recipe, output=out, num_samples=4, seq_len=48, eval_samples=0))
    return out


@pytest.mark.parametrize("family,recipe,config", CASES, ids=[c[0] for c in CASES])
def test_streaming_equals_whole_model(tmp_path, tiny_model, family, recipe, config):
    src = tiny_model(family, **config)
    out = _quantized(tmp_path, src, recipe)
    ids = load_samples("builtin", open_hf_dir(src).tokenizer(), 3, 40, split="evaluation")
    ref = load_simulated(open_hf_dir(src), simulate=False)
    cand = load_simulated(open_hf_dir(out))
    whole = compare(ref.model, cand.model, ids)
    streamed, numerics = compare_streaming(open_hf_dir(src), open_hf_dir(out), ids)
    assert numerics == cand.numerics
    assert numerics["quantized_linears"] > 0
    assert whole["kl"] > 1e-6  # a real difference to reproduce, not 0 == 0
    assert streamed["tokens"] == whole["tokens"]
    # float-summation order only (measured here: KL within 2e-7 relative, perplexities within 6e-7; the
    # DeepSeek case's KL is ~1e-6, so its noise is 1.6e-6 relative)
    assert streamed["kl"] == pytest.approx(whole["kl"], rel=1e-5)
    assert streamed["top1"] == pytest.approx(whole["top1"], abs=1e-9)
    for key in ("ppl", "ppl_reference"):
        assert streamed[key] == pytest.approx(whole[key], rel=3e-6), key
    # The simulation really is in the streamed numbers: without it the KL is smaller.
    plain, _ = compare_streaming(open_hf_dir(src), open_hf_dir(out), ids, simulate=False)
    if numerics["static_inputs"] + numerics["dynamic_inputs"] + numerics["kv_layers"]:
        assert plain["kl"] < streamed["kl"]


def test_streaming_of_model_vs_itself_is_exact(tiny_model):
    src = tiny_model("gemma3_text")
    ids = torch.randint(0, 1000, (2, 24))
    r, numerics = compare_streaming(open_hf_dir(src), open_hf_dir(src), ids)
    assert r["kl"] == pytest.approx(0.0, abs=1e-7) and r["top1"] == 1.0
    assert numerics["quantized_linears"] == 0


def test_streaming_refuses_different_depths(tiny_model):
    from fp8ptq.errors import ModelError

    ids = torch.randint(0, 1000, (1, 16))
    with pytest.raises(ModelError, match="decoder layers"):
        compare_streaming(open_hf_dir(tiny_model("llama")), open_hf_dir(tiny_model("llama", layers=3)), ids)
