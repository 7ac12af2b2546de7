"""Tier 2: SignRound (calibration.rounding: signround, issue 37) through the code quantize runs, on the tiny
random Llama: every block's output error falls below round-to-nearest's, only codes move (scales and zero
points are the solver's), the export decompresses to what was simulated, and the model scores closer to
the float one than plain RTN does."""

import json

import pytest
import torch

from fp8ptq.api import QuantizeConfig

from helpers import decompression_mismatches, quantize_recording, read_tensors

pytestmark = pytest.mark.tiny
SIGNROUND = ("calibration.rounding=signround", "calibration.rounding_iters=20", "calibration.rounding_lr=0.02")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir):
    """{rtn, signround, gptq-signround} -> (export dir, manifest, recorded fakes), one quantize each."""
    base = tmp_path_factory.mktemp("signround")
    done = {}
    for name, weights, sets in (("rtn", "rtn", ()), ("signround", "rtn", SIGNROUND), ("gptq-sr", "gptq", SIGNROUND)):
        out = base / name
        cfg = dict(num_samples=8, seq_len=64, eval_samples=4, sets=sets, weights=weights)
        fakes = quantize_recording(QuantizeConfig(model=str(tiny_dir), recipe="w4a16", output=out, **cfg))
        done[name] = (out, json.loads((out / "fp8ptq_manifest.json").read_text()), fakes)
    return done


def _rounding(manifest) -> list[dict]:
    return [r for layer in manifest["layers"] for r in layer.get("rounding", [])]


def test_every_block_ends_below_the_solvers_error(runs):
    rtn = _rounding(runs["signround"][1])
    assert len(rtn) == 4  # 2 layers x (attention, MLP)
    assert all(r["rounding_loss_kept_ratio"] < 0.95 for r in rtn), rtn
    assert all(r["rounding_loss_kept_ratio"] <= 1.0 for r in _rounding(runs["gptq-sr"][1]))  # never worse
    assert _rounding(runs["rtn"][1]) == []


def test_only_codes_move_and_the_export_is_the_simulation(runs):
    (rtn_out, _, _), (sr_out, _, sr_fakes) = runs["rtn"], runs["signround"]
    a, b = read_tensors(rtn_out), read_tensors(sr_out)
    assert a.keys() == b.keys()
    params = [n for n in a if n.endswith(("weight_scale", "weight_zero_point"))]
    assert params and all(torch.equal(a[n], b[n]) for n in params)
    packed = [n for n in a if n.endswith("weight_packed")]
    assert packed and all(not torch.equal(a[n], b[n]) for n in packed)
    assert decompression_mismatches(sr_out, sr_fakes) == []


def test_the_model_scores_closer_to_float_than_rtn(runs):
    kl = {k: runs[k][1]["quality"]["kl"] for k in ("rtn", "signround")}
    assert kl["signround"] < kl["rtn"], kl


def test_signround_trains_through_static_fp8_inputs_and_an_fp8_kv_cache(tmp_path, tiny_dir):
    """fp8-kv8 + SignRound used to stop at the first backward (the FP8 rounding's in-place steps in the
    graph); the input and KV quantizers now pass the gradient straight through, and the steps find lower
    block errors than GPTQ's codes."""
    out = tmp_path / "fp8-sr"
    cfg = dict(num_samples=8, seq_len=64, eval_samples=2, sets=SIGNROUND)
    fakes = quantize_recording(QuantizeConfig(model=str(tiny_dir), recipe="fp8-kv8", output=out, **cfg))
    manifest = json.loads((out / "fp8ptq_manifest.json").read_text())
    ratios = [r["rounding_loss_kept_ratio"] for r in _rounding(manifest)]
    assert len(ratios) == 4 and all(r <= 1.0 for r in ratios) and min(ratios) < 0.99, ratios
    assert any(n.endswith("k_scale") for n in read_tensors(out))
    assert decompression_mismatches(out, fakes) == []


def test_straight_through_keeps_the_quantizers_values_and_passes_the_gradient():
    from fp8ptq.ops.fp8 import TENSOR, fake_quant_fp8
    from fp8ptq.quantization.numerics import straight_through

    scale, x = torch.tensor([0.01]), torch.randn(64, 128) * 0.3
    quant = straight_through(lambda t: fake_quant_fp8(t, scale, TENSOR))
    assert torch.equal(quant(x), fake_quant_fp8(x, scale, TENSOR))  # no gradient: the quantizer itself
    xg = x.clone().requires_grad_(True)
    y = quant(xg)
    assert torch.allclose(y.detach(), fake_quant_fp8(x, scale, TENSOR), atol=1e-6)
    (y * torch.arange(128.0)).sum().backward()
    assert torch.equal(xg.grad, torch.arange(128.0).expand(64, 128))
