"""An FP8 KV cache for MLA (DeepSeek-V3 / Kimi K2 by their adapter, MLA families without one by the generic
path): what vLLM 0.32 caches per token is the normed latent followed by the RoPE key, quantized with the
layer's one k_scale, and a compressed-tensors checkpoint cannot set that scale (its KV-cache method is
for `Attention` layers only), so the engine uses 1.0. fp8ptq rounds that entry with 1.0 where the model
expands it, and writes 1.0."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fp8ptq.api import InspectConfig, QuantizeConfig, inspect, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.eval.quality import load_simulated
from fp8ptq.manifest import Manifest
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.ops.fp8 import FP8_DTYPE

from helpers import decompression_mismatches, quantize_recording

pytestmark = pytest.mark.tiny
MLA = dict(q_lora_rank=32, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)


@pytest.fixture(scope="module")
def deepseek(tiny_model):
    return tiny_model("deepseek_v3", **MLA, **MOE, n_group=1, topk_group=1, num_key_value_heads=4, head_dim=16)


@pytest.fixture(scope="module")
def kv8_export(tmp_path_factory, deepseek):
    out = tmp_path_factory.mktemp("mla") / "kv8"
    cfg = QuantizeConfig(
        model=str(deepseek), recipe="fp8-kv8", output=out, num_samples=4, seq_len=32, eval_samples=2, weights="rtn"
    )
    return out, quantize_recording(cfg)


def _fp8_exact(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(FP8_DTYPE).to(t.dtype))


def test_the_export_declares_the_fp8_cache_with_the_scale_the_engine_uses(kv8_export):
    out, fakes = kv8_export
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        scales = {k: f.get_tensor(k) for k in f.keys() if k.endswith(("k_scale", "v_scale"))}
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert len(scales) == 2 * layers and all(torch.equal(s, torch.ones(1)) for s in scales.values())
    assert decompression_mismatches(out, fakes) == []
    lint = inspect(InspectConfig(path=out))  # how to serve it: vLLM does not turn the FP8 latent cache on
    assert [f.code for f in lint.findings if f.code.startswith("kv")] == ["kv-mla"]
    entries = [layer["kv"] for layer in Manifest.load(out).layers]
    assert all(e["latent_amax"] > 0 and e["rope_key_amax"] > 0 and e["saturates"] is False for e in entries)


def test_the_simulation_rounds_the_cache_entry_before_it_is_expanded(kv8_export):
    out, _ = kv8_export
    sim = load_simulated(open_hf_dir(out))
    attn = sim.model.model.layers[0].self_attn
    seen = {}
    # before kv_b_proj's own input quantizer: what the cache hands it
    attn.kv_b_proj.register_forward_pre_hook(lambda _m, a: seen.update(latent=a[0]), prepend=True)
    inner = attn.expand_kv

    def spy(kv_nope, k_rot):
        keys, values = inner(kv_nope, k_rot)
        seen["keys"] = keys
        return keys, values

    attn.expand_kv = spy
    with torch.inference_mode():
        sim.model(input_ids=torch.tensor([[5, 17, 99, 23, 310, 7]]))
    assert sim.numerics["kv_layers"] == len(sim.model.model.layers)
    assert _fp8_exact(seen["latent"]) and not _fp8_exact(seen["latent"] * 1.01)  # FP8 codes at scale 1.0
    assert _fp8_exact(seen["keys"][..., MLA["qk_nope_head_dim"] :])  # the RoPE part of every head's key
    assert not _fp8_exact(seen["keys"][..., : MLA["qk_nope_head_dim"]])  # decompressed: not FP8 itself


def test_per_head_scales_are_refused_on_a_latent_cache(tmp_path, deepseek):
    with pytest.raises(RecipeError, match="caches MLA's latent, one entry per token") as e:
        quantize(
            QuantizeConfig(
                model=str(deepseek),
                recipe="fp8-kv8",
                output=tmp_path / "q",
                sets=("scheme.kv_cache.strategy=attn_head",),
            )
        )
    assert "strategy: tensor" in str(e.value) and not (tmp_path / "q").exists()
