"""`quantize --weights rtn|gptq` and `--smooth-alpha` override the recipe, stated in manifest and report."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.models.loader import open_hf_dir

pytestmark = pytest.mark.tiny
O_PROJ = "model.layers.1.self_attn.o_proj"


def _is_rtn(out, src) -> bool:
    """Every FP8 weight is its source weight rounded to nearest with the stored scale."""
    q = open_hf_dir(out)
    packed, scale = q.tensor(f"{O_PROJ}.weight"), q.tensor(f"{O_PROJ}.weight_scale")
    w = open_hf_dir(src).tensor(f"{O_PROJ}.weight").float()
    rtn = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch.equal(packed.view(torch.uint8), rtn.view(torch.uint8))


def test_weights_rtn_overrides_gptq(tiny_dir, tmp_path):
    runs = {}
    for weights in (None, "rtn"):
        out = tmp_path / f"q-{weights}"
        cfg = QuantizeConfig(
            model=str(tiny_dir),
            recipe="fp8-kv8",
            output=out,
            num_samples=4,
            seq_len=48,
            eval_samples=0,
            weights=weights,
        )
        runs[weights] = (out, quantize(cfg))
    (gptq_out, gptq), (rtn_out, rtn) = runs[None], runs["rtn"]
    assert gptq.recipe["calibration"]["weight_method"] == "gptq"
    assert rtn.recipe["calibration"]["weight_method"] == "rtn"
    assert rtn.calibration is not None  # static activations and the KV cache still calibrate
    assert _is_rtn(rtn_out, tiny_dir) and not _is_rtn(gptq_out, tiny_dir)
    assert "RTN (round to nearest)" in (rtn_out / "report.md").read_text()
    assert "GPTQ" in (gptq_out / "report.md").read_text()


def test_weights_rtn_makes_w4a16_data_free(tiny_dir, tmp_path):
    out = tmp_path / "w4"
    m = quantize(QuantizeConfig(model=str(tiny_dir), recipe="w4a16", output=out, eval_samples=0, weights="rtn"))
    assert m.calibration is None and m.recipe["calibration"]["weight_method"] == "rtn"
    assert "gptq_float_target" not in m.recipe["calibration"]  # w4a16's float target (GPTQ's) is dropped: 0


def test_smooth_alpha_fixes_the_alpha_without_a_search(tiny_dir, tmp_path):
    m = quantize(
        QuantizeConfig(
            model=str(tiny_dir),
            recipe="w8a8-int8",
            output=tmp_path / "int8",
            num_samples=4,
            seq_len=48,
            eval_samples=0,
            smooth_alpha="0.8",
        )
    )
    assert m.recipe["smooth"]["alpha"] == 0.8
    smooth = [layer["transforms"]["smooth"] for layer in m.layers]
    groups = [g for s in smooth for g in s.values()]
    assert len(groups) == 2 * len(m.layers)  # q/k/v and gate/up in every layer, none declined
    assert all(g["alpha"] == 0.8 and g["errors"] == {} for g in groups)  # no candidate was scored


def test_set_changes_any_recipe_key_and_the_recipe_judges_it(tiny_dir, tmp_path):
    from fp8ptq.errors import RecipeError
    from fp8ptq.recipe import load_recipe
    from fp8ptq.runs.overrides import recipe_overrides

    def run(*sets, recipe="w4a16"):
        cfg = QuantizeConfig(model=str(tiny_dir), recipe=recipe, output=tmp_path / "o", sets=sets)
        return recipe_overrides(cfg, load_recipe(recipe))

    r = run("calibration.gptq_damp=0.05", "scheme.weights.group_size=32", "gates=[kl<=0.4]")
    assert (r.calibration.gptq_damp, r.scheme.weights.group_size, r.gates) == (0.05, 32, ("kl<=0.4",))
    # a section the recipe leaves out is started; the alias flag and its key give the same recipe
    assert run("smooth.alpha=0.8", recipe="fp8-dynamic").smooth.alpha == 0.8
    alias = QuantizeConfig(model=str(tiny_dir), recipe="w8a8-int8", output=tmp_path / "o", smooth_alpha="0.5")
    assert recipe_overrides(alias, load_recipe("w8a8-int8")) == run("smooth.alpha=0.5", recipe="w8a8-int8")
    for bad, phrase in [
        ("calibration.gptq_dampp=0.05", "gptq_dampp"),  # the recipe's own validation names the key
        ("calibration.gptq_damp=high", "gptq_damp"),
        ("calibration", "is not KEY=VALUE"),
        ("scheme.weights.num_bits.x=1", "'scheme.weights.num_bits' is a value, not a section"),
        ("gates=[kl<=0.4", "is not a YAML value"),
    ]:
        with pytest.raises(RecipeError, match=None) as err:
            run(bad)
        assert phrase in str(err.value), (bad, str(err.value))
