"""Tier 2: MXFP4 (`mxfp4a16`, W4A4 `mxfp4`, `mxfp4-fp8`) on a tiny random Llama: the tensors vLLM's
CompressedTensorsW4A4Mxfp4 / W4A8Mxfp4 read (uint8 E8M0 exponents, no global scale, no input scale),
the config under compressed-tensors 0.17, the simulation's quantized inputs, and the refusals: widths a
fixed group size does not divide (NVFP4 16, MXFP4 32, FP8 input groups), inputs MXFP4 weights do not take."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.recipe import parse_recipe

from helpers import parse_config_under, read_config, read_tensors

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_dir):
    """recipe -> export dir, each of the three MXFP4 recipes quantized once."""
    done = {}

    def make(recipe):
        if recipe not in done:
            out = tmp_path_factory.mktemp(recipe) / "q"
            quantize(
                QuantizeConfig(
                    model=str(tiny_dir), recipe=recipe, output=out, num_samples=4, seq_len=64, eval_samples=0
                )
            )
            done[recipe] = out
        return done[recipe]

    return make


INPUTS = {  # recipe -> its input_activations' (num_bits, strategy, group_size, scale_dtype)
    "mxfp4a16": None,
    "mxfp4": (4, "group", 32, "torch.uint8"),
    "mxfp4-fp8": (8, "token", None, None),
}


@pytest.mark.parametrize("recipe", list(INPUTS))
def test_export_layout_and_config(recipe, exports):
    out = exports(recipe)
    qc = read_config(out)["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["group_size"], w["scale_dtype"]) == ("group", 32, "torch.uint8")
    a = qc["config_groups"]["group_0"]["input_activations"]
    want = INPUTS[recipe]
    assert (a if want is None else (a["num_bits"], a["strategy"], a["group_size"], a.get("scale_dtype"))) == want
    assert want is None or a["dynamic"] is True
    assert parse_config_under(qc, "0.17.0") == "0.17.0"
    t = read_tensors(out)
    p = "model.layers.0.mlp.down_proj."  # [64, 128]
    assert t[p + "weight_packed"].dtype == torch.uint8 and t[p + "weight_packed"].shape == (64, 64)
    assert t[p + "weight_scale"].dtype == torch.uint8 and t[p + "weight_scale"].shape == (64, 4)
    assert not any(k.endswith(("global_scale", "input_scale")) for k in t)
    e = t[p + "weight_scale"].int()
    assert ((e > 0) & (e < 255)).all()  # finite E8M0 exponents


def test_simulation_quantizes_the_inputs_as_the_recipe_says(exports):
    """W4A4 and MXFP4 x FP8 run every Linear on dynamically quantized inputs; with the same weights
    rounding, MXFP4 inputs cost more than FP8 ones (1 mantissa bit against 3)."""
    sims = {r: load_simulated(open_hf_dir(exports(r))) for r in INPUTS}
    assert [sims[r].numerics["dynamic_inputs"] for r in INPUTS] == [0, 14, 14]
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.inference_mode():
        a16, a4, a8 = (sims[r].model(ids).logits for r in INPUTS)
    assert not torch.equal(a4, a16) and not torch.equal(a8, a16)


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
    mx_w = {**w, "scale_dtype": "uint8"}
    for acts in (
        {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"},
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},  # static FP8: vLLM has none
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
    ):
        with pytest.raises(RecipeError, match="MXFP4 weights take input_activations null"):
            parse_recipe({**base, "scheme": {"weights": mx_w, "input_activations": acts}}, "x")
    mx_a = {**mx_w, "dynamic": True}
    with pytest.raises(RecipeError, match="MX inputs of 4 bits go with MXFP4 weights"):
        nv = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
        parse_recipe({**base, "scheme": {"weights": nv, "input_activations": mx_a}}, "x")
    with pytest.raises(RecipeError, match="scale_dtype is only for MX float groups"):
        parse_recipe({**base, "scheme": {"weights": {"num_bits": 8, "scale_dtype": "uint8"}}}, "x")


def test_fp8_input_groups_must_divide_every_width(tmp_path, tiny_dir):
    """compressed-tensors' MXFP4XFP8 preset quantizes the inputs in FP8 groups of 128: on 64-wide layers
    that is refused before any work, naming the sizes that fit."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: x\ndescription: x\ncalibration: {weight_method: rtn}\nscheme:\n"
        "  weights: {num_bits: 4, type: float, strategy: group, group_size: 32, scale_dtype: uint8}\n"
        "  input_activations: {num_bits: 8, type: float, strategy: group, group_size: 128, dynamic: true}\n"
    )
    with pytest.raises(RecipeError) as e:
        quantize(QuantizeConfig(model=str(tiny_dir), recipe=str(recipe), output=tmp_path / "o", eval_samples=0))
    assert "group_size 128 does not divide the input width of" in str(e.value) and "64" in str(e.value)
    assert not (tmp_path / "o").exists()
