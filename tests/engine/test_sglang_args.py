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

from fp8ptq.engine.sglang_engine import run_checks
from fp8ptq.spec.eagle3 import SGLANG_CAPTURES_NEXT, default_layer_ids, sglang_layer_ids
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
        "eagle3": sglang_flags("/models/head", 4, eagle3=True),
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
