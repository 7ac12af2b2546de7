"""`transforms: [rotate]` / `quantize --rotate` in a quantize run, and `eval quality --eval-data`."""

import json

import pytest
from typer.testing import CliRunner

from fp8ptq.api import EvalConfig, QuantizeConfig, evaluate_quality, quantize
from fp8ptq.cli import app
from fp8ptq.data import builtin_texts
from fp8ptq.errors import RecipeError
from fp8ptq.models.loader import open_hf_dir

pytestmark = pytest.mark.tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    """An 'off-domain' text file: the built-in evaluation text reversed word by word (same tokenizer, other text)."""
    f = tmp_path_factory.mktemp("prose") / "prose.txt"
    f.write_text("\n\n".join(" ".join(reversed(t.split())) for t in builtin_texts("evaluation")))
    return f


def test_rotated_fp8_kv8_run(tiny_dir, tmp_path, cache, prose):
    out = tmp_path / "rot"
    m = quantize(
        QuantizeConfig(
            model=str(tiny_dir), recipe="fp8-kv8", output=out, num_samples=4, seq_len=48, eval_samples=2, rotate=True
        )
    )
    assert m.recipe["transforms"] == ["rotate"] and "- rotate" in (out / "recipe.yaml").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and open_hf_dir(out).has("lm_head.weight")
    assert len(list((cache / "rotated").iterdir())) == 1  # the rotated float model, reused by later runs
    assert 0 < m.quality.kl < 0.5
    # scored against the ORIGINAL model, in- and off-domain side by side
    r = evaluate_quality(
        EvalConfig(model=str(out), reference=str(tiny_dir), num_samples=2, seq_len=48, eval_data=str(prose))
    )
    assert r.off_domain.data == str(prose) and r.off_domain.tokens == r.tokens == 2 * 47
    assert 0 < r.kl < 0.5 and 0 < r.off_domain.kl < 0.5 and r.off_domain.kl != r.kl
    # the rotated float model alone is the original model up to its bf16 storage (the evaluator agrees)
    rotated = next((cache / "rotated").iterdir())
    same = evaluate_quality(EvalConfig(model=str(rotated), reference=str(tiny_dir), num_samples=2, seq_len=48))
    assert same.kl < 1e-6 and same.top1 > 0.97  # (near-ties of a random model's logits flip)


def test_rotated_w4a16_data_free_and_cli(tiny_dir, tmp_path, cache, prose):
    out = tmp_path / "w4"
    r = CliRunner().invoke(
        app,
        [
            "quantize",
            str(tiny_dir),
            "-r",
            "w4a16",
            "--weights",
            "rtn",
            "--rotate",
            "-o",
            str(out),
            "--eval-samples",
            "0",
            "--no-recipe-gates",  # the untied head costs size: the recipe's size gate is tuned for tied models
        ],
    )
    assert r.exit_code == 0, r.output
    assert "transforms" in r.output and "rotate" in r.output
    r = CliRunner().invoke(
        app,
        ["eval", "quality", str(out), "--reference", str(tiny_dir), "--num-samples", "2", "--seq-len", "48"]
        + ["--eval-data", str(prose)],
    )
    assert r.exit_code == 0, r.output
    assert "in-domain" in r.output and "off-domain" in r.output
    assert "Off-domain: PPL" in (out / "report.md").read_text()


def test_rotate_refused_before_any_work(tiny_model, tmp_path, cache):
    out = tmp_path / "g"
    with pytest.raises(RecipeError, match=r"rotate.*gemma3.*\(1 \+ w\)"):
        quantize(QuantizeConfig(model=str(tiny_model("gemma3_text")), recipe="fp8-dynamic", output=out, rotate=True))
    assert not out.exists() and not cache.exists()


def test_eval_data_missing_file_is_a_typed_error(tiny_dir, tmp_path):
    r = CliRunner().invoke(
        app, ["eval", "quality", str(tiny_dir), "--reference", str(tiny_dir), "--eval-data", str(tmp_path / "nope.txt")]
    )
    assert r.exit_code == 2 and "nope.txt" in r.output


def test_quantize_with_a_weighted_data_mix(tiny_dir, tmp_path, prose):
    out = tmp_path / "mix"
    r = CliRunner().invoke(
        app,
        ["quantize", str(tiny_dir), "-r", "fp8-kv8", "--weights", "rtn", "-o", str(out), "--eval-samples", "0"]
        + ["--data", "builtin:0.5", "--data", f"{prose}:0.5", "--num-samples", "4", "--seq-len", "48"]
        + ["--no-recipe-gates"],  # gates are tuned for the demo model, not a random one
    )
    assert r.exit_code == 0, r.output
    m = json.loads((out / "fp8ptq_manifest.json").read_text())
    assert m["calibration"]["source"] == f"builtin:0.5,{prose}:0.5" and m["calibration"]["samples"] == 4
