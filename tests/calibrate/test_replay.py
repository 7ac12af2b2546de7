"""Replaying a block's module outputs across its passes (calibrate/replay.py) changes no bit of the
result, and it does run fewer forwards (the attention norm and q/k/v projections once per chunk)."""

from __future__ import annotations

import pytest
import torch

from fp8ptq.calibrate import pipeline
from fp8ptq.calibrate.replay import Replay
from fp8ptq.calibrate.state import CalibrationSetup
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.recipe import load_recipe


def _calibrate(path, recipe: str, ids, calls: dict | None = None):
    src = open_hf_dir(path)
    out = {}
    setup = CalibrationSetup(load_recipe(recipe), chunk_samples=2)

    def on_layer(res, _state):
        for name, q in res.linears.items():
            out[name] = (q.weight.clone(), {k: v.clone() for k, v in q.params.items()})
        out.update({k: (v.clone(), {}) for k, v in res.kv_scales.items()})

    if calls is None:
        pipeline.calibrate(src, load_recipe(recipe), ids, on_layer, setup=setup)
        return out
    # count computations, not calls: a replayed module's class forward (hence F.linear) does not run
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    linear, norms = torch.nn.functional.linear, {c: c.forward for c in (LlamaRMSNorm, Qwen3RMSNorm)}

    def count(kind, fn):
        def wrapped(*a, **k):
            calls[kind] = calls.get(kind, 0) + 1
            return fn(*a, **k)

        return wrapped

    torch.nn.functional.linear = count("linear", linear)
    for c, fwd in norms.items():
        c.forward = count("norm", fwd)
    try:
        pipeline.calibrate(src, load_recipe(recipe), ids, on_layer, setup=setup)
    finally:
        torch.nn.functional.linear = linear
        for c, fwd in norms.items():
            c.forward = fwd
    return out


@pytest.mark.tiny
@pytest.mark.parametrize(
    ("model_type", "recipe", "kv"),
    [("llama", "fp8-kv8", True), ("qwen3", "w4a16-kv8", True), ("llama", "w8a8-int8", False)],
)
def test_replay_is_bit_identical_and_saves_forwards(tiny_model, monkeypatch, model_type, recipe, kv):
    path = tiny_model(model_type)
    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
    with_calls: dict = {}
    replayed = _calibrate(path, recipe, ids, with_calls)
    monkeypatch.setattr(Replay, "want", lambda *a, **k: None)  # nothing recorded: every pass recomputes
    plain_calls: dict = {}
    plain = _calibrate(path, recipe, ids, plain_calls)
    assert replayed.keys() == plain.keys() and replayed
    for name, (w, params) in plain.items():
        assert torch.equal(replayed[name][0], w), name
        for k, v in params.items():
            assert torch.equal(replayed[name][1][k], v), (name, k)
    if kv:  # q/k/v run in the KV pass and again in o_proj's stats pass: replayed there
        assert with_calls["linear"] < plain_calls["linear"], (with_calls, plain_calls)
    else:  # q/k/v's outputs are needed by one later pass only: computed there, not recorded
        assert with_calls["linear"] == plain_calls["linear"], (with_calls, plain_calls)
    assert with_calls["norm"] < plain_calls["norm"], (with_calls, plain_calls)
