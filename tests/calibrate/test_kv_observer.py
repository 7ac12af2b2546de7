"""`calibration.kv_observer`: KV-cache scales chosen by the MSE clip search instead of the calibration max."""

import pytest
import torch
import yaml

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.recipe import load_recipe

from helpers import read_tensors

pytestmark = pytest.mark.tiny

RATIOS = torch.linspace(0.5, 1.0, 26)  # the mse observer's clip-ratio grid


def _recipe(tmp_path, **calibration):
    data = load_recipe("fp8-kv8").model_dump(mode="json")
    data["calibration"].update(calibration, weight_method="rtn")
    data["gates"] = []
    path = tmp_path / f"kv-{len(calibration)}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_kv_observer_mse_clips_only_the_kv_scales(tmp_path, tiny_dir):
    runs = {}
    for name, cal in (("minmax", {}), ("mse", {"kv_observer": "mse"})):
        out = tmp_path / name
        cfg = dict(model=str(tiny_dir), recipe=_recipe(tmp_path, **cal), output=out, num_samples=4, seq_len=64)
        manifest = quantize(QuantizeConfig(**cfg, eval_samples=0))
        assert manifest.recipe["calibration"]["kv_observer"] == name
        runs[name] = read_tensors(out)
    p = "model.layers.0.self_attn."
    # layer 0's inputs are identical in both runs: its input scale is the same, its KV scales differ only
    # by a clip ratio from the search grid (<= 1: MSE never widens the range past the maximum)
    assert torch.equal(runs["mse"][p + "q_proj.input_scale"], runs["minmax"][p + "q_proj.input_scale"])
    for k in ("k_scale", "v_scale"):
        ratio = float(runs["mse"][p + k] / runs["minmax"][p + k])
        assert torch.isclose(RATIOS, torch.tensor(ratio), atol=1e-5).any(), (k, ratio)


def test_kv_observer_rejects_unknown(tmp_path):
    data = load_recipe("fp8-kv8").model_dump(mode="json")
    data["calibration"]["kv_observer"] = "percentile"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match="kv_observer"):
        load_recipe(str(path))


def test_kv_observer_constant_writes_unit_scales_and_simulates_them(tmp_path, tiny_dir):
    """`constant`: k_scale = v_scale = 1.0 in every layer (what vLLM uses without KV scales), the data's
    amax still reported; the quality check runs the KV quantizer at that scale, so the simulated KL differs
    from the calibrated run's."""
    runs = {}
    for name, cal in (("constant", {"kv_observer": "constant"}), ("minmax", {})):
        cfg = dict(model=str(tiny_dir), recipe=_recipe(tmp_path, **cal), output=tmp_path / name)
        runs[name] = quantize(QuantizeConfig(**cfg, num_samples=4, seq_len=64, eval_samples=2))
    tensors = read_tensors(tmp_path / "constant")
    scales = [t.float() for k, t in tensors.items() if k.endswith(("k_scale", "v_scale"))]
    assert scales and all(torch.equal(t, torch.ones_like(t)) for t in scales)
    amax = [layer["kv"]["k_amax"] for layer in runs["constant"].layers if "kv" in layer]
    assert amax and all(a > 0 for a in amax)
    assert runs["constant"].quality.kl != runs["minmax"].quality.kl
