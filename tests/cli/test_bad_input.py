"""Bad input, as a new user would give it: every case ends in a one-line `error: ... (fix: ...)`,
exit 2 (before any work where the input allows), and no output directory — for quantize, eval,
convert, spec and report. Rows from issue 15 plus the cases that already worked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8ptq.cli import app
from fp8ptq.recipe import builtin_names, load_recipe

pytestmark = pytest.mark.tiny
runner = CliRunner()
QUICK = ["--num-samples", "2", "--seq-len", "32", "--eval-samples", "0", "--no-recipe-gates"]
# The tiny models are 64 wide: recipes whose 128 blocks / groups do not fit take the size a user would pass.
FITS = {"fp8-block": ["--block-size", "32"], "w4a8-fp8": ["--group-size", "32"]}


def _run(*args) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def _edit_weights(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def nan_model(tiny_dir, tmp_path_factory):
    def plant(t):
        w = t["model.layers.1.mlp.down_proj.weight"]
        w[3, 5] = float("nan")

    return _edit_weights(tiny_dir, tmp_path_factory.mktemp("bad") / "nan", plant)


@pytest.fixture(scope="module")
def inf_model(tiny_dir, tmp_path_factory):
    """Finite weights whose activations overflow fp32: a norm weight near bf16's max."""

    def plant(t):
        t["model.layers.1.post_attention_layernorm.weight"][:] = 3e38

    return _edit_weights(tiny_dir, tmp_path_factory.mktemp("bad") / "inf", plant)


def _one_line_error(rc: int, output: str, phrase: str) -> None:
    assert rc == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and phrase in errors[0], output
    assert "Traceback" not in output, output


@pytest.mark.parametrize("recipe", builtin_names())
def test_nan_weight_is_refused_naming_the_tensor(recipe, nan_model, tmp_path):
    out = tmp_path / "out"
    rc, output = _run("quantize", nan_model, "-r", recipe, "-o", out, *QUICK, *FITS.get(recipe, []))
    _one_line_error(rc, output, "model.layers.1.mlp.down_proj.weight")
    assert "non-finite" in output
    assert not out.exists() and not list(tmp_path.glob(".out*")), list(tmp_path.iterdir())


@pytest.mark.parametrize("recipe", [r for r in builtin_names() if load_recipe(r).needs_data])  # data-free: no data
def test_activations_that_overflow_are_refused(recipe, inf_model, tmp_path):
    out = tmp_path / "out"
    rc, output = _run("quantize", inf_model, "-r", recipe, "-o", out, *QUICK, *FITS.get(recipe, []))
    _one_line_error(rc, output, "not finite")
    assert "model.layers.1." in output
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize(
    "flag, value, phrase",
    [
        ("--eval-samples", "-1", "--eval-samples -1 is out of range (allowed: >= 0)"),
        ("--num-samples", "0", "--num-samples 0 is out of range (allowed: >= 1); recipe 'fp8-kv8' uses 64"),
        ("--seq-len", "-5", "--seq-len -5 is out of range (allowed: 8 to 1048576); recipe 'fp8-kv8' uses 512"),
        ("--int4-fraction", "1.5", "--int4-fraction 1.5 is out of range (allowed: 0.0 to 1.0)"),
        ("--chunk-tokens", "0", "--chunk-tokens 0 is out of range"),
        ("--tp", "0", "--tp 0 is out of range"),
        ("--weights", "round", "--weights 'round' is not one of rtn, gptq (recipe 'fp8-kv8' uses gptq)"),
        ("--smooth-alpha", "0.5", "--smooth-alpha needs a recipe with a 'smooth' section; 'fp8-kv8' has none"),
        (("-r", "w8a8-int8", "--smooth-alpha"), "1.5", "--smooth-alpha '1.5' is neither 'auto' nor a number in [0, 1]"),
        (("-r", "nvfp4", "--smooth-alpha"), "high", "(recipe 'nvfp4' uses auto)"),
        ("--set", "calibration.gptq_dampp=0.05", "unknown key 'calibration.gptq_dampp' (fix: valid keys there:"),
    ],
)
def test_options_out_of_range_before_any_work(flag, value, phrase, tiny_dir, tmp_path):
    flag = (flag,) if isinstance(flag, str) else flag
    rc, output = _run("quantize", tiny_dir, "-o", tmp_path / "out", *flag, value)
    _one_line_error(rc, output, phrase)
    assert not (tmp_path / "out").exists()


def test_output_that_cannot_be_written(tiny_dir, tmp_path):
    rc, output = _run("quantize", tiny_dir, "-o", "/proc/fp8ptq-test/out", *QUICK)
    _one_line_error(rc, output, "cannot write under '/proc/fp8ptq-test'")
    rc, output = _run("analyze", tiny_dir, "-o", "/proc/fp8ptq-test/a")
    _one_line_error(rc, output, "cannot write under")


