"""Tier 2: W4A8-FP8 (`w4a8-fp8`) on a tiny random Llama: --group-size, the exported layout (vLLM's
CompressedTensorsW4A8Fp8: pack-quantized INT4 + FP8 per-token inputs, the format written per group so
loaders that infer it per module agree), group scales on vLLM's per-row FP8 grid, and the simulation."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.ops.intq import fp8_row_group_scales

from helpers import read_config, read_tensors

pytestmark = pytest.mark.tiny


def test_group_128_on_a_64_wide_model_is_refused_before_work(tmp_path, tiny_dir):
    with pytest.raises(RecipeError, match="group_size 128 does not divide"):
        quantize(QuantizeConfig(model=str(tiny_dir), recipe="w4a8-fp8", output=tmp_path / "o", eval_samples=0))
    with pytest.raises(RecipeError, match="--group-size needs a recipe with group weights; 'fp8-dynamic'"):
        quantize(QuantizeConfig(model=str(tiny_dir), recipe="fp8-dynamic", output=tmp_path / "o", group_size=32))
    assert not (tmp_path / "o").exists()


def test_export_layout_and_scales(tmp_path, tiny_dir):
    out = tmp_path / "q"
    quantize(
        QuantizeConfig(
            model=str(tiny_dir), recipe="w4a8-fp8", output=out, group_size=32, num_samples=4, seq_len=64, eval_samples=0
        )
    )
    qc = read_config(out)["quantization_config"]
    g = qc["config_groups"]["group_0"]
    assert qc["format"] == g["format"] == "pack-quantized"
    assert (g["weights"]["num_bits"], g["weights"]["group_size"], g["weights"]["symmetric"]) == (4, 32, True)
    assert (g["input_activations"]["type"], g["input_activations"]["strategy"]) == ("float", "token")
    t = read_tensors(out)
    assert t["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    s = t["model.layers.0.mlp.down_proj.weight_scale"].float()
    assert s.shape == (64, 4) and torch.equal(fp8_row_group_scales(s), s)  # already on vLLM's grid
    sim = load_simulated(open_hf_dir(out))
    assert sim.numerics["dynamic_inputs"] == sim.numerics["quantized_linears"] == 14


def test_awq_scales_a_weight_only_recipe_exactly_where_it_measurably_helps(tmp_path, tiny_dir):
    """w4a16 + `--set smooth.method=awq`: AWQ's scales are searched per layer and group on the output
    error of the recipe's own 4-bit rounding, and folded into the norm (the exported norm is the source's
    divided by the scales where an alpha won; untouched where "none" won)."""
    out = tmp_path / "awq"
    m = quantize(
        QuantizeConfig(
            model=str(tiny_dir),
            recipe="w4a16",
            output=out,
            group_size=32,
            num_samples=8,
            seq_len=64,
            eval_samples=2,
            sets=("smooth.method=awq", "smooth.alphas=[0.25, 0.5, 0.75]"),
        )
    )
    assert m.recipe["smooth"]["method"] == "awq"
    src, t = read_tensors(tiny_dir), read_tensors(out)
    won = 0
    for i, layer in enumerate(m.layers):
        for key, norm in (("qkv", "input_layernorm"), ("gate_up", "post_attention_layernorm")):
            rep = layer["transforms"]["smooth"][key]
            name = f"model.layers.{i}.{norm}.weight"
            if rep["alpha"] is None:
                assert torch.equal(t[name], src[name])
            else:
                won += 1
                final = {k: v for k, v in rep["errors"].items() if k != "screen"}  # rescored with MSE rounding
                assert final[f"{rep['alpha']:g}"] == min(final.values()) < final.get("none", float("inf"))
                assert not torch.equal(t[name], src[name])
    assert won > 0 and m.quality.kl < 1.0
