"""Untrusted sizes are bounded and user errors are one line: recipes (duplicate keys, nesting, seeds,
pathological regular expressions, infinite gates), data sources (FIFOs, devices, sizes), images (pixels
before decoding), chat templates (the author's code, bounded in time and size), hub ids."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from helpers import QUICK, assert_one_line_error, run_cli

pytestmark = pytest.mark.tiny


def _recipe(tmp_path, text: str):
    f = tmp_path / "r.yaml"
    f.write_text(text)
    return f


BASE = "name: r\nscheme:\n  weights: {num_bits: 8, type: float, strategy: channel}\n"


@pytest.mark.parametrize(
    "text, phrase",
    [
        (BASE + "scheme: {}\n", "given twice"),
        ("name: r\nx: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
        (BASE + "calibration: {seed: 1.0e+38}\n", "calibration.seed"),
        (BASE.replace("strategy: channel}", "strategy: channel}\n  targets: ['re:(a+)+$']"), "backtracks"),
        (BASE + 'gates: ["kl<=1e999"]\n', "not a finite number"),
    ],
    ids=["duplicate-key", "nested", "huge-seed", "backtracking-regex", "infinite-gate"],
)
def test_hostile_recipes_are_one_line_errors(text, phrase, tiny_dir, tmp_path):
    t = time.perf_counter()
    rc, output = run_cli("quantize", tiny_dir, "-r", _recipe(tmp_path, text), "-o", tmp_path / "o", *QUICK)
    assert_one_line_error(rc, output, phrase)
    assert time.perf_counter() - t < 30 and not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]  # no .lock / .partial left


def test_data_sources_must_be_bounded_regular_files(tiny_dir, tmp_path, monkeypatch):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    for source, phrase in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file")):
        rc, output = run_cli("quantize", tiny_dir, "-r", "fp8-kv8", "--data", source, "-o", tmp_path / "o", *QUICK)
        assert_one_line_error(rc, output, phrase)
    big = tmp_path / "big.txt"
    big.write_text("word " * 1000)
    monkeypatch.setenv("FP8PTQ_MAX_DATA_BYTES", "100")
    rc, output = run_cli("quantize", tiny_dir, "-r", "fp8-kv8", "--data", big, "-o", tmp_path / "o", *QUICK)
    assert_one_line_error(rc, output, "5,000 bytes", "FP8PTQ_MAX_DATA_BYTES")


def test_an_image_is_bounded_in_pixels_before_it_is_decoded(tmp_path):
    from PIL import Image

    from fp8ptq.calibrate.images import _read_image
    from fp8ptq.errors import DataError

    bomb = tmp_path / "bomb.png"
    Image.new("1", (12000, 12000)).save(bomb)  # 144 megapixels in a few KB
    assert bomb.stat().st_size < 100_000
    with pytest.raises(DataError, match="12000 x 12000 pixels"):
        _read_image(bomb, "row 1")
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path / "a\x00b.png"):
        with pytest.raises(DataError, match="not a regular file"):
            _read_image(path, "row 1")


@pytest.mark.parametrize(
    "template, phrase",
    [("{{ 'A' * 5000000000 }}", "repeated 5,000,000,000 times"), ("{{ raise_exception('nope') }}", "nope")],
    ids=["size-bomb", "raise-exception"],
)
def test_a_hostile_chat_template_is_one_line_error(template, phrase, tiny_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    t = time.perf_counter()
    rc, output = run_cli("quantize", model, "-r", "fp8-kv8", "--chat-template", "-o", tmp_path / "o", *QUICK)
    assert_one_line_error(rc, output, "chat template", phrase)
    assert time.perf_counter() - t < 60


def test_an_invalid_hub_id_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, output = run_cli("quantize", "org/name..x", "-r", "fp8-dynamic", "-o", tmp_path / "o")
    assert_one_line_error(rc, output, "not a valid hub id")


def test_targets_that_match_nothing_are_refused(tiny_dir, tmp_path):
    text = BASE.replace("strategy: channel}", "strategy: channel}\n  targets: ['re:.*no_such_proj']")
    rc, output = run_cli("quantize", tiny_dir, "-r", _recipe(tmp_path, text), "-o", tmp_path / "o", *QUICK)
    assert_one_line_error(rc, output, "match no Linear")
