"""Tier 2: MXFP4 (`mxfp4a16`) on a tiny random Llama: the tensors vLLM's CompressedTensorsW4A4Mxfp4
reads (uint8 E8M0 exponents, no global scale), the config under compressed-tensors 0.17, and the FP4
formats' clear refusal of widths their fixed group size does not divide (NVFP4 16, MXFP4 32)."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.recipe import parse_recipe

from helpers import parse_config_under, read_config, read_tensors

pytestmark = pytest.mark.tiny


def test_export_layout_and_config(tmp_path, tiny_dir):
    out = tmp_path / "q"
    quantize(
        QuantizeConfig(model=str(tiny_dir), recipe="mxfp4a16", output=out, num_samples=4, seq_len=64, eval_samples=0)
    )
    qc = read_config(out)["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["group_size"], w["scale_dtype"]) == ("group", 32, "torch.uint8")
    assert parse_config_under(qc, "0.17.0") == "0.17.0"
    t = read_tensors(out)
    p = "model.layers.0.mlp.down_proj."  # [64, 128]
    assert t[p + "weight_packed"].dtype == torch.uint8 and t[p + "weight_packed"].shape == (64, 64)
    assert t[p + "weight_scale"].dtype == torch.uint8 and t[p + "weight_scale"].shape == (64, 4)
    assert not any(k.endswith(("global_scale", "input_scale")) for k in t)
    e = t[p + "weight_scale"].int()
    assert ((e > 0) & (e < 255)).all()  # finite E8M0 exponents


@pytest.mark.parametrize("recipe, size", [("mxfp4a16", 32), ("nvfp4a16", 16)])
def test_widths_the_group_does_not_divide_are_refused_before_work(recipe, size, tmp_path, tiny_model):
    src = tiny_model("llama", intermediate_size=136)  # down_proj's input: 136 = 8.5 x 16
    with pytest.raises(RecipeError) as e:
        quantize(QuantizeConfig(model=str(src), recipe=recipe, output=tmp_path / "o", eval_samples=0))
    msg = str(e.value)
    assert f"group_size {size} does not divide the input width of" in msg and "mlp.down_proj (136)" in msg, msg
    assert "scheme.ignore" in msg, msg
    assert not (tmp_path / "o").exists()


def test_mx_recipes_need_uint8_scales_and_no_activations():
    w = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
    base = {"name": "x", "description": "x", "calibration": {"weight_method": "rtn"}}
    with pytest.raises(RecipeError, match="MXFP4 weights need scale_dtype: uint8"):
        parse_recipe({**base, "scheme": {"weights": w}}, "x.yaml")
    acts = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"}
    with pytest.raises(RecipeError, match="MXFP4 weights are exported weight-only"):
        parse_recipe({**base, "scheme": {"weights": {**w, "scale_dtype": "uint8"}, "input_activations": acts}}, "x")
    with pytest.raises(RecipeError, match="scale_dtype is only for MX float groups"):
        parse_recipe({**base, "scheme": {"weights": {"num_bits": 8, "scale_dtype": "uint8"}}}, "x")