def test_architectures_that_contradict_model_type(tiny_dir, tmp_path):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, output = _run("quantize", bad, "-o", tmp_path / "out", *QUICK)
    _one_line_error(rc, output, "architectures ['GPT2LMHeadModel'] but model_type 'llama'")
    assert '"architectures": ["LlamaForCausalLM"]' in output and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def kv8_export(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kv8") / "q"
    rc, output = _run("quantize", tiny_dir, "-o", out, *QUICK)
    assert rc == 0, output
    return out


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(type="complex"), "does not parse"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=7, type="float"), "does not parse"),
        (lambda q: q.update(quant_method="awq"), "quant_method 'awq' is not compressed-tensors"),
        (None, "quantization_config is a str"),
    ],
)
def test_eval_of_a_checkpoint_with_a_bad_quantization_config(edit, phrase, kv8_export, tiny_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(kv8_export, bad)
    cfg = json.loads((bad / "config.json").read_text())
    if edit is None:
        cfg["quantization_config"] = "fp8 please"
    else:
        edit(cfg["quantization_config"])
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, output = _run("eval", "quality", bad, "--reference", tiny_dir, "--num-samples", "1", "--seq-len", "32")
    assert rc == 2, output
    assert phrase in output and "Traceback" not in output, output
    assert not (bad / "fp8ptq_evals").exists()


def test_gguf_missing_truncated_or_not_gguf(tmp_path):
    from fp8ptq.models.gguf_files import alias_gguf

    rc, output = _run("convert", tmp_path / "nope.gguf", "-o", tmp_path / "o")
    _one_line_error(rc, output, "not found")
    (tmp_path / "x.txt").write_text("hello")
    rc, output = _run("convert", tmp_path / "x.txt", "-o", tmp_path / "o")
    _one_line_error(rc, output, "is not a .gguf file")
    real = alias_gguf("smollm2-135m")
    with open(real, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(5_000_000))
    rc, output = _run("convert", tmp_path / "cut.gguf", "-o", tmp_path / "o")
    _one_line_error(rc, output, "truncated or corrupt")
    assert not (tmp_path / "o").exists()


def test_cases_that_already_failed_well(tiny_dir, tmp_path):
    out = tmp_path / "out"
    _one_line_error(*_run("quantize", tmp_path / "missing", "-o", out), "not found")
    pickle_dir = tmp_path / "pickled"
    pickle_dir.mkdir()
    (pickle_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (pickle_dir / "pytorch_model.bin").write_bytes(b"\x80\x04")
    _one_line_error(*_run("quantize", pickle_dir, "-o", out), "never loads pickle files")
    cut = tmp_path / "cut"
    shutil.copytree(tiny_dir, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    _one_line_error(*_run("quantize", cut, "-o", out), "truncated or corrupt")
    _one_line_error(*_run("quantize", tiny_dir, "-o", out, "-r", "no-such-recipe"), "unknown recipe 'no-such-recipe'")
    (tmp_path / "empty.txt").write_text("")
    _one_line_error(*_run("quantize", tiny_dir, "-o", out, "--data", tmp_path / "empty.txt"), "is empty")
    _one_line_error(*_run("report", tmp_path), "has no fp8ptq_manifest.json")
    _one_line_error(*_run("spec", "measure", tmp_path / "nope", "ngram"), "not found")
    assert not out.exists()


def test_unreadable_weights_say_permission(tiny_dir, monkeypatch):
    import fp8ptq.models.loader as loader

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(loader, "safe_open", denied)
    with pytest.raises(loader.ModelError, match=r"cannot read .*model.safetensors' \(permission denied\)"):
        loader.open_hf_dir(tiny_dir)


def test_report_is_titled_with_the_final_name(kv8_export):
    text = (kv8_export / "report.md").read_text()
    assert ".partial" not in text and kv8_export.name in text.splitlines()[0]


@pytest.mark.parametrize(
    "command",
    [
        ["quantize"],
        ["convert"],
        ["inspect"],
        ["eval", "quality"],
        ["eval", "mmlu_pro"],
        ["verify"],
        ["analyze"],
        ["draft-train"],
        ["draft-trim"],
        ["spec", "measure"],
        ["spec", "recommend"],
        ["spec", "memory"],
        ["report"],
        ["recipes", "show"],
    ],
)
def test_help_reads_at_80_columns_with_examples(command):
    r = CliRunner().invoke(app, [*command, "--help"], terminal_width=80)
    assert r.exit_code == 0 and "Examples:" in r.output, r.output
    assert max(len(line) for line in r.output.splitlines()) <= 100, r.output  # example lines may run past 80
    assert "…" not in r.output  # no option name cut off


def test_nan_never_reaches_a_written_scale():
    from fp8ptq.models.loader import check_finite

    check_finite("ok", torch.ones(3))
    with pytest.raises(Exception, match="'w' has 1 non-finite"):
        check_finite("w", torch.tensor([1.0, float("inf")]))
