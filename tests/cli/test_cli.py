"""Bad input: a one-line error naming the problem, exit != 0, and no output directory left behind."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fp8ptq.cli import app

pytestmark = pytest.mark.tiny

runner = CliRunner()


def _quantize(model, out, *extra):
    return runner.invoke(app, ["quantize", str(model), "-o", str(out), "--eval-samples", "0", *extra])


def _assert_clean_failure(result, out: Path, needle: str):
    assert result.exit_code != 0
    lines = [l for l in result.output.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert needle in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.fixture
def bad_models(tmp_path, tiny_dir):
    d = {}
    d["empty"] = tmp_path / "empty"
    d["empty"].mkdir()
    shutil.copy(tiny_dir / "config.json", d["empty"] / "config.json")
    d["pickle"] = tmp_path / "pickle"
    d["pickle"].mkdir()
    shutil.copy(tiny_dir / "config.json", d["pickle"] / "config.json")
    (d["pickle"] / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    d["corrupt"] = tmp_path / "corrupt"
    shutil.copytree(tiny_dir, d["corrupt"])
    f = d["corrupt"] / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    d["garbage"] = tmp_path / "garbage"
    shutil.copytree(tiny_dir, d["garbage"])
    (d["garbage"] / "model.safetensors").write_bytes(b"\xff" * 64)
    d["arch"] = tmp_path / "arch"
    shutil.copytree(tiny_dir, d["arch"])
    cfg = json.loads((d["arch"] / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d["arch"] / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "not found"),
        ("empty", "no *.safetensors"),
        ("pickle", "pickle"),
        ("corrupt", "truncated or corrupt"),
        ("garbage", "not a readable safetensors"),
        ("arch", "'gpt2': its decoder layers hold no nn.Linear"),  # GPT-2's Conv1D
    ],
)
def test_bad_models(case, needle, bad_models, tmp_path):
    model = bad_models.get(case, tmp_path / "does-not-exist")
    _assert_clean_failure(_quantize(model, tmp_path / "out", "--recipe", "fp8-dynamic"), tmp_path / "out", needle)


def test_unknown_recipe(tiny_dir, tmp_path):
    r = _quantize(tiny_dir, tmp_path / "out", "--recipe", "fp9")
    _assert_clean_failure(r, tmp_path / "out", "unknown recipe 'fp9'")


def test_recipe_with_unknown_key(tiny_dir, tmp_path):
    from fp8ptq.recipe import load_recipe
    from fp8ptq.recipe_files import recipe_yaml

    data = yaml.safe_load(recipe_yaml(load_recipe("fp8-kv8")))
    data["scheme"]["wieghts"] = data["scheme"].pop("weights")
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(data))
    _assert_clean_failure(
        _quantize(tiny_dir, tmp_path / "out", "--recipe", str(f)), tmp_path / "out", "unknown key 'scheme.wieghts'"
    )


def test_empty_calibration_file(tiny_dir, tmp_path):
    (tmp_path / "cal.txt").write_text("")
    r = _quantize(
        tiny_dir, tmp_path / "out", "--data", str(tmp_path / "cal.txt"), "--num-samples", "2", "--seq-len", "32"
    )
    _assert_clean_failure(r, tmp_path / "out", "is empty")


def test_output_exists(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = _quantize(tiny_dir, out, "--recipe", "fp8-dynamic")
    assert r.exit_code != 0 and "already exists" in r.output and "--overwrite" in r.output
    assert list(out.iterdir()) == []


def test_quantize_json_and_recipes_commands(tiny_dir, tmp_path):
    r = _quantize(tiny_dir, tmp_path / "out", "--recipe", "fp8-dynamic", "--json", "--no-recipe-gates")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["summary"]["linears_quantized"] == 14
    r = runner.invoke(app, ["recipes", "list"])
    assert r.exit_code == 0 and "fp8-kv8" in r.output and "fp8-dynamic" in r.output
    r = runner.invoke(app, ["recipes", "show", "fp8-kv8"])
    assert r.exit_code == 0 and yaml.safe_load(r.output)["name"] == "fp8-kv8"


def test_console_script_exit_code(tmp_path):
    exe = Path(sys.executable).parent / "fp8ptq"
    r = subprocess.run(
        [str(exe), "quantize", str(tmp_path / "nope"), "-o", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "not found" in r.stderr


HELP_IMPORTS = (
    "import sys\n"
    "from typer.testing import CliRunner\n"
    "from fp8ptq.cli import app\n"
    "from fp8ptq.api import EvalConfig, QuantizeConfig\n"
    "for cmd in ([], ['quantize'], ['eval', 'quality'], ['convert'], ['verify']):\n"
    "    r = CliRunner().invoke(app, [*cmd, '--help'])\n"
    "    assert r.exit_code == 0, r.output\n"
    "heavy = sorted(m for m in ('torch', 'transformers', 'compressed_tensors') if m in sys.modules)\n"
    "print(','.join(heavy) or 'none')\n"
)


def test_help_and_api_import_no_torch():
    """`fp8ptq --help` and `import fp8ptq.api` stay fast (issue 19: under 1 s / 3 s): torch,
    transformers and compressed-tensors are imported by the commands and entry points that use them."""
    r = subprocess.run([sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "none", r.stdout


def test_progress_in_a_log_is_plain_lines(capsys, monkeypatch):
    """Not a terminal (a log file, CI): one line per stage when it ends and every 30 s, no live bar."""
    import fp8ptq.cli.common as common

    clock = iter([0.0, 1.0, 40.0, 41.0, 42.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    with common.progress_bar(True) as update:
        update("generate", 1, 4)  # 1 s: quiet
        update("generate", 2, 4)  # 40 s: a line
        update("generate", 3, 4)  # 41 s: quiet
        update("generate", 4, 4)  # ends: a line
    lines = capsys.readouterr().err.splitlines()  # progress goes to stderr, like every message
    assert lines == ["generate: 2/4 (40 s)", "generate: 4/4 (42 s)"], lines


def test_device_auto_is_the_default_and_says_what_it_picked(tiny_dir, tmp_path):
    import torch

    r = _quantize(tiny_dir, tmp_path / "out", "--recipe", "fp8-dynamic", "--no-recipe-gates")
    assert r.exit_code == 0, r.output
    row = next(x for x in r.output.splitlines() if " device " in x)  # the summary table's row
    if torch.cuda.is_available():
        assert "cuda (" in row and "(--device auto)" in row, row
    else:  # this suite's machines: the CPU, and the row says why
        assert "cpu, no CUDA device (--device auto)" in row, row
    m = json.loads((tmp_path / "out" / "fp8ptq_manifest.json").read_text())
    assert m["run"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_compute_dtype_tf32_on_a_cpu_is_refused_before_any_work(tiny_dir, tmp_path):
    r = _quantize(tiny_dir, tmp_path / "out", "--recipe", "fp8-kv8", "--device", "cpu", "--compute-dtype", "tf32")
    _assert_clean_failure(r, tmp_path / "out", "--compute-dtype tf32 on --device cpu")
