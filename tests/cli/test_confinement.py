"""Nothing from outside a model folder reaches an export, and nothing is written through a folder a
symlink points elsewhere: side files are confined like shards (models/folder.side_files), outputs'
subfolders are their own (io.own_subdir)."""

from __future__ import annotations

import os
import shutil

import pytest

from helpers import QUICK, assert_one_line_error, run_cli

pytestmark = pytest.mark.tiny
CANARY = "CANARY-8f3b1c-must-never-be-exported"


@pytest.fixture
def planted(tiny_dir, tmp_path):
    """A copy of the tiny model whose chat template is a symlink to a secret file outside its folder."""
    model, secret = tmp_path / "model", tmp_path / "secret.txt"
    shutil.copytree(tiny_dir, model)
    secret.write_text(CANARY)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    (model / "chat_template.jinja").symlink_to(secret)
    return model


@pytest.mark.parametrize("command", ["quantize", "model-free"])
def test_a_side_file_linked_outside_the_folder_is_refused(command, planted, tmp_path):
    out = tmp_path / "out"
    args = [command, planted, "-r", "fp8-dynamic", "-o", out] + (QUICK if command == "quantize" else [])
    rc, output = run_cli(*args)
    assert_one_line_error(rc, output, "chat_template.jinja", "outside the model folder")
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name not in ("model", "secret.txt")]
    assert not leftovers, leftovers
    assert CANARY not in output


def test_a_fifo_or_an_oversized_side_file_is_refused(tiny_dir, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").unlink(missing_ok=True)
    os.mkfifo(model / "generation_config.json")  # an open() of it would block for ever
    rc, output = run_cli("quantize", model, "-r", "fp8-dynamic", "-o", tmp_path / "o", *QUICK)
    assert_one_line_error(rc, output, "generation_config.json", "not a regular file")
    (model / "generation_config.json").unlink()
    import fp8ptq.models.folder as folder

    monkeypatch.setattr(folder, "SIDE_FILE_BYTES", 100)  # the first side file in name order is larger
    rc, output = run_cli("quantize", model, "-r", "fp8-dynamic", "-o", tmp_path / "o", *QUICK)
    assert_one_line_error(rc, output, "chat_template.jinja", "limit 100")
    assert not (tmp_path / "o").exists()


def test_report_and_evaluations_never_write_through_a_symlinked_subfolder(tiny_dir, tmp_path):
    out, victim = tmp_path / "q", tmp_path / "victim"
    rc, output = run_cli("quantize", tiny_dir, "-r", "fp8-dynamic", "-o", out, *QUICK[:4], "--no-recipe-gates")
    assert rc == 0, output
    victim.mkdir()
    (victim / "keep.txt").write_text("untouched")
    for sub in ("report_files", "fp8ptq_evals"):
        shutil.rmtree(out / sub, ignore_errors=True)
        (out / sub).symlink_to(victim, target_is_directory=True)
    rc, output = run_cli("report", out)
    assert rc == 0, output
    rc, output = run_cli("eval", "quality", out, "--reference", tiny_dir, "--num-samples", "1", "--seq-len", "16")
    assert rc == 0, output
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]  # nothing written into the other folder
    for sub in ("report_files", "fp8ptq_evals"):
        assert (out / sub).is_dir() and not (out / sub).is_symlink()
    assert any((out / "fp8ptq_evals").glob("*.json")) and any((out / "report_files").glob("*.png"))
