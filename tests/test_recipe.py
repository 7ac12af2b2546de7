from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from fp8ptq.errors import RecipeError
from fp8ptq.recipe import builtin_names, load_recipe, parse_recipe
from fp8ptq.recipe_files import recipe_record, recipe_yaml


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_recipes_round_trip(name):
    r = load_recipe(name)
    assert r.name == name
    assert parse_recipe(yaml.safe_load(recipe_yaml(r)), "round-trip") == r


def test_builtins_present():
    assert {"fp8-kv8", "fp8-dynamic"} <= set(builtin_names())
    assert load_recipe("fp8-kv8").needs_data and not load_recipe("fp8-dynamic").needs_data


def test_unknown_key_is_named_with_valid_keys():
    data = yaml.safe_load(recipe_yaml(load_recipe("fp8-kv8")))
    data["calibration"]["num_sampels"] = 3
    with pytest.raises(RecipeError) as e:
        parse_recipe(data, "x.yaml")
    assert "num_sampels" in str(e.value) and "num_samples" in str(e.value)


def test_unknown_name_lists_builtins():
    with pytest.raises(RecipeError) as e:
        load_recipe("fp9-magic")
    assert "fp9-magic" in str(e.value) and "fp8-kv8" in str(e.value)


def test_invalid_combination_rejected():
    data = yaml.safe_load(recipe_yaml(load_recipe("fp8-kv8")))
    data["scheme"]["input_activations"]["dynamic"] = True  # dynamic per-tensor: not a scheme we export
    with pytest.raises(RecipeError, match="input_activations"):
        parse_recipe(data, "x.yaml")


def test_recipe_is_frozen():
    r = load_recipe("fp8-kv8")
    with pytest.raises(ValidationError):
        r.name = "other"
    with pytest.raises(TypeError, match="frozen"):
        r.scheme.weights.num_bits = 4


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s["input_activations"].update(group_size=64), "need input_activations"),
        (lambda s: s["input_activations"].update(strategy="token", group_size=None), "need input_activations"),
        (lambda s: s["weights"].update(block_structure=[128, 64]), "must be square"),
        (lambda s: s["input_activations"].update(dynamic=False), "dynamic"),
        (lambda s: s["weights"].update(strategy="channel", block_structure=None), "go with block weights"),
    ],
)
def test_block_fp8_pairing_is_checked(edit, match):
    data = yaml.safe_load(recipe_yaml(load_recipe("fp8-block")))
    edit(data["scheme"])
    with pytest.raises(RecipeError, match=match):
        parse_recipe(data, "x.yaml")


