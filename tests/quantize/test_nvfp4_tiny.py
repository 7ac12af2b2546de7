"""Tier 2: NVFP4 (`nvfp4a16`, `nvfp4` W4A4) on a tiny random Llama: the tensors vLLM's
CompressedTensorsW4A4Fp4 reads, one weight global scale per fused group (vLLM takes the shards' max),
a calibrated power-of-two input global scale shared by fused shards, and the simulation."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.calibrate import transforms
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.ops.fp4 import nvfp4_global_scale

from helpers import read_config, read_tensors

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def nvfp4_exports(tmp_path_factory, tiny_dir):
    out, searched = {}, []
    real = transforms.fake_quant_weight

    def spy(w, args, cal):  # the weight rounding SmoothQuant's alpha search scores candidates with
        searched.append(cal.weight_observer)
        return real(w, args, cal)

    for recipe in ("nvfp4a16", "nvfp4"):
        d = tmp_path_factory.mktemp("nvfp4") / recipe
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(transforms, "fake_quant_weight", spy)
            quantize(
                QuantizeConfig(model=str(tiny_dir), recipe=recipe, output=d, num_samples=4, seq_len=64, eval_samples=0)
            )
        out[recipe] = d
    out["searched"] = searched
    return out


@pytest.mark.parametrize("recipe", ["nvfp4a16", "nvfp4"])
def test_tensors_and_shared_global_scales(recipe, nvfp4_exports, tiny_dir):
    out = nvfp4_exports[recipe]
    assert read_config(out)["quantization_config"]["format"] == "nvfp4-pack-quantized"
    t, src = read_tensors(out), read_tensors(tiny_dir)
    p = "model.layers.0."
    assert t[p + "mlp.down_proj.weight_packed"].dtype == torch.uint8 and t[p + "mlp.down_proj.weight_packed"].shape == (
        64,
        64,
    )
    assert t[p + "mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn and t[
        p + "mlp.down_proj.weight_scale"
    ].shape == (64, 8)
    qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
    gs = [t[n + ".weight_global_scale"] for n in qkv]
    assert all(torch.equal(g, gs[0]) for g in gs)  # one for the fused q/k/v GEMM
    # nvfp4 smooths (SmoothQuant folds 1/s into the norm, s into the weights) where it measurably
    # helps: the global scale is the smoothed stack's, s read back from the exported norm
    norm = p + "input_layernorm.weight"
    s_eff = src[norm].float() / t[norm].float()
    stacked = torch.cat([src[n + ".weight"].float() * s_eff for n in qkv])
    assert torch.equal(gs[0], nvfp4_global_scale(stacked.float()))
    if recipe == "nvfp4":
        ig = [t[n + ".input_global_scale"] for n in qkv]
        assert all(torch.equal(g, ig[0]) for g in ig) and ig[0].dtype == torch.float32
        m, e = torch.frexp(ig[0])
        assert m.item() == 0.5  # a power of two: its reciprocal, the simulated scale, is exact
    else:
        assert not any(k.endswith("input_global_scale") for k in t)


def test_w4a4_smoothing_screens_with_min_max_then_scores_with_the_recipes_rounding(nvfp4_exports):
    # nvfp4 smooths and rounds weights with hessian_mse: all 9 candidates (none + 8 alphas) are screened
    # with min-max weights, the best 3 scored with hessian_mse. nvfp4a16 has no smoothing: no search.
    searched = nvfp4_exports["searched"]
    assert searched.count("hessian_mse") > 0 and searched.count("minmax") == 3 * searched.count("hessian_mse")
    assert set(searched) == {"minmax", "hessian_mse"}


def test_w4a4_simulates_static_fp4_inputs(nvfp4_exports):
    sim = load_simulated(open_hf_dir(nvfp4_exports["nvfp4"]))
    assert sim.numerics["static_inputs"] == sim.numerics["quantized_linears"] == 14
    assert sim.numerics["dynamic_inputs"] == 0
