"""Memory plan and γ recommendation on hand-computed numbers (no models)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from fp8ptq.spec import SpecError
from fp8ptq.spec.acceptance import Acceptance, RunSummary
from fp8ptq.spec.memory import ModelShape, kv_bytes_per_token, model_shape, parse_size, plan, safetensors_bytes
from fp8ptq.spec.recommend import (
    Costs,
    choose,
    sglang_flags,
    speedup,
    speedup_from_steps,
    tau_closed_form,
    tau_from_positions,
    vllm_config,
    write_outputs,
)


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    assert parse_size("512") == 512
    for bad in ("24 parsecs", "", "GiB", "-3GB", "0GB"):
        with pytest.raises(SpecError, match="memory size"):
            parse_size(bad)


def test_kv_and_weights(tmp_path):
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims: 2·30·3·64 = 11520 values per token
    assert kv_bytes_per_token(30, 3, 64, "bf16") == 23040
    assert kv_bytes_per_token(30, 3, 64, "fp8") == 11520
    with pytest.raises(SpecError, match="KV cache dtype"):
        kv_bytes_per_token(30, 3, 64, "int3")
    save_file(
        {
            "a": torch.zeros(10, 4, dtype=torch.bfloat16),
            "b": torch.zeros(3, dtype=torch.float32),
            "c": torch.zeros(7, dtype=torch.int8),
        },
        str(tmp_path / "model.safetensors"),
    )
    assert safetensors_bytes(tmp_path) == 80 + 12 + 7
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 64,
                "torch_dtype": "bfloat16",
                "quantization_config": {"kv_cache_scheme": {"num_bits": 8}},
            }
        )
    )
    s = model_shape(tmp_path)
    assert (s.weight_bytes, s.layers, s.kv_heads, s.head_dim, s.kv_dtype) == (99, 2, 2, 16, "fp8")
    assert model_shape(tmp_path, "bf16").kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2


def test_memory_plan_hand_computed():
    GiB = 2**30
    t = ModelShape(weight_bytes=10 * GiB, layers=32, kv_heads=8, head_dim=128, kv_dtype="fp8")  # 64 KiB / token
    d = ModelShape(weight_bytes=1 * GiB, layers=4, kv_heads=8, head_dim=128, kv_dtype="fp8")  # 8 KiB / token
    p = plan(t, d, 24 * GiB, context=8192, batch=4, gamma=4, utilization=1.0)
    assert p.target_kv_per_token == 65536 and p.draft_kv_per_token == 8192
    assert p.need_plain == 10 * GiB + 4 * 8192 * 65536  # 12 GiB
    assert p.need_spec == 11 * GiB + 4 * (8192 + 4) * (65536 + 8192)
    assert p.fits_plain and p.fits_spec
    tokens_plain = 14 * GiB // 65536  # 229376
    tokens_spec = 13 * GiB // 73728
    assert p.max_context_plain == tokens_plain // 4
    assert p.max_context_spec == tokens_spec // 4 - 4
    assert p.max_batch_plain == tokens_plain // 8192 == 28
    assert p.max_batch_spec == tokens_spec // 8196
    small = plan(t, d, 10 * GiB, context=8192, batch=1, gamma=4, utilization=0.9)
    assert not small.fits_plain and small.max_batch_plain == 0 and small.max_context_spec == 0
    assert (
        plan(t, None, 24 * GiB, context=1, batch=1, gamma=4).need_spec
        == plan(t, None, 24 * GiB, context=1, batch=1, gamma=4).need_plain
    )


def test_tau_formulas():
    assert tau_closed_form(0.0, 4) == 1.0
    assert tau_closed_form(1.0, 4) == 5.0
    assert abs(tau_closed_form(0.8, 4) - (1 - 0.8**5) / 0.2) < 1e-12
    # constant per-position α reproduces the closed form
    assert abs(tau_from_positions([0.7] * 6, 5) - tau_closed_form(0.7, 5)) < 1e-12
    assert tau_from_positions([0.9, 0.5, 0.1], 3) == 1 + 0.9 + 0.45 + 0.045
    with pytest.raises(SpecError):
        tau_from_positions([0.5], 2)


def _synthetic(alpha: float, gammas, steps: int = 1000) -> Acceptance:
    runs = []
    for g in gammas:
        tau = tau_closed_form(alpha, g)
        runs.append(
            RunSummary(
                gamma=g,
                drafts=steps,
                drafted=g * steps,
                accepted=round((tau - 1) * steps),
                per_pos_accepted=[],
                per_pos_reached=[],
                alpha_per_pos=[],
                alpha=alpha,
                tau=tau,
                emitted=tau * steps,
                target_forwards=steps,
                k_hist={str(g): steps},
            )
        )
    return Acceptance(tuple(runs), (), 0.0, 64, 8, 0)


def test_choose_gamma_matches_the_formula():
    """α = 0.8, c = 0.05, T_v(k) = T_t: τ/(γc+1) is 3.082 at γ=7, 3.092 at γ=8, 3.078 at γ=9: γ = 8."""
    alpha, c = 0.8, 0.05
    gammas = range(1, 13)
    costs = Costs(1.0, c, {k: 1.0 for k in range(1, 14)}, "synthetic")
    best = max(gammas, key=lambda g: tau_closed_form(alpha, g) / (g * c + 1))
    rec = choose(_synthetic(alpha, gammas), costs)
    assert rec.gamma == best == 8
    assert abs(rec.speedup - tau_closed_form(alpha, 8) / (8 * c + 1)) < 1e-9
    assert all(abs(r["speedup"] - r["speedup_formula"]) < 1e-9 for r in rec.table)
    # an expensive verification (SpecMQuant): T_v(k) = 1 + 0.3 (k − 1) pushes γ down, maybe to "not worth it"
    costly = Costs(1.0, c, {k: 1.0 + 0.3 * (k - 1) for k in range(1, 14)}, "synthetic")
    rec2 = choose(_synthetic(alpha, gammas), costly)
    best2 = max(gammas, key=lambda g: tau_closed_form(alpha, g) / (g * c + 1 + 0.3 * g))
    assert rec2.gamma == best2 < 8
    bad = Costs(1.0, 1.0, {k: 2.0 for k in range(1, 14)}, "synthetic")
    assert not choose(_synthetic(0.3, gammas), bad).worth_it


def test_dynamic_length_speedup_from_steps():
    costs = Costs(1.0, 0.1, {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8}, "synthetic")
    # 10 steps drafting 4, 10 steps drafting 0 (plain decode), 40 + 10 tokens emitted
    s = speedup_from_steps({4: 10, 0: 10}, 50, costs)
    assert abs(s - 50 / (10 * (0.4 + 1.8) + 10 * 1.0)) < 1e-12
    assert abs(speedup(3.0, 4, costs) - 3.0 / (0.4 + 1.8)) < 1e-12
    with pytest.raises(SpecError, match="no measured verification cost"):
        speedup(3.0, 8, costs)


def test_engine_configs_and_files(tmp_path):
    assert vllm_config("d", 4) == {"method": "draft_model", "model": "d", "num_speculative_tokens": 4}
    with pytest.raises(SpecError, match="out of range"):
        vllm_config("d", 0)
    f = sglang_flags("d", 3, "t.pt")
    assert f[f.index("--speculative-num-steps") + 1] == "3" and f[f.index("--speculative-num-draft-tokens") + 1] == "4"
    assert "--speculative-token-map" not in f and "STANDALONE" in f  # SGLang 0.5.23 mis-indexes it (issue 38)
    costs = Costs(1.0, 0.1, {k: 1.0 for k in range(1, 10)}, "synthetic")
    rec = choose(_synthetic(0.7, range(1, 9)), costs)
    files = write_outputs(tmp_path, rec, draft="/x/draft")
    assert json.loads(files["vllm"].read_text())["num_speculative_tokens"] == rec.gamma
    assert files["plot"].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(files["recommendation"].read_text())["gamma"] == rec.gamma


def test_safetensors_header_only(tmp_path):
    """Weights are counted from the header: a file whose data is not even read gives the right number."""
    header = json.dumps({"w": {"dtype": "F16", "shape": [1000, 1000], "data_offsets": [0, 2_000_000]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert safetensors_bytes(tmp_path) == 2_000_000


def test_gamma_per_batch_size_falls_as_verification_turns_compute_bound():
    """γ per batch size (schedule.py): the same acceptance under three batch sizes' costs. At batch 1 verifying
    γ + 1 tokens costs about one step (γ = 8, as above); at 8, each extra token +10% (a smaller γ); at 64 the
    target is compute-bound (each token +100%) and the draft costs as much: no γ pays, γ 0. The ranges are what
    vLLM's num_speculative_tokens_per_batch_size takes, and the config carries them with the largest γ."""
    from fp8ptq.spec.recommend import VLLM_SCHEDULE_FIELD, with_schedule
    from fp8ptq.spec.schedule import parse_batch_sizes, per_batch, vllm_ranges

    gammas = range(1, 13)
    acc = _synthetic(0.8, gammas)
    costs = {
        1: Costs(1.0, 0.05, {k: 1.0 for k in range(1, 14)}, "b1"),
        8: Costs(1.0, 0.05, {k: 1.0 + 0.1 * (k - 1) for k in range(1, 14)}, "b8"),
        64: Costs(1.0, 1.0, {k: float(k) for k in range(1, 14)}, "b64"),
    }
    rows = per_batch(acc, costs)
    assert [r["batch"] for r in rows] == [1, 8, 64]
    assert rows[0]["gamma"] == 8 and 1 <= rows[1]["gamma"] < 8 and rows[2]["gamma"] == 0
    assert rows[2]["best_gamma"] >= 1 and rows[2]["speedup"] < 1
    g8 = rows[1]["gamma"]
    assert vllm_ranges(rows) == [[1, 7, 8], [8, 63, g8], [64, 64, 0]]
    cfg = with_schedule(vllm_config("ngram:2-4", 8), vllm_ranges(rows))
    assert cfg["num_speculative_tokens"] == 8 and cfg[VLLM_SCHEDULE_FIELD] == [[1, 7, 8], [8, 63, g8], [64, 64, 0]]
    # neighbours with one γ merge; a single range is a fixed γ: the config stays as it was
    same = [{"batch": 1, "gamma": 4}, {"batch": 4, "gamma": 4}, {"batch": 16, "gamma": 2}]
    assert vllm_ranges(same) == [[1, 15, 4], [16, 16, 2]]
    assert with_schedule(vllm_config("d", 4), vllm_ranges(same[:2])) == vllm_config("d", 4)
    assert with_schedule(vllm_config("d", 4), [[1, 3, 0], [4, 4, 0]]) == vllm_config("d", 4)
    with pytest.raises(SpecError, match="batch size 1"):
        vllm_ranges(same[1:])
    assert parse_batch_sizes([32, 8, 8]) == (1, 8, 32)
    with pytest.raises(SpecError, match="must be ≥ 1"):
        parse_batch_sizes([0, 4])
