"""Tier 2: the smooth transforms through the code quantize runs, on the tiny random Llama: AWQ's scales
(smooth.method awq, weight-only w4a16) over every group, down_proj's folded into up_proj's rows, leave
each layer's float function unchanged (fp32)."""

import pytest
import torch

from fp8ptq.calibrate.transforms import smooth_layer
from fp8ptq.recipe import load_recipe, parse_recipe

from helpers import transform_each_layer

pytestmark = pytest.mark.tiny


def test_awq_with_the_down_group_is_exact_in_fp32(tiny_dir):
    data = load_recipe("w4a16").model_dump(mode="json")
    data["scheme"]["weights"]["group_size"] = 32
    smooth = {"method": "awq", "alpha": 0.5, "groups": ["qkv", "gate_up", "down"]}  # fixed: every group folds
    recipe = parse_recipe(data | {"smooth": smooth}, "awq")

    def transform(layer, before, prefix, stats, src, res):
        rep = smooth_layer(layer, prefix, stats, recipe, src, res)
        assert f"{prefix}mlp.up_proj.weight" in res.float_tensors
        assert not torch.equal(layer.mlp.down_proj.weight, before.mlp.down_proj.weight)
        return {k for k, r in rep.items() if r["alpha"] is not None}

    worst, folded = transform_each_layer(str(tiny_dir), recipe, (4, 64), transform)
    assert set().union(*folded) == {"qkv", "gate_up", "down"} and worst < 1e-5
