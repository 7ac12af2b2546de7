"""What fp8ptq writes for SGLang, checked by SGLang 0.5.23's own code (`make sglang`), in one subprocess:

- every flag set `spec recommend` writes (n-gram, standalone draft, EAGLE-3 head) is parsed by SGLang's
  server argument parser, and the values SGLang reads are the ones fp8ptq meant. The n-gram flags fp8ptq
  wrote before (`--speculative-ngram-{min,max}-match-window-size`) are refused there, which is how a user
  found them (issue 38);
- an EAGLE-3 head's eagle_config layer ids make SGLang's model class capture the layers vLLM captures for
  the head's top-level ids (SGLang adds one for these families; fp8ptq used to write the same ids to both,
  so SGLang fed the head the next layers' states)."""

from __future__ import annotations

import pytest
import torch

from fp8ptq.engine.sglang_engine import run_checks
from fp8ptq.spec.eagle3 import SGLANG_CAPTURES_NEXT, default_layer_ids, sglang_layer_ids
from fp8ptq.spec.proposers import Eagle3Proposer
from fp8ptq.spec.recommend import sglang_flags

SGLANG_CLASS = {  # model_type -> SGLang 0.5.23's model file and class
    "llama": ("llama.py", "LlamaForCausalLM"),
    "mistral": ("mistral.py", "MistralForCausalLM"),
    "phi3": ("llama.py", "Phi3ForCausalLM"),
    "qwen2": ("qwen2.py", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3.py", "Qwen3ForCausalLM"),
    "gemma3_text": ("gemma3_causal.py", "Gemma3ForCausalLM"),
}


@pytest.mark.slow  # one subprocess: SGLang's import takes ~10 s
def test_sglang_accepts_what_fp8ptq_writes():
    ours = {
        "ngram": sglang_flags("ngram:2-4", 5),
        "standalone": sglang_flags("/models/draft", 3),
        "eagle3": sglang_flags("/models/head", 4, proposer=Eagle3Proposer),
        "mtp": sglang_flags("mtp", 3),
    }
    old_ngram = ["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "2"]
    vllm_ids = default_layer_ids(30)  # SmolLM2's 30 layers: [2, 15, 27], what the real-model head uses
    capture = [
        {"model_type": t, "file": f, "class": c, "num_layers": 30, "ids": sglang_layer_ids(t, vllm_ids)}
        for t, (f, c) in SGLANG_CLASS.items()
    ]
    r = run_checks({"flags": {**ours, "old ngram": old_ngram}, "capture": capture})
    assert r["version"] == "0.5.23", r
    sets = r["flags"]
    for name in ours:
        assert sets[name]["ok"], (name, sets[name])
    ngram = sets["ngram"]["parsed"]
    assert ngram["speculative_algorithm"] == "NGRAM" and ngram["speculative_num_draft_tokens"] == "6", ngram
    assert ngram["speculative_ngram_max_trie_depth"] == "9" and ngram["speculative_ngram_max_bfs_breadth"] == "1"
    eagle = sets["eagle3"]["parsed"]
    assert eagle["speculative_algorithm"] == "EAGLE3" and eagle["speculative_draft_model_path"] == "/models/head"
    assert eagle["speculative_num_steps"] == "4" and eagle["speculative_eagle_topk"] == "1", eagle
    assert sets["standalone"]["parsed"]["speculative_algorithm"] == "STANDALONE"
    mtp = sets["mtp"]["parsed"]  # no draft path: SGLang takes the target's own for DeepSeek-V3 / GLM-4.5
    assert mtp["speculative_algorithm"] == "NEXTN" and "speculative_draft_model_path" not in mtp, mtp
    assert mtp["speculative_num_steps"] == "3" and mtp["speculative_num_draft_tokens"] == "4", mtp
    old = sets["old ngram"]
    assert not old["ok"] and "unrecognized arguments: --speculative-ngram-min-match-window-size" in old["error"], old

    assert set(SGLANG_CLASS) == set(SGLANG_CAPTURES_NEXT)
    for c in r["capture"]:  # SGLang's layers_to_capture index the layer whose input it takes, as vLLM's ids do
        assert c["layers_to_capture"] == vllm_ids, c
    assert sglang_layer_ids("llama", vllm_ids) == [1, 14, 26]  # what the head's eagle_config now says


def test_recommend_says_when_sglang_is_not_installed(tmp_path, monkeypatch):
    from fp8ptq.spec.run import sglang_check

    monkeypatch.setenv("FP8PTQ_SGLANG_SITE", str(tmp_path / "none"))
    r = sglang_check(sglang_flags("ngram:1-3", 2))
    assert r["ok"] is None and "no SGLang at" in r["error"] and "make sglang" in r["error"], r


# SGLang 0.5.23's scheme for each built-in recipe's export, on H100 (sm_90) and B200 (sm_100), or its refusal
NO_SCHEME = "NotImplementedError: No compressed-tensors compatible scheme was found."
SGLANG_SCHEMES = {
    "flatten-w8a8": "CompressedTensorsW8A8Int8",
    "fp8-block": "CompressedTensorsW8A8Fp8",
    "fp8-dynamic": "CompressedTensorsW8A8Fp8",
    "fp8-kv8": "CompressedTensorsW8A8Fp8",
    "mixed-w4-w8": "CompressedTensorsW8A8Int8",  # its single-group form; the two-group export: below
    "mxfp4": None,  # SGLang 0.5.23 has MXFP4 for MoE experts only (Mxfp4MoEMethod), no dense MX scheme
    "mxfp4-fp8": None,
    "mxfp4a16": None,
    "mxfp4a16-signround": None,
    "mxfp8": None,
    "mxfp8a16": None,
    "nvfp4": ("CompressedTensorsW4A16Fp4", "CompressedTensorsW4A4Fp4"),  # W4A4 on Blackwell, else weight-only
    "nvfp4a16": "CompressedTensorsW4A16Fp4",
    "nvfp4a16-signround": "CompressedTensorsW4A16Fp4",
    "w4a16": "CompressedTensorsWNA16",
    "w4a16-awq": "CompressedTensorsWNA16",
    "w4a16-gguf": "CompressedTensorsWNA16",
    "w4a16-kv8": "CompressedTensorsWNA16",
    "w4a16-signround": "CompressedTensorsWNA16",
    "w4a8-fp8": None,  # no INT4 x FP8 scheme for dense Linears in 0.5.23
    "w8a16-fp8": "CompressedTensorsW8A16Fp8",
    "w8a16-int8": "CompressedTensorsWNA16",
    "w8a8-int8": "CompressedTensorsW8A8Int8",
}


@pytest.mark.slow  # one subprocess: SGLang's import takes ~10 s
def test_sglang_resolves_every_builtin_recipe():
    """SGLang's own CompressedTensorsConfig over the quantization_config each built-in recipe's export writes
    (export/compressed_tensors.quantization_config, what quantize puts in config.json): the scheme it picks
    on each GPU generation, or its refusal asserted by its text; the per-head KV variant is one SGLang
    ignores (its KV method takes static per-tensor FP8 only); a two-group mixed-precision export resolves
    per group."""
    from fp8ptq.engine.sglang_engine import GPUS
    from fp8ptq.export.compressed_tensors import quantization_config
    from fp8ptq.quantization.schemes import LinearScheme
    from fp8ptq.recipe import builtin_names, load_recipe

    assert set(SGLANG_SCHEMES) == set(builtin_names())  # a new recipe must say what SGLang does with it
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"]
    caps = [list(c) for c in GPUS]
    jobs = [
        {"name": n, "config": quantization_config(load_recipe(n)), "layers": layers, "capabilities": caps}
        for n in SGLANG_SCHEMES
    ]
    kv8 = load_recipe("fp8-kv8")
    head = kv8.model_copy(
        update={
            "scheme": kv8.scheme.model_copy(
                update={"kv_cache": kv8.scheme.kv_cache.model_copy(update={"strategy": "attn_head"})}
            )
        }
    )
    jobs.append({"name": "kv-head", "config": quantization_config(head), "layers": layers, "capabilities": caps})
    mixed = load_recipe("mixed-w4-w8")
    groups = [
        (LinearScheme(mixed.scheme.weights, mixed.scheme.input_activations), ["re:.*down_proj$"]),
        (LinearScheme(mixed.mixed.weights, None), ["re:.*q_proj$"]),
    ]
    jobs.append({"name": "mixed", "config": quantization_config(mixed, groups), "layers": layers, "capabilities": caps})
    r = {j["name"]: j for j in run_checks({"schemes": jobs})["schemes"]}

    for name, want in SGLANG_SCHEMES.items():
        for cap in ("9.0", "10.0"):
            got = r[name]["by_capability"][cap]
            expect = want[cap == "10.0"] if isinstance(want, tuple) else want
            for layer in layers:
                if expect is None:
                    assert got[layer] == {"error": NO_SCHEME}, (name, cap, got)
                else:
                    assert got[layer]["scheme"] == expect and got[layer]["min_capability"] <= int(float(cap) * 10), (
                        name,
                        cap,
                        got,
                    )
    # on an A100 (sm_80) SGLang serves FP8 W8A8 weight-only (its W8A16 FP8 scheme), as vLLM does
    assert r["fp8-kv8"]["by_capability"]["8.0"][layers[0]]["scheme"] == "CompressedTensorsW8A16Fp8"
    assert r["fp8-kv8"]["by_capability"]["9.0"][layers[0]]["min_capability"] == 89
    assert r["fp8-kv8"]["kv_supported"] is True and r["w4a16"]["kv_supported"] is None
    assert r["kv-head"]["kv_supported"] is False  # SGLang warns and serves the FP8 cache without these scales
    mixed_h100 = r["mixed"]["by_capability"]["9.0"]
    assert mixed_h100[layers[0]]["scheme"] == "CompressedTensorsWNA16"
    assert mixed_h100[layers[1]]["scheme"] == "CompressedTensorsW8A8Int8"


@pytest.mark.slow  # SGLang's engine starts in ~35 s on 2 cores
def test_sglang_generates_the_demo_model_like_transformers(smol_dir):
    """SGLang 0.5.23's own offline Engine, on CPU (its CPU engine, the torch_native attention backend, the
    sgl_kernel stand-in), greedy on the float demo model: the same 16 tokens as transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(smol_dir)("The capital of France is")["input_ids"]
    r = run_checks({"generate": {"model": str(smol_dir), "prompts": [prompt], "max_new_tokens": 16}})
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    ids = torch.tensor([prompt])
    want = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert r["generate"]["output_ids"] == [want], (r["generate"], want)
