"""Hostile or careless input (issue 32): a checkpoint is a closed folder that never runs code, and no
command deletes what fp8ptq did not write. Each case is refused with one `error:` line and exit 2, and
the inputs (and strangers' folders) are left exactly as they were."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8ptq.cli import app
from fp8ptq.errors import OutputError
from fp8ptq.io import OUTPUT_MARKER, atomic_output_dir

from helpers import QUICK, assert_one_line_error, run_cli

pytestmark = pytest.mark.tiny
runner = CliRunner()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _sharded_with_outside_shard(tiny_dir: Path, root: Path) -> tuple[Path, Path]:
    """A model whose index sends one tensor to ../victim/secret.safetensors (a file outside the folder)."""
    model, victim = root / "model", root / "victim"
    shutil.copytree(tiny_dir, model)
    victim.mkdir()
    t = load_file(str(model / "model.safetensors"))
    name = "model.norm.weight"
    save_file({name: torch.full_like(t[name], 7.0)}, str(victim / "secret.safetensors"), metadata={"format": "pt"})
    rest = {k: v for k, v in t.items() if k != name}
    (model / "model.safetensors").unlink()
    save_file(rest, str(model / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00001.safetensors" for k in rest} | {name: "../victim/secret.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model, victim


def test_index_naming_a_file_outside_the_model_is_refused(tiny_dir, tmp_path):
    model, _ = _sharded_with_outside_shard(tiny_dir, tmp_path)
    for cmd in (["quantize", model, "-o", tmp_path / "out", *QUICK], ["analyze", model, "-o", tmp_path / "a"]):
        rc, output = run_cli(*cmd)
        assert_one_line_error(rc, output, "'../victim/secret.safetensors', which lies outside the model folder")
    assert not (tmp_path / "out").exists() and not (tmp_path / "a").exists()


def test_shard_symlinked_outside_the_model_is_refused(tiny_dir, tmp_path):
    model, victim = _sharded_with_outside_shard(tiny_dir, tmp_path)
    (model / "model.safetensors.index.json").unlink()
    (model / "extra.safetensors").symlink_to(victim / "secret.safetensors")
    rc, output = run_cli("quantize", model, "-o", tmp_path / "out", *QUICK)
    assert_one_line_error(rc, output, "'extra.safetensors', which lies outside the model folder")


def test_index_placing_a_tensor_in_a_shard_that_lacks_it(tiny_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    names = list(load_file(str(model / "model.safetensors")))
    weight_map = {k: "model.safetensors" for k in names} | {"model.layers.0.mlp.up_proj.weight": "other.safetensors"}
    save_file({"x": torch.zeros(1)}, str(model / "other.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    rc, output = run_cli("quantize", model, "-o", tmp_path / "out", *QUICK)
    assert_one_line_error(rc, output, "places tensor 'model.layers.0.mlp.up_proj.weight' in 'other.safetensors'")


def test_tokenizer_remote_code_never_runs(tiny_dir, tmp_path):
    """A tokenizer_config.json whose auto_map names a .py in the folder: transformers would ask to run it
    (and run it on 'y'); fp8ptq passes trust_remote_code=False, so the standard class loads, no prompt."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    pwned = tmp_path / "PWNED"
    (model / "evil.py").write_text(
        f"open({str(pwned)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    r = runner.invoke(app, ["quantize", str(model), "-o", str(tmp_path / "out"), *QUICK], input="y\n")
    assert r.exit_code == 0, r.output
    assert not pwned.exists() and "custom code" not in r.output


@pytest.fixture
def workspace(tiny_dir, tmp_path) -> Path:
    """A user's folder: two models and a notes file."""
    ws = tmp_path / "ws"
    shutil.copytree(tiny_dir, ws / "model-a")
    shutil.copytree(tiny_dir, ws / "model-b")
    (ws / "notes.txt").write_text("my notes")
    return ws


@pytest.mark.parametrize(
    "out, phrase",
    [
        ("model-a", "is the input"),
        (".", "holds the input"),
        ("model-a/quantized", "lies inside the input"),
    ],
)
def test_output_that_is_holds_or_sits_in_the_input_is_refused(workspace, out, phrase):
    before = _snapshot(workspace)
    rc, output = run_cli("quantize", workspace / "model-a", "-o", workspace / out, "--overwrite", *QUICK)
    assert_one_line_error(rc, output, phrase)
    assert _snapshot(workspace) == before


def test_overwrite_replaces_only_what_fp8ptq_wrote(workspace, tmp_path):
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "thesis.tex").write_text("years of work")
    rc, output = run_cli("quantize", workspace / "model-a", "-o", stranger, "--overwrite", *QUICK)
    assert_one_line_error(rc, output, "was not written by fp8ptq")
    assert (stranger / "thesis.tex").read_text() == "years of work"
    # fp8ptq's own outputs are replaced: a quantized checkpoint (its manifest) and an analysis (the marker)
    out = tmp_path / "q"
    for _ in range(2):
        rc, output = run_cli("quantize", workspace / "model-a", "-o", out, "--overwrite", *QUICK)
        assert rc == 0, output
    rc, output = run_cli(
        "analyze", workspace / "model-a", "-o", tmp_path / "a", "--num-samples", "2", "--seq-len", "32"
    )
    assert rc == 0 and (tmp_path / "a" / OUTPUT_MARKER).is_file(), output
    rc, output = run_cli("quantize", workspace / "model-a", "-o", tmp_path / "a", *QUICK)
    assert_one_line_error(rc, output, "already exists")  # no --overwrite: analyze's report stays
    assert (tmp_path / "a" / OUTPUT_MARKER).is_file()


