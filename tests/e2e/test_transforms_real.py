"""Tier 3: FlattenQuant and SmoothQuant, through the code quantize runs, are exact on the real model (fp32)."""

import pytest

from fp8ptq.calibrate.transforms import flatten_layer, smooth_layer
from fp8ptq.recipe import load_recipe

from helpers import transform_each_layer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("which", ["flatten", "smooth"])
def test_transform_is_exact_on_real_model(which):
    recipe = load_recipe("flatten-w8a8")
    if which == "smooth":  # fixed alpha so every layer really is smoothed (auto may decline)
        recipe = recipe.model_copy(update={"smooth": recipe.smooth.model_copy(update={"alpha": 0.5}), "flatten": None})

    def transform(layer, _before, prefix, stats, src, res):
        if which == "flatten":
            rep = flatten_layer(layer, prefix, stats, recipe, res, src.arch.flatten)
            assert layer.mlp.down_proj.in_features == rep["width"] == 1664
            assert rep["input_amax"]["after"] < rep["input_amax"]["before"]
            return rep["channels_split"]
        rep = smooth_layer(layer, prefix, stats, recipe, src, res)
        return sum(r["alpha"] is not None for r in rep.values())

    worst, counts = transform_each_layer("smollm2-135m", recipe, (4, 128), transform)
    print(
        f"{which}: worst relative layer-output difference {worst:.2e}, channels split / groups smoothed {sum(counts)}"
    )
    assert worst < 1e-5
    assert sum(counts) > 0 if which == "flatten" else sum(counts) == 60
