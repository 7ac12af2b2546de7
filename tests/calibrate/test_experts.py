"""MoE calibration (calibrate/experts.py, models/moe.py) on tiny random Qwen3-MoE / Mixtral models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from compressed_tensors.utils.match import is_match

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.calibrate import experts as experts_mod
from fp8ptq.models.arch import ARCHS
from fp8ptq.models.moe import Experts
from fp8ptq.recipe import BUILTIN_DIR

from helpers import read_tensors

pytestmark = pytest.mark.tiny


def _fused_block(model_type: str, seed: int = 0):
    """transformers' own sparse MoE block (fused 3-D experts) and fp8ptq's per-expert copy of it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = ARCHS[model_type]
    cfg = AutoConfig.for_model(model_type, **{**arch.tiny, "num_hidden_layers": 1, "vocab_size": 64})
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.float()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer = AutoModelForCausalLM.from_config(cfg).model.layers[0]
    arch.prepare_layer(layer, cfg)
    ours = layer.get_submodule(arch.blocks[1].module)
    ours.gate.load_state_dict(hf.gate.state_dict())
    experts = ours.experts
    inter = hf.experts.down_proj.shape[-1]
    for e, expert in enumerate(experts):
        gate, up, down = (expert._modules[n] for n in expert.names)
        gate.weight = torch.nn.Parameter(hf.experts.gate_up_proj.data[e, :inter].clone())
        up.weight = torch.nn.Parameter(hf.experts.gate_up_proj.data[e, inter:].clone())
        down.weight = torch.nn.Parameter(hf.experts.down_proj.data[e].clone())
    return hf, ours.float()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_block_computes_what_transformers_computes(model_type):
    hf, ours = _fused_block(model_type)
    x = torch.randn(2, 24, hf.experts.down_proj.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-6)


def test_observe_all_runs_every_token_but_keeps_the_routing():
    _, block = _fused_block("qwen3_moe", seed=1)
    x = torch.randn(1, 32, block.experts[0].gate_proj.in_features)
    seen: dict[int, int] = {}
    for e, expert in enumerate(block.experts):
        expert.gate_proj.register_forward_pre_hook(lambda _m, a, e=e: seen.__setitem__(e, a[0].shape[0]))
    with torch.inference_mode():
        routed = block(x)
        seen.clear()
        block.experts.observe_all = frozenset(range(len(block.experts)))
        everything = block(x)
    assert seen == {e: 32 for e in range(len(block.experts))}  # every expert saw all 32 tokens
    torch.testing.assert_close(everything, routed, rtol=1e-5, atol=1e-6)


def _recipe(tmp_path, base: str, **calibration) -> str:
    data = yaml.safe_load((BUILTIN_DIR / f"{base}.yaml").read_text())
    data["calibration"] = {**data.get("calibration", {}), **calibration}
    path = tmp_path / f"{base}-moe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _quantize(src, recipe, out):
    return quantize(
        QuantizeConfig(model=str(src), recipe=recipe, output=out, num_samples=4, seq_len=64, eval_samples=0)
    )


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_every_expert_quantized_with_shared_static_scales_and_router_float(model_type, tiny_model, tmp_path):
    arch = ARCHS[model_type]
    src = tiny_model(model_type)
    out = tmp_path / "q"
    manifest = _quantize(src, "fp8-kv8", out)
    tensors = read_tensors(out)
    path = arch.expert_lists[0]
    cfg = json.loads((src / "config.json").read_text())
    count = cfg.get("num_experts") or cfg["num_local_experts"]
    leaves = ("gate_proj", "up_proj", "down_proj") if model_type == "qwen3_moe" else ("w1", "w3", "w2")
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}.{path}"
        for leaf in leaves:
            scales = [tensors[f"{prefix}.{e}.{leaf}.input_scale"] for e in range(count)]
            assert all(torch.equal(s, scales[0]) for s in scales), leaf  # vLLM takes the max: written shared
            for e in range(count):
                assert tensors[f"{prefix}.{e}.{leaf}.weight"].dtype == torch.float8_e4m3fn
                assert torch.isfinite(tensors[f"{prefix}.{e}.{leaf}.weight_scale"]).all()
        router = f"model.layers.{i}.{path.rpartition('.')[0]}.gate"
        assert tensors[f"{router}.weight"].dtype == torch.bfloat16
        assert not any(k.startswith(router + ".weight_") or k.startswith(router + ".input") for k in tensors)
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert any(is_match(router, torch.nn.Linear(1, 1), [p]) for p in ignore)  # vLLM builds routers as Linears
        report = manifest.layers[i]["experts"][prefix]
        assert sum(report["tokens"]) == 4 * 64 * cfg["num_experts_per_tok"]
        assert report["all_tokens"] == sorted(e for e, n in enumerate(report["tokens"]) if n < 64)


def test_starved_experts_fall_back_to_every_token(tiny_model, tmp_path):
    src = tiny_model("qwen3_moe")
    manifest = _quantize(src, _recipe(tmp_path, "fp8-kv8", moe_min_tokens=10**6), tmp_path / "q")
    for layer in manifest.layers:
        (report,) = layer["experts"].values()
        assert report["all_tokens"] == list(range(len(report["tokens"])))  # every expert: all tokens
    assert manifest.quality is None or manifest.quality.kl >= 0


def test_expert_hessians_in_batches_change_nothing(tiny_model, tmp_path, monkeypatch):
    """GPTQ over experts in several passes (a small Hessian budget) writes the same bytes as one pass."""
    src = tiny_model("qwen3_moe")
    _quantize(src, "w4a16", tmp_path / "one")
    monkeypatch.setattr(experts_mod, "HESSIAN_BUDGET", 3 * 4 * 64 * 64 * 2)  # two experts per pass
    _quantize(src, "w4a16", tmp_path / "many")
    a, b = read_tensors(tmp_path / "one"), read_tensors(tmp_path / "many")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_experts_container_ignores_padding_routes():
    _, block = _fused_block("qwen3_moe")
    experts: Experts = block.experts
    h = torch.randn(3, experts[0].gate_proj.in_features)
    idx = torch.tensor([[0, len(experts)], [1, 2], [len(experts), len(experts)]])  # E = "no expert"
    w = torch.ones(3, 2)
    with torch.inference_mode():
        out = experts(h, idx, w)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_analyze_reports_outliers_per_expert(tiny_model, tmp_path):
    from fp8ptq.api import AnalyzeConfig, analyze

    report = analyze(
        AnalyzeConfig(model=str(tiny_model("qwen3_moe")), output=tmp_path / "a", num_samples=4, seq_len=64)
    )
    for layer in report.layers:
        experts = {k.split()[1] for k in layer["inputs"] if k.startswith("expert ")}
        assert len(experts) >= 2  # every expert the router used has its own row
        assert all(np.isfinite(s["amax"]) for s in layer["inputs"].values())