def test_draft_trim_onto_its_own_draft_is_refused(workspace):
    draft = workspace / "model-b"
    before = _snapshot(workspace)
    rc, output = run_cli(
        "draft-trim", draft, "--target", workspace / "model-a", "--keep", "100", "-o", draft, "--overwrite"
    )
    assert_one_line_error(rc, output, "is the input")
    assert _snapshot(workspace) == before


def test_a_folder_that_appears_during_the_run_is_never_deleted(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="appeared or changed while this run was writing it") as err:
        with atomic_output_dir(out) as tmp:
            (tmp / "result.txt").write_text("finished")
            out.mkdir()  # somebody else's folder, made while the run was going
            (out / "theirs.txt").write_text("keep me")
    assert (out / "theirs.txt").read_text() == "keep me" and not (out / OUTPUT_MARKER).exists()
    kept = Path(str(err.value).split("the finished result is in '")[1].split("'")[0])
    assert (kept / "result.txt").read_text() == "finished"


def test_a_quoted_home_in_the_output_means_the_home_folder(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    rc, output = run_cli("model-free", workspace / "model-a", "-o", "~/out", "-r", "fp8-dynamic")
    assert rc == 0, output
    assert (tmp_path / "home" / "out" / OUTPUT_MARKER).is_file() and not Path("~").exists()


def test_a_resumable_run_refused_at_the_final_rename_keeps_its_result(tmp_path):
    """The refusal sends the user to the partial folder: the run must not delete it afterwards."""
    from fp8ptq.export.rundir import RunDir

    out = tmp_path / "out"
    with pytest.raises(OutputError, match="appeared or changed") as err:
        with RunDir(out) as run:
            (run.path / "result.txt").write_text("finished")
            out.mkdir()
            run.commit()
    kept = Path(str(err.value).split("the finished result is in '")[1].split("'")[0])
    assert (kept / "result.txt").read_text() == "finished" and not (tmp_path / ".out.lock").exists()


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (lambda r: r["calibration"].update(gptq_damp=float("nan")), "gptq_damp"),
        (lambda r: r["calibration"].update(gptq_damp=-0.1), "calibration.gptq_damp"),
        (lambda r: r.update(smooth={"alpha": float("nan")}), "smooth"),
        (lambda r: r.update(smooth={"alpha": 1.5}), "smooth.alpha"),
        (lambda r: r.update(flatten={"extra_channels": 1_000_000_000}), "flatten.extra_channels"),
        (lambda r: r["scheme"]["ignore"].append("re:model.layers.(["), "not a valid regular expression"),
    ],
)
def test_recipe_numbers_out_of_range_are_refused_before_any_work(edit, phrase, tiny_dir, tmp_path):
    import yaml

    from fp8ptq.recipe import load_recipe

    r = load_recipe("w8a8-int8").model_dump(mode="json")
    edit(r)
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(r))
    rc, output = run_cli("quantize", tiny_dir, "-r", f, "-o", tmp_path / "out", *QUICK)
    assert_one_line_error(rc, output, phrase)
    assert not (tmp_path / "out").exists()


