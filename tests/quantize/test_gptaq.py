"""GPTQ towards the float model's output (calibration.gptq_float_target, calibrate/gptaq.py): the closed form
against a direct least-squares solve, the cross term's chunked sum, the recipe rule, and one tiny-model run
through the code quantize runs (the option moves the weights before GPTQ, the export is the simulation, and a
run without the option is unchanged by it)."""

import json

import pytest
import torch

from fp8ptq.api import QuantizeConfig
from fp8ptq.calibrate.gptaq import CrossTerm, toward_float
from fp8ptq.dist import LocalComm
from fp8ptq.errors import RecipeError
from fp8ptq.recipe import Calibration, load_recipe, parse_recipe
from fp8ptq.recipe_files import recipe_yaml

from helpers import decompression_mismatches, quantize_recording, read_tensors


def _streams(seed=0, n=2048, d=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.linspace(0.2, 2.0, d)  # the float model's inputs
    drift = torch.randn(d, d, generator=g) * 0.05  # what the quantized past did to them, plus noise
    xq = x + x @ drift + 0.05 * torch.randn(n, d, generator=g)
    return x, xq, torch.randn(16, d, generator=g)


def test_alpha_one_is_the_least_squares_map_and_zero_is_plain_gptq():
    x, xq, w = _streams()
    H, D = 2 * xq.T @ xq, 2 * (x - xq).T @ xq
    cal = Calibration(weight_method="gptq", gptq_damp=1e-9, gptq_float_target=1.0)
    moved = toward_float({"w": w}, D, H, cal)["w"]
    direct = torch.linalg.lstsq(xq.double(), (x @ w.T).double()).solution.T.float()  # argmin ||x w^T - xq v^T||
    assert torch.allclose(moved, direct, atol=1e-4), (moved - direct).abs().max()
    err = lambda v: float(((x @ w.T - xq @ v.T) ** 2).sum())  # noqa: E731
    assert err(moved) < 0.5 * err(w)  # the float target is much closer from the moved weight
    half = toward_float({"w": w}, D, H, cal.model_copy(update={"gptq_float_target": 0.5}))["w"]
    assert torch.allclose(half, w + 0.5 * (moved - w), atol=1e-4)  # alpha: how far towards it
    assert toward_float({"w": w}, None, H, cal)["w"] is w  # no recorded float inputs: untouched


def test_the_cross_term_is_summed_chunk_by_chunk_as_one_product():
    x, xq, _ = _streams(seed=1)
    chunks = {c: x[c * 512 : (c + 1) * 512] for c in range(4)}
    cross = CrossTerm(dict(chunks))
    for c in range(4):
        cross.add(c, xq[c * 512 : (c + 1) * 512].reshape(2, 256, -1))  # [n, seq, in] as a pass sees it
    assert torch.allclose(cross.total(LocalComm()), 2 * (x - xq).T @ xq, rtol=1e-4, atol=1e-3)
    assert cross.float_inputs == {}  # each chunk's float inputs are dropped once added
    assert CrossTerm.of({}, ("q_proj",)) is None


def test_the_option_needs_gptq_and_is_written_only_when_set():
    data = load_recipe("w4a16").model_dump(mode="json")
    data["calibration"] |= {"weight_method": "rtn", "gptq_float_target": 0.5}
    with pytest.raises(RecipeError, match="gptq_float_target.*weight_method gptq"):
        parse_recipe(data, "test")
    assert "gptq_float_target" not in recipe_yaml(load_recipe("fp8-kv8"))  # outputs of other recipes hash as before
    data["calibration"]["weight_method"] = "gptq"
    assert "gptq_float_target: 0.5" in recipe_yaml(parse_recipe(data, "test"))


@pytest.mark.tiny
def test_quantize_moves_the_weights_and_exports_the_simulation(tmp_path, tiny_dir):
    runs = {}
    for name, alpha in (("gptq", 0), ("gptaq", 0.5)):  # w4a16 itself runs with 0.25
        sets = (f"calibration.gptq_float_target={alpha}",)
        out = tmp_path / name
        cfg = dict(num_samples=8, seq_len=64, eval_samples=4, sets=sets, weights="gptq")
        fakes = quantize_recording(QuantizeConfig(model=str(tiny_dir), recipe="w4a16", output=out, **cfg))
        runs[name] = (out, fakes, json.loads((out / "fp8ptq_manifest.json").read_text()))
    (_, plain, _), (out, moved, manifest) = runs["gptq"], runs["gptaq"]
    first = "model.layers.0.self_attn.q_proj"  # its input is the embedding in both streams: nothing to move
    assert torch.equal(plain[first], moved[first])
    later = [n for n in plain if n.startswith("model.layers.1.")]
    assert later and all(not torch.equal(plain[n], moved[n]) for n in later)
    assert decompression_mismatches(out, moved) == []
    assert manifest["recipe"]["calibration"]["gptq_float_target"] == 0.5
    assert read_tensors(out).keys() == read_tensors(runs["gptq"][0]).keys()
