"""gpt-oss adapter (models/arch/gpt_oss.py) against transformers' own GptOss model, in float: per-expert
Linears read from the fused 3-D expert tensors, the clamped SwiGLU, attention sinks and sliding layers."""

from __future__ import annotations

import pytest
import torch

from fp8ptq.models.arch import ARCHS
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.models.skeleton import build_skeleton, load_float, materialize
from fp8ptq.quantization.numerics import EAGER_ATTN_IMPL, register_attention

pytestmark = pytest.mark.tiny


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def test_per_expert_model_computes_what_transformers_computes(tiny_model):
    """40 tokens (longer than the 16-token sliding window of layer 0): the whole model's logits."""
    path = tiny_model("gpt_oss")
    src = open_hf_dir(path)
    assert "model.layers.0.mlp.experts.7.gate_up_proj.weight" in src.weight_map
    assert "model.layers.0.mlp.experts.gate_up_proj" not in src.weight_map  # read through the views
    assert src.tensor_shape("model.layers.0.mlp.experts.3.gate_up_proj.weight") == (128, 64)
    ours = load_float(src)
    assert ours.config._attn_implementation == "eager"
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = _reference(path)(ids).logits
        torch.testing.assert_close(ours(ids).logits, want, rtol=1e-5, atol=1e-5)
        # the KV-observing attention fp8ptq calibrates and simulates with (no hooks installed): the same
        sim = build_skeleton(src.config, attn_implementation=register_attention())
        assert sim.config._attn_implementation == EAGER_ATTN_IMPL
        materialize(sim, "", src, torch.float32)
        sim.lm_head.weight = torch.nn.Parameter(src.tensor("lm_head.weight").float())
        torch.testing.assert_close(sim.eval()(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_expert_block_matches_transformers():
    """Large random weights, so the ±7 clamps and the router's top-k really act."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = ARCHS["gpt_oss"]
    cfg = AutoConfig.for_model("gpt_oss", **{**arch.tiny, "num_hidden_layers": 1, "vocab_size": 64})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").model.layers[0].mlp.float()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=1.0)
    layer = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").model.layers[0]
    arch.prepare_layer(layer, cfg)
    ours = layer.mlp
    pre = "model.layers.0.mlp."
    state = {f"{pre}experts.{k}": v for k, v in hf.experts.state_dict().items()}
    views = arch.source_views(list(state), cfg)
    assert len(views) == 4 * cfg.num_local_experts
    loaded = {n.removeprefix(pre): v.read([state[v.stored]]) for n, v in views.items()} | {
        f"router.{k}": v for k, v in hf.router.state_dict().items()
    }
    ours.load_state_dict(loaded, strict=True, assign=True)
    x = torch.randn(2, 24, cfg.hidden_size)
    with torch.inference_mode():
        gate_up = x.reshape(-1, cfg.hidden_size) @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
        assert gate_up.abs().max() > 2 * cfg.swiglu_limit  # the clamps matter for these inputs
        # fp32 summation order: transformers 5.24's expert path differs from ours by up to 1.2e-4 on outputs
        # of a few units with 2 threads (a clamp or routing error would be O(1))
        torch.testing.assert_close(ours(x)[0], hf(x)[0], rtol=1e-4, atol=1e-4)


def test_export_quantizes_every_expert_keeps_router_sinks_and_biases_float(tiny_model, tmp_path):
    import json

    from compressed_tensors.utils.match import is_match

    from fp8ptq.api import QuantizeConfig, quantize

    from helpers import read_tensors

    path = tiny_model("gpt_oss")
    out = tmp_path / "q"
    manifest = quantize(
        QuantizeConfig(model=str(path), recipe="fp8-kv8", output=out, num_samples=4, seq_len=64, eval_samples=0)
    )
    src, tensors = open_hf_dir(path), read_tensors(out)
    cfg = src.config
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj", "_proj_bias")) for k in tensors)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for leaf in ("gate_up_proj", "down_proj"):
            scales = [tensors[f"{p}mlp.experts.{e}.{leaf}.input_scale"] for e in range(cfg.num_local_experts)]
            assert all(torch.equal(s, scales[0]) for s in scales)  # shared: vLLM takes the max over experts
            for e in range(cfg.num_local_experts):
                name = f"{p}mlp.experts.{e}.{leaf}"
                assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn
                assert torch.isfinite(tensors[f"{name}.weight_scale"]).all()
                assert torch.equal(tensors[f"{name}.bias"], src.tensor(f"{name}.bias"))  # float, as stored
        router = f"{p}mlp.router"
        assert tensors[f"{router}.weight"].dtype == tensors[f"{router}.bias"].dtype == torch.bfloat16
        assert not any(k.startswith(router + ".") and k.rpartition(".")[2] not in ("weight", "bias") for k in tensors)
        assert any(is_match(router, torch.nn.Linear(1, 1), [q]) for q in ignore)  # vLLM builds it as a Linear
        assert torch.equal(tensors[f"{p}self_attn.sinks"], src.tensor(f"{p}self_attn.sinks"))
        assert tensors[f"{p}self_attn.q_proj.bias"].dtype == torch.bfloat16
        assert {f"{p}self_attn.k_scale", f"{p}self_attn.v_scale"} <= tensors.keys()
        report = manifest.layers[i]["experts"][f"{p}mlp.experts"]
        assert sum(report["tokens"]) == 4 * 64 * cfg.num_experts_per_tok
