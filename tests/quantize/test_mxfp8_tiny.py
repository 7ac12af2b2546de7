"""Tier 2: MXFP8 (`mxfp8`, `mxfp8a16`) and 8-bit weight-only (`w8a16-int8`, `w8a16-fp8`) on a tiny random
Llama: the tensors vLLM 0.32 reads (CompressedTensorsW8A8Mxfp8: FP8 weight, uint8 E8M0 exponents
[out, in / 32]; WNA16 uint8b128; W8A16Fp8), and the recipe layer's refusals of MX halves that do not
go together. Bit-exact decompression and the config under compressed-tensors 0.17 are contract tests."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.recipe import parse_recipe

from helpers import read_config, read_tensors

pytestmark = pytest.mark.tiny


def _quantize(tiny_dir, out, recipe):
    quantize(QuantizeConfig(model=str(tiny_dir), recipe=recipe, output=out, num_samples=4, seq_len=64, eval_samples=0))
    return read_config(out)["quantization_config"], read_tensors(out)


def test_mxfp8_export_layout(tmp_path, tiny_dir):
    qc, t = _quantize(tiny_dir, tmp_path / "q", "mxfp8")
    assert qc["format"] == "mxfp8-quantized"
    g = qc["config_groups"]["group_0"]
    assert (g["weights"]["strategy"], g["weights"]["group_size"], g["weights"]["scale_dtype"]) == (
        "group",
        32,
        "torch.uint8",
    )
    a = g["input_activations"]
    assert (a["strategy"], a["group_size"], a["dynamic"], a["scale_dtype"]) == ("group", 32, True, "torch.uint8")
    p = "model.layers.0.mlp.down_proj."  # [64, 128]
    assert t[p + "weight"].dtype == torch.float8_e4m3fn and t[p + "weight"].shape == (64, 128)
    assert t[p + "weight_scale"].dtype == torch.uint8 and t[p + "weight_scale"].shape == (64, 4)
    assert not any(k.endswith(("global_scale", "input_scale")) for k in t)


def test_mxfp8_simulation_quantizes_the_activations(tmp_path, tiny_dir):
    """The evaluator's model of the W8A8 export runs its Linears on dynamic MXFP8 inputs; the A16 one
    on float inputs, and the two differ by a small amount (8-bit inputs)."""
    sims = {}
    for r in ("mxfp8", "mxfp8a16"):
        _quantize(tiny_dir, tmp_path / r, r)
        sims[r] = load_simulated(open_hf_dir(tmp_path / r))
    assert sims["mxfp8"].numerics["dynamic_inputs"] == sims["mxfp8"].numerics["quantized_linears"] == 14
    assert sims["mxfp8a16"].numerics["dynamic_inputs"] == 0
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.inference_mode():
        a, b = (sims[r].model(ids).logits for r in ("mxfp8", "mxfp8a16"))
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.5


@pytest.mark.parametrize(
    "recipe, fmt, weight",
    [("w8a16-int8", "pack-quantized", "weight_packed"), ("w8a16-fp8", "float-quantized", "weight")],
)
def test_w8a16_exports_are_weight_only(recipe, fmt, weight, tmp_path, tiny_dir):
    qc, t = _quantize(tiny_dir, tmp_path / recipe, recipe)
    assert qc["format"] == fmt and qc["config_groups"]["group_0"]["input_activations"] is None
    p = "model.layers.0.mlp.down_proj."
    assert p + weight in t and t[p + "weight_scale"].shape == (64, 1)
    assert not any(k.endswith("input_scale") for k in t)
    # vLLM's weight-only kernels load the scales in the model dtype (WNA16 params_dtype, Marlin FP8's
    # cast): fp8ptq chose them in bf16, so what the engine multiplies by is what was simulated
    s = t[p + "weight_scale"].float()
    assert torch.equal(s, s.to(torch.bfloat16).float())


MX_W = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "uint8"}
MX_A = {**MX_W, "dynamic": True}
BASE = {"name": "x", "description": "x", "calibration": {"weight_method": "rtn"}}


@pytest.mark.parametrize(
    "weights, acts, match",
    [
        (MX_W, {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}, "MXFP8 goes weights and"),
        ({"num_bits": 8, "type": "float", "strategy": "channel"}, MX_A, "MXFP8 goes weights and"),
        ({**MX_W, "scale_dtype": None}, None, "FP8 group weights are MXFP8"),
        ({**MX_W, "group_size": 64}, None, "FP8 group weights are MXFP8"),
        (MX_W, {**MX_A, "group_size": 16}, "FP8 group activations are MXFP8"),
        ({"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32, "scale_dtype": "uint8"}, None, "MX"),
    ],
)
def test_mx_halves_that_do_not_go_together_are_refused(weights, acts, match):
    scheme = {"weights": {k: v for k, v in weights.items() if v is not None}, "input_activations": acts}
    with pytest.raises(RecipeError, match=match):
        parse_recipe({**BASE, "scheme": scheme}, "x.yaml")
