"""Tier 2: the smooth transforms through the code quantize runs, on the tiny random Llama: AWQ's scales
(smooth.method awq, weight-only w4a16) over every group, down_proj's folded into up_proj's rows, leave
each layer's float function unchanged (fp32)."""

import copy

import pytest
import torch

from fp8ptq.calibrate.state import CalibrationSetup, observe_layer, prepare
from fp8ptq.calibrate.transforms import SMOOTH_ROWS, smooth_layer
from fp8ptq.data import load_samples
from fp8ptq.models.loader import resolve_model
from fp8ptq.models.skeleton import materialize, release
from fp8ptq.outliers.stats import StatsSpec
from fp8ptq.quantize.results import LayerResult
from fp8ptq.recipe import load_recipe, parse_recipe

pytestmark = pytest.mark.tiny


def test_awq_with_the_down_group_is_exact_in_fp32(tiny_dir):
    src = resolve_model(str(tiny_dir))
    data = load_recipe("w4a16").model_dump(mode="json")
    data["scheme"]["weights"]["group_size"] = 32
    smooth = {"method": "awq", "alpha": 0.5, "groups": ["qkv", "gate_up", "down"]}  # fixed: every group folds
    recipe = parse_recipe(data | {"smooth": smooth}, "awq")
    ids = load_samples("builtin", src.tokenizer(), 4, 64, "calibration", 0)
    model, state = prepare(src, ids, CalibrationSetup(recipe, chunk_samples=2))
    worst, folded = 0.0, set()
    try:
        for i, layer in enumerate(src.arch.decoder_layers(model)):
            prefix = src.arch.layer_prefix(i)
            materialize(layer, prefix, src, torch.float32, state.device)
            before = copy.deepcopy(layer)
            stats = observe_layer(layer, i, state, StatsSpec(rows=SMOOTH_ROWS), kv=False)
            res = LayerResult(i, prefix)
            rep = smooth_layer(layer, prefix, stats, recipe, src, res)
            folded |= {k for k, r in rep.items() if r["alpha"] is not None}
            assert f"{prefix}mlp.up_proj.weight" in res.float_tensors
            assert not torch.equal(layer.mlp.down_proj.weight, before.mlp.down_proj.weight)
            with torch.inference_mode():
                for _, first, x in state.each_chunk():
                    a, b = state.run_layer(before, i, x), state.run_layer(layer, i, x)
                    worst = max(worst, float((a - b).abs().max() / a.abs().max()))
                    state.write(first, a)
            release(layer)
    finally:
        state.store.close()
    assert folded == {"qkv", "gate_up", "down"} and worst < 1e-5
