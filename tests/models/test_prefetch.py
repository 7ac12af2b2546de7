"""Reading layer i+1 in a thread while layer i calibrates (models/prefetch.py, on by default on CUDA)
loads the same values as `materialize`: the calibration result is bit-identical, and a non-finite
weight is still refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8ptq.calibrate import pipeline
from fp8ptq.calibrate.state import CalibrationSetup
from fp8ptq.errors import NonFiniteError
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.recipe import load_recipe


def _calibrate(path, ids, prefetch: bool) -> dict:
    recipe = load_recipe("fp8-kv8")
    out: dict = {}

    def on_layer(res, _state):
        for name, q in res.linears.items():
            out[name] = (q.weight.clone(), {k: v.clone() for k, v in q.params.items()})
        out.update({k: (v.clone(), {}) for k, v in res.kv_scales.items()})

    setup = CalibrationSetup(recipe, chunk_samples=2, prefetch=prefetch)
    pipeline.calibrate(open_hf_dir(path), recipe, ids, on_layer, setup=setup)
    return out


@pytest.mark.tiny
def test_prefetched_layers_calibrate_bit_identically(tiny_model):
    path = tiny_model("llama", layers=3)
    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(1))
    plain, fetched = _calibrate(path, ids, False), _calibrate(path, ids, True)
    assert plain.keys() == fetched.keys() and len(plain) > 20
    for name, (w, params) in plain.items():
        assert torch.equal(fetched[name][0], w), name
        assert params.keys() == fetched[name][1].keys(), name
        for k, v in params.items():
            assert torch.equal(fetched[name][1][k], v), (name, k)


@pytest.mark.tiny
def test_prefetch_refuses_a_non_finite_weight_by_name(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model("llama", layers=3), broken)
    shard = next(broken.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.2.mlp.up_proj.weight"
    tensors[name][3, 5] = float("inf")  # the last layer: read by the thread while layer 1 calibrates
    save_file(tensors, str(shard), metadata={"format": "pt"})
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError, match=rf"tensor '{name}' has 1 non-finite values"):
        _calibrate(broken, ids, True)
