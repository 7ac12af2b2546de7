"""Tier 3: FlattenQuant and SmoothQuant, through the code quantize runs, are exact on the real model (fp32)."""

import copy

import pytest
import torch

from fp8ptq.calibrate.state import CalibrationSetup, observe_layer, prepare
from fp8ptq.calibrate.transforms import SMOOTH_ROWS, flatten_layer, smooth_layer
from fp8ptq.data import load_samples
from fp8ptq.models.loader import resolve_model
from fp8ptq.models.skeleton import materialize, release
from fp8ptq.outliers.stats import StatsSpec
from fp8ptq.quantize.results import LayerResult
from fp8ptq.recipe import load_recipe

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("which", ["flatten", "smooth"])
def test_transform_is_exact_on_real_model(which):
    src = resolve_model("smollm2-135m")
    recipe = load_recipe("flatten-w8a8")
    if which == "smooth":  # fixed alpha so every layer really is smoothed (auto may decline)
        recipe = recipe.model_copy(update={"smooth": recipe.smooth.model_copy(update={"alpha": 0.5}), "flatten": None})
    ids = load_samples("builtin", src.tokenizer(), 4, 128, "calibration", 0)
    model, state = prepare(src, ids, CalibrationSetup(recipe, chunk_samples=2))
    worst, split, smoothed = 0.0, 0, 0
    try:
        for i, layer in enumerate(src.arch.decoder_layers(model)):
            prefix = src.arch.layer_prefix(i)
            materialize(layer, prefix, src, torch.float32, state.device)
            before = copy.deepcopy(layer)
            stats = observe_layer(layer, i, state, StatsSpec(rows=SMOOTH_ROWS), kv=False)
            res = LayerResult(i, prefix)
            if which == "flatten":
                rep = flatten_layer(layer, prefix, stats, recipe, res, src.arch.flatten)
                assert layer.mlp.down_proj.in_features == rep["width"] == 1664
                assert rep["input_amax"]["after"] < rep["input_amax"]["before"]
                split += rep["channels_split"]
            else:
                rep = smooth_layer(layer, prefix, stats, recipe, src, res)
                smoothed += sum(r["alpha"] is not None for r in rep.values())
            with torch.inference_mode():
                for _, first, x in state.each_chunk():
                    a, b = state.run_layer(before, i, x), state.run_layer(layer, i, x)
                    worst = max(worst, float((a - b).abs().max() / a.abs().max()))
                    state.write(first, a)
            release(layer)
    finally:
        state.store.close()
    print(
        f"{which}: worst relative layer-output difference {worst:.2e}, channels split {split}, "
        f"groups smoothed {smoothed}"
    )
    assert worst < 1e-5
    assert split > 0 or smoothed == 60