def test_resume_refuses_changed_weights_and_a_corrupt_state(tiny_dir, tmp_path, monkeypatch):
    import fp8ptq.runs.finish as jobs

    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny_dir, model)

    def boom(*a, **k):
        raise RuntimeError("simulated crash after the last layer")

    real = jobs.write_metadata
    monkeypatch.setattr(jobs, "write_metadata", boom)
    r = runner.invoke(app, ["quantize", str(model), "-o", str(out), *QUICK])
    assert r.exit_code != 0 and (tmp_path / ".out.partial" / "state.json").is_file()
    monkeypatch.setattr(jobs, "write_metadata", real)
    # the same sizes, another content: --resume would mix old and new layers
    t = load_file(str(model / "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"] * 2
    save_file(t, str(model / "model.safetensors"), metadata={"format": "pt"})
    rc, output = run_cli("quantize", model, "-o", out, *QUICK, "--resume")
    assert_one_line_error(rc, output, "model weights (same sizes, files rewritten)")
    (tmp_path / ".out.partial" / "state.json").write_text("{not json")
    rc, output = run_cli("quantize", model, "-o", out, *QUICK, "--resume")
    assert_one_line_error(rc, output, "is unreadable")
    rc, output = run_cli("quantize", model, "-o", out, *QUICK, "--overwrite")  # starting over still works
    assert rc == 0 and (out / "fp8ptq_manifest.json").is_file(), output


def test_unbounded_or_nan_options_are_refused_before_any_work(tiny_dir, tmp_path):
    rc, output = run_cli("spec", "measure", tiny_dir, tiny_dir, "--gammas", "1-1000000000")
    assert_one_line_error(rc, output, "spans 1000000000 values")
    rc, output = run_cli("spec", "measure", tiny_dir, tiny_dir, "--temperatures", "nan")
    assert_one_line_error(rc, output, "holds nan")
    for flag in ("--lr", "--time-budget"):
        rc, output = run_cli("draft-train", tiny_dir, "-o", tmp_path / "d", flag, "nan")
        assert_one_line_error(rc, output, f"{flag} nan is out of range")
    assert not (tmp_path / "d").exists()


def _edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(model: Path, edit) -> None:
    t = load_file(str(model / "model.safetensors"))
    edit(t)
    save_file(t, str(model / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "case, phrase",
    [
        ("no layers", "num_hidden_layers is -1"),
        ("more layers than weights", "says num_hidden_layers 5 but the weights hold 2"),
        ("a billion layers", "says num_hidden_layers 1000000000"),  # refused before a skeleton fills memory
        ("negative vocabulary", "vocab_size is -1, not a positive integer"),
        ("a size that is text", "num_attention_heads"),
        ("corrupt tokenizer", "cannot load the tokenizer"),
        ("untied, no lm_head", "lacks tensor 'lm_head.weight'"),
        ("norm of the wrong shape", "tensor 'model.norm.weight' is [32] but its config builds [64]"),
        ("embedding smaller than the tokenizer", "rows"),
    ],
)
def test_a_model_that_disagrees_with_its_config_is_refused(case, phrase, tiny_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    tied = json.loads((model / "config.json").read_text()).get("tie_word_embeddings", False)
    if case == "no layers":
        _edit_config(model, num_hidden_layers=-1)
    elif case == "more layers than weights":
        _edit_config(model, num_hidden_layers=5)
    elif case == "a billion layers":
        _edit_config(model, num_hidden_layers=10**9)
    elif case == "negative vocabulary":
        _edit_config(model, vocab_size=-1)
    elif case == "a size that is text":
        _edit_config(model, num_attention_heads="four")
    elif case == "corrupt tokenizer":
        (model / "tokenizer.json").write_text('{"version": ')
    elif case == "untied, no lm_head":
        _edit_config(model, tie_word_embeddings=False)
        _edit_tensors(model, lambda t: t.pop("lm_head.weight", None))
    elif case == "norm of the wrong shape":
        _edit_tensors(model, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.bfloat16)}))
    else:
        _edit_config(model, vocab_size=100)

        def shrink(t):
            t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:100].clone()
            if not tied and "lm_head.weight" in t:
                t["lm_head.weight"] = t["lm_head.weight"][:100].clone()

        _edit_tensors(model, shrink)
    rc, output = run_cli("quantize", model, "-o", tmp_path / "out", *QUICK)
    assert_one_line_error(rc, output, phrase)
    assert not (tmp_path / "out").exists()


def test_quality_against_a_reference_of_another_vocabulary_is_refused(tiny_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    _edit_config(other, vocab_size=100)
    _edit_tensors(other, lambda t: t.update({k: v[:100].clone() for k, v in t.items() if v.shape[0] == 1024}))
    rc, output = run_cli("eval", "quality", tiny_dir, "--reference", other, "--num-samples", "1", "--seq-len", "16")
    assert_one_line_error(rc, output, "vocabulary of 1024 tokens")


@pytest.mark.parametrize("flag", ["--num-prompts", "--max-tokens"])
def test_spec_measure_counts_below_one_are_refused(flag, tiny_dir):
    rc, output = run_cli("spec", "measure", tiny_dir, "ngram:2-3", "--gammas", "1", flag, "0")
    assert_one_line_error(rc, output, f"{flag} 0 is out of range")


@pytest.mark.parametrize(
    "suffix, phrase", [(".txt", "not UTF-8 text"), (".jsonl", "not UTF-8 JSON"), (".parquet", "parquet")]
)
def test_binary_data_files_are_refused(suffix, phrase, tiny_dir, tmp_path):
    data = tmp_path / f"data{suffix}"
    data.write_bytes(bytes(range(256)) * 20)
    rc, output = run_cli("quantize", tiny_dir, "-o", tmp_path / "out", *QUICK, "--data", data)
    assert_one_line_error(rc, output, phrase)