def test_w4a8_fp8_needs_fp8_group_scales_and_only_it_takes_them():
    data = yaml.safe_load(recipe_yaml(load_recipe("w4a8-fp8")))
    data["calibration"]["group_scales"] = "bf16"
    with pytest.raises(RecipeError, match="W4A8-FP8 needs calibration.group_scales: fp8"):
        parse_recipe(data, "x.yaml")
    data = yaml.safe_load(recipe_yaml(load_recipe("w8a8-int8")))
    data["calibration"]["group_scales"] = "fp8"
    with pytest.raises(RecipeError, match="group_scales fp8 is for symmetric 4-bit"):
        parse_recipe(data, "x.yaml")
    data = yaml.safe_load(recipe_yaml(load_recipe("w4a16")))
    data["scheme"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    with pytest.raises(RecipeError, match="W4A8-FP8"):  # asymmetric INT4 has no W4A8 kernel
        parse_recipe(data, "x.yaml")


def test_fp8_channel_weights_refuse_a_weight_search_unless_a_mixed_part_takes_it():
    """The FP8 handler's calibration rule (quantization/schemes/fp8.py `check_calibration`): per-channel FP8
    scales are min-max; a mixed recipe's search is its 4-bit part's, so its FP8 main scheme passes."""
    data = yaml.safe_load(recipe_yaml(load_recipe("fp8-dynamic")))
    data["calibration"]["weight_observer"] = "mse"
    with pytest.raises(RecipeError, match="weight_observer mse with FP8 channel weights"):
        parse_recipe(data, "x.yaml")
    data = yaml.safe_load(recipe_yaml(load_recipe("mixed-w4-w8")))
    data["scheme"]["weights"] = {"num_bits": 8, "type": "float", "strategy": "channel"}
    data["scheme"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    assert parse_recipe(data, "x.yaml").calibration.weight_observer == "mse"


@pytest.mark.parametrize(
    "flags",
    [
        {"group_size": 64},
        {"group_size": 32},
        {"block_size": 64},
        {"smooth_alpha": "0.5"},
        {"tp": 2},
        {"int4_fraction": 0.3},
    ],
)
def test_a_flag_the_recipe_lacks_names_built_in_recipes_that_take_it(flags):
    """The fix of `--group-size on fp8-dynamic` (and the other alias flags) names built-in recipes found
    in the recipe files, and each one named really takes the flag."""
    import re

    from fp8ptq.runs.config import QuantizeConfig
    from fp8ptq.runs.overrides import recipe_overrides

    cfg = QuantizeConfig(model="m", recipe="fp8-dynamic", output="o", **flags)
    with pytest.raises(RecipeError, match="needs a recipe with") as err:
        recipe_overrides(cfg, load_recipe("fp8-dynamic"))
    named = re.findall(r"[\w.-]+", err.value.fix.split(" use ", 1)[1].replace(" or ", ", "))
    named = [n for n in named if n in builtin_names()]
    assert named, err.value.fix
    for name in named:
        recipe_overrides(QuantizeConfig(model="m", recipe=name, output="o", **flags), load_recipe(name))


def test_awq_is_the_smooth_method_weight_only_recipes_take():
    """smooth.method awq works without input activations; SmoothQuant still needs them (the error says
    awq). Recipes that leave method at smoothquant are written and recorded without the key, as before."""
    from fp8ptq.recipe_files import recipe_record

    data = load_recipe("w4a16").model_dump(mode="json")
    with pytest.raises(RecipeError, match="it needs input_activations .weight-only recipes: smooth.method awq"):
        parse_recipe(data | {"smooth": {"alpha": "auto"}}, "t")
    awq = parse_recipe(data | {"smooth": {"method": "awq"}}, "t")
    assert awq.smooth.method == "awq" and recipe_record(awq)["smooth"]["method"] == "awq"
    assert "method: awq" in recipe_yaml(awq)
    sq = load_recipe("w8a8-int8")
    assert sq.smooth.method == "smoothquant" and "method" not in recipe_record(sq)["smooth"]
    assert "method" not in yaml.safe_load(recipe_yaml(sq))["smooth"]
    assert yaml.safe_load(recipe_yaml(load_recipe("fp8-kv8")))["smooth"] is None  # no section: unchanged


def test_every_benchmark_recipe_parses():
    """benchmarks/recipes/ are run by hand from BENCHMARKS.md: a key renamed since must fail here, not there."""
    paths = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "recipes").glob("*.yaml"))
    assert len(paths) > 20
    for p in paths:
        assert load_recipe(str(p)).name == p.stem, p


def test_rounding_keys_are_written_only_when_set():
    plain = load_recipe("w4a16")
    assert "rounding" not in recipe_yaml(plain) and "rounding" not in str(recipe_record(plain))
    data = plain.model_dump(mode="json")
    data["calibration"] |= {"rounding": "signround", "rounding_iters": 50}
    r = parse_recipe(data, "signround")
    assert r.needs_data and "rounding: signround" in recipe_yaml(r) and "rounding_iters: 50" in recipe_yaml(r)
    assert parse_recipe(yaml.safe_load(recipe_yaml(r)), "round-trip") == r
    assert recipe_record(r)["calibration"]["rounding"] == "signround"
