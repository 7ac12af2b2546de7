"""`fp8ptq convert` between GGUF and compressed-tensors from the command line: the summary line, and
bad input as one-line errors (exit 2) that leave no output."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp8ptq.cli import app

from helpers import write_gguf

pytestmark = pytest.mark.tiny
runner = CliRunner()


def _run(*args) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def gguf_file(tiny_dir, tmp_path_factory):
    return write_gguf(tiny_dir, tmp_path_factory.mktemp("g") / "t.gguf", {"embed": "Q8_0"}, default="Q4_0")


def test_convert_both_ways(gguf_file, tmp_path):
    rc, out = _run("convert", gguf_file, "--to", "compressed-tensors", "-o", tmp_path / "ct")
    assert rc == 0, out
    assert "tensors: 14 exact (int4 g32: 14, int8 g32: 0)" in out
    assert (tmp_path / "ct" / "conversion.json").is_file()
    rc, out = _run("convert", tmp_path / "ct", "--to", "gguf", "-o", tmp_path / "back.gguf")
    assert rc == 0, out
    assert "14 exact codes (Q4_0: 14, Q8_0: 0; worst fp16 scale rounding 0)" in out
    rc, out = _run("convert", tmp_path / "ct", "--to", "gguf", "-o", tmp_path / "back.gguf")
    assert rc == 2 and "already exists" in out
    rc, out = _run("convert", tmp_path / "ct", "--to", "gguf", "-o", tmp_path / "b2.gguf", "--json")
    report = json.loads(out)  # the typed report, whole: nothing else on stdout
    assert (report["source_format"], report["target"], report["summary"]["exact_q4_0"]) == (
        "compressed-tensors",
        "gguf",
        14,
    )
    assert len(report["tensors"]) == sum(report["summary"][k] for k in ("exact", "dequantized", "kept"))
    from fp8ptq.conversion.registry import ConversionReport
    from fp8ptq.results import from_json

    assert (report["schema"], report["schema_version"]) == ("conversion", 1)
    assert from_json(report, ConversionReport, where="stdout").output == str(tmp_path / "b2.gguf")


def test_float_to_gguf_type_from_the_command_line(tiny_dir, tmp_path):
    rc, out = _run("convert", tiny_dir, "--to", "gguf", "--gguf-type", "Q8_0", "-o", tmp_path / "t.Q8_0.gguf")
    assert rc == 0, out
    assert "15 quantized (worst weight rel err" in out and "Q8_0 15" in out  # 14 Linears + the tied embedding
    _one_line_error(
        *_run("convert", tiny_dir, "--to", "gguf", "--gguf-type", "Q2_K", "-o", tmp_path / "u.gguf"),
        "unknown --gguf-type 'Q2_K'",
    )
    _one_line_error(
        *_run("convert", tiny_dir, "--to", "gguf", "--importance", "builtin", "-o", tmp_path / "v.gguf"),
        "--importance needs --gguf-type",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.Q8_0.gguf"]


def _one_line_error(rc: int, out: str, text: str) -> None:
    assert rc == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], out


def test_bad_convert_input(gguf_file, tiny_dir, tmp_path):
    _one_line_error(*_run("convert", gguf_file, "--to", "onnx", "-o", tmp_path / "o"), "unknown --to 'onnx'")
    _one_line_error(  # the converters a gguf file has, named
        *_run("convert", gguf_file, "--to", "gguf", "-o", tmp_path / "o.gguf"),
        "writes hf, compressed-tensors from it, not gguf",
    )
    _one_line_error(*_run("convert", tiny_dir, "--to", "hf", "-o", tmp_path / "o"), "is a float checkpoint")
    _one_line_error(*_run("convert", tiny_dir, "--to", "gguf", "-o", tmp_path / "o"), "does not end in .gguf")
    _one_line_error(
        *_run("convert", gguf_file, "--to", "compressed-tensors", "--recipe", "w4a16", "-o", tmp_path / "o"),
        "needs calibration data",
    )
    assert list(tmp_path.iterdir()) == []


def test_broken_gguf_sources(tiny_dir, gguf_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:20_000])
    _one_line_error(*_run("convert", cut, "--to", "compressed-tensors", "-o", tmp_path / "o"), "truncated or corrupt")

    def nan_scale(name, blocks):
        if name == "model.layers.0.mlp.up_proj.weight":
            blocks[0, :2] = [0x00, 0x7E]  # fp16 NaN as block 0's d (little-endian)

    bad = write_gguf(tiny_dir, tmp_path / "nan.gguf", {}, default="Q4_0", edit=nan_scale)
    rc, out = _run("convert", bad, "--to", "compressed-tensors", "-o", tmp_path / "o")
    _one_line_error(rc, out, "model.layers.0.mlp.up_proj.weight (its Q4_0 block scales)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "nan.gguf"]
