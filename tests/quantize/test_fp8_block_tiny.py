"""Tier 2: block FP8 (`fp8-block`) on tiny random Llamas (64 wide): --block-size, the refusal of blocks
that do not tile a Linear (before any work, naming the tensor, its shape and the sizes that fit), the
exported tensors and config, and GPTQ on the block grid as a recipe option."""

import pytest
import torch
import yaml

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import OptionError, RecipeError
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.recipe import load_recipe

from helpers import read_config, read_tensors

pytestmark = pytest.mark.tiny


def _quantize(src, out, recipe="fp8-block", **kw):
    return quantize(QuantizeConfig(model=str(src), recipe=recipe, output=out, eval_samples=0, **kw))


def test_128_blocks_on_a_64_wide_model_are_refused_before_work(tmp_path, tiny_dir):
    with pytest.raises(RecipeError) as e:
        _quantize(tiny_dir, tmp_path / "o")
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj [64, 64] is not whole 128x128 blocks" in msg, msg
    assert "--block-size" in msg and "8, 16, 32" in msg, msg
    assert not (tmp_path / "o").exists()


def test_block_size_needs_a_block_recipe_and_a_sane_value(tmp_path, tiny_dir):
    with pytest.raises(RecipeError, match="--block-size needs a recipe with block weights; 'fp8-dynamic'"):
        _quantize(tiny_dir, tmp_path / "o", recipe="fp8-dynamic", block_size=32)
    with pytest.raises(OptionError, match="--block-size 3 is out of range"):
        _quantize(tiny_dir, tmp_path / "o", block_size=3)
    with pytest.raises(RecipeError, match="power of two"):
        _quantize(tiny_dir, tmp_path / "o", block_size=48)


def test_export_is_block_fp8_with_token_group_inputs(tmp_path, tiny_dir):
    out = tmp_path / "q"
    m = _quantize(tiny_dir, out, block_size=32)
    assert m.calibration is None  # data-free
    group = read_config(out)["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [32, 32]
    acts = group["input_activations"]
    assert (acts["strategy"], acts["group_size"], acts["dynamic"]) == ("group", 32, True)
    t = read_tensors(out)
    w, s = t["model.layers.0.mlp.down_proj.weight"], t["model.layers.0.mlp.down_proj.weight_scale"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (64, 128)
    assert s.dtype == torch.float32 and s.shape == (2, 4)
    assert t["model.layers.0.self_attn.k_proj.weight_scale"].shape == (1, 2)  # [32, 64]: fused shard, own blocks
    sim = load_simulated(open_hf_dir(out))
    assert sim.numerics["dynamic_inputs"] == sim.numerics["quantized_linears"] == 14


def test_gptq_on_the_block_grid(tmp_path, tiny_dir):
    r = load_recipe("fp8-block").model_dump(mode="json")
    r["calibration"]["weight_method"] = "gptq"
    f = tmp_path / "gptq.yaml"
    f.write_text(yaml.safe_dump(r))
    m = _quantize(tiny_dir, tmp_path / "g", recipe=str(f), block_size=32, num_samples=4, seq_len=64)
    m_rtn = _quantize(tiny_dir, tmp_path / "r", block_size=32)
    assert m.calibration is not None and m_rtn.calibration is None
    w = read_tensors(tmp_path / "g")["model.layers.1.mlp.gate_proj.weight"]
    assert not torch.equal(w, read_tensors(tmp_path / "r")["model.layers.1.mlp.gate_proj.weight"])


def test_gptq_act_order_and_mse_on_the_block_grid(tmp_path, tiny_dir):
    """Act-order visits columns out of block order, so every block's scale is chosen up front from the
    original weight (static groups): the exported scale is then that block's min-max scale, and every
    weight is on its block's grid. With weight_observer mse the scales come from the clip search."""
    r = load_recipe("fp8-block").model_dump(mode="json")
    r["calibration"].update(weight_method="gptq", gptq_act_order=True)
    f = tmp_path / "a.yaml"
    f.write_text(yaml.safe_dump(r))
    _quantize(tiny_dir, tmp_path / "a", recipe=str(f), block_size=32, num_samples=4, seq_len=64)
    src = read_tensors(tiny_dir)
    t = read_tensors(tmp_path / "a")
    name = "model.layers.1.mlp.down_proj"
    w, s = t[f"{name}.weight"], t[f"{name}.weight_scale"]
    blocks = src[f"{name}.weight"].float().reshape(2, 32, 4, 32).abs().amax(dim=(1, 3))
    assert torch.equal(s, (blocks / 448.0).float())  # min-max of the original blocks
    rtn = (src[f"{name}.weight"].float() / s.repeat_interleave(32, 0).repeat_interleave(32, 1)).to(w.dtype)
    assert w.dtype == torch.float8_e4m3fn and not torch.equal(w.float(), rtn.float())  # GPTQ moved codes
    r["calibration"]["weight_observer"] = "mse"
    f.write_text(yaml.safe_dump(r))
    _quantize(tiny_dir, tmp_path / "m", recipe=str(f), block_size=32, num_samples=4, seq_len=64)
    s_mse = read_tensors(tmp_path / "m")[f"{name}.weight_scale"]
    assert s_mse.shape == s.shape and bool((s_mse <= s).all())  # a clip search only shrinks


def test_mse_needs_a_grid_that_searches(tmp_path):
    r = load_recipe("fp8-dynamic").model_dump(mode="json")
    r["calibration"]["weight_observer"] = "mse"
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(r))
    with pytest.raises(RecipeError, match="weight_observer mse with FP8 channel weights"):
        load_recipe(str(f))
