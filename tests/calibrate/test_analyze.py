"""fp8ptq analyze: the outlier report on a tiny model (CLI, files) and on the real model (known outliers)."""

import json

import pytest
from typer.testing import CliRunner

from fp8ptq.cli import app

pytestmark = pytest.mark.tiny


def test_analyze_cli_writes_report(tmp_path, tiny_dir):
    out = tmp_path / "rep"
    r = CliRunner().invoke(app, ["analyze", str(tiny_dir), "-o", str(out), "--num-samples", "4", "--seq-len", "64"])
    assert r.exit_code == 0, r.output
    assert "worst Linear inputs" in r.output
    for f in (
        "report.json",
        "summary.md",
        "heatmap.png",
        "outlier_ratio.png",
        "kv_ranges.png",
        "channel_amax.safetensors",
    ):
        assert (out / f).is_file(), f
    rep = json.loads((out / "report.json").read_text())
    assert len(rep["layers"]) == 2 and set(rep["layers"][0]["inputs"]) == {"qkv_in", "o_in", "gate_up_in", "down_in"}
    # the tiny model's input_layernorm has weight 8 on channel 3 (conftest): the q/k/v input's top channel
    assert rep["layers"][0]["inputs"]["qkv_in"]["top_channels"][0]["channel"] == 3
    assert set(rep["layers"][0]["kv"]) == {"k", "v"}
    from fp8ptq.calibrate.analyze import AnalysisReport
    from fp8ptq.results import read_json

    typed = read_json(out / "report.json", AnalysisReport)  # schema keys, validated; it lists its siblings
    listed = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # the output marker aside
    assert sorted(typed.files) == listed and typed.layers == rep["layers"]
    r = CliRunner().invoke(app, ["analyze", str(tiny_dir), "-o", str(out)])
    assert r.exit_code == 2 and "already exists" in r.output


@pytest.mark.slow
def test_analyze_real_model_finds_its_outliers(tmp_path):
    from fp8ptq.api import AnalyzeConfig, analyze

    rep = analyze(AnalyzeConfig(model="smollm2-135m", output=tmp_path / "a", num_samples=4, seq_len=128))
    worst = rep.worst[0]
    # SmolLM2-135M: layer 11's down_proj input and the residual channel 507 on the first token
    # (the largest 'massive activation', Sun et al. 2024; all of them on token 0) stand out
    # (docs/analyze-smollm2-135m, 32x512 tokens)
    assert worst["input"] == "down_in" and worst["max_over_p99"] > 100
    massive = [m for l in rep.layers for m in l["massive"]]
    assert massive and all(m["position"] == 0 for m in massive)
    assert max(massive, key=lambda m: m["abs"])["channel"] == 507
