"""Every quantize run writes report.md + a self-contained report.html; gates exit 3 and say which failed.
The HTML is checked the way a person sees it: rendered by headless Chromium."""

import html
import json
import re

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from fp8ptq.cli import app
from fp8ptq.cli.common import GATE_FAILED_EXIT

from chromium import dump_dom, screenshot

pytestmark = pytest.mark.tiny

runner = CliRunner()
ARGS = ["--num-samples", "4", "--seq-len", "64", "--eval-samples", "2", "--no-recipe-gates"]


@pytest.fixture(scope="module")
def tiny_q(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("report") / "tiny-kv8"
    r = runner.invoke(
        app, ["quantize", str(tiny_dir), "-o", str(out), *ARGS, "--gate", "kl<=1000", "--gate", "size_ratio<=1"]
    )
    assert r.exit_code == 0, r.output
    return out, json.loads((out / "fp8ptq_manifest.json").read_text())


def test_report_files_say_what_was_done(tiny_q):
    out, m = tiny_q
    md = (out / "report.md").read_text()
    assert (out / "report_files" / "input_amax.png").stat().st_size > 1000
    assert (out / "report_files" / "linear_error.png").stat().st_size > 1000
    assert "recipe **fp8-kv8**" in md
    assert f"{m['quality']['kl']:.5f}" in md
    assert f"vllm serve {out} --kv-cache-dtype fp8" in md
    assert "--kv-cache-dtype fp8_e4m3" in md  # SGLang
    assert "| `kl<=1000` |" in md and "| pass |" in md
    assert "![input_amax](report_files/input_amax.png)" in md
    page = (out / "report.html").read_text()
    assert "report_files/" not in page and page.count("data:image/png;base64,") == 2  # self-contained


def test_html_renders_in_chromium(tiny_q, tmp_path):
    out, m = tiny_q
    dom = dump_dom(out / "report.html")
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    assert re.search(r'id="kl">\s*' + re.escape(f"{m['quality']['kl']:.4f}"), dom)
    assert re.search(r'id="gates-verdict">\s*all passed', dom)
    assert f"vllm serve {out} --kv-cache-dtype fp8" in text
    png = screenshot(out / "report.html", tmp_path / "shot.png")
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert img.shape[1] == 1100
    # The plots were decoded and drawn: a text-only page is grey; the heatmap/line plots are saturated colour.
    saturation = img.max(axis=2) - img.min(axis=2)
    assert (saturation > 80).mean() > 0.01, (saturation > 80).mean()


def test_failed_gate_exits_3_and_names_it(tiny_dir, tmp_path):
    out = tmp_path / "q"
    r = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), *ARGS, "--gate", "kl<=0", "--gate", "top1>=0"])
    assert r.exit_code == GATE_FAILED_EXIT, r.output
    assert re.search(r"kl<=0: FAILED, kl = [0-9.e-]+ \(margin -", r.output), r.output
    assert "top1>=0: passed" in r.output and "1 of 2 quality gates failed" in r.output
    m = json.loads((out / "fp8ptq_manifest.json").read_text())  # the checkpoint is complete; only the gate failed
    assert [g["passed"] for g in m["gates"]] == [False, True]
    assert "FAIL" in (out / "report.md").read_text()


def test_gate_errors_before_work(tiny_dir, tmp_path):
    out = tmp_path / "q"
    r = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--eval-samples", "0", "--gate", "kl<=0.1"])
    assert r.exit_code == 2 and "needs the quality check" in r.output and not out.exists()
    r = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--gate", "mmlu_pro>=3"])
    assert r.exit_code == 2 and "quantize has no metric 'mmlu_pro'" in r.output and not out.exists()
    r = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--gate", "kl=<3"])
    assert r.exit_code == 2 and "METRIC OP NUMBER" in r.output and not out.exists()


def test_recipe_gates_skipped_without_quality_check(tiny_dir, tmp_path):
    out = tmp_path / "q"
    r = runner.invoke(
        app, ["quantize", str(tiny_dir), "-o", str(out), "--recipe", "fp8-dynamic", "--eval-samples", "0"]
    )
    # The recipe's size gate holds for real widths; on this 64-wide tiny model per-channel fp32 scales cost
    # nearly half a bit per weight, and the gate says so.
    assert r.exit_code == GATE_FAILED_EXIT and "weight_bits<=8.1: FAILED" in r.output, r.output
    m = json.loads((out / "fp8ptq_manifest.json").read_text())
    assert m["gates_skipped"] == ["kl<=0.05", "top1>=0.88"] and [g["gate"] for g in m["gates"]] == ["weight_bits<=8.1"]
    assert 8.3 < m["size_bytes"]["weight_bits"] < 8.5
    assert "recipe gates not checked" in r.output


def test_report_command(tiny_q, tmp_path):
    out, _ = tiny_q
    (out / "report.md").unlink()
    r = runner.invoke(app, ["report", str(out)])
    assert r.exit_code == 0 and (out / "report.md").is_file()
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "fp8ptq_manifest.json" in r.output


def test_eval_quality_is_recorded_in_the_report(tiny_q, tiny_dir):
    out, _ = tiny_q
    r = runner.invoke(
        app,
        ["eval", "quality", str(out), "--reference", str(tiny_dir), "--num-samples", "1", "--seq-len", "64", "--json"],
    )
    assert r.exit_code == 0, r.output
    kl = json.loads(r.stdout)["kl"]
    from fp8ptq.eval.quality import QualityReport
    from fp8ptq.results import read_json

    recorded = read_json(out / "fp8ptq_evals" / "quality.json", QualityReport)  # typed, versioned, validated
    assert recorded.kl == kl and recorded.off_domain is None and recorded.model == str(out)
    text = (out / "report.md").read_text()
    assert f"KL {kl:.5f} per token" in text and "Off-domain" not in text
    assert "Evaluation: quality" in dump_dom(out / "report.html")


def test_engine_check_records_render_beside_quality_ones(tiny_q, tmp_path):
    """`fp8ptq verify` records its typed result in fp8ptq_evals/engine.json; the report renders it (it used
    to fail: the template read every non-lm-eval record as a quality one, 'dict object' has no attribute
    'reference', and every later render of that checkpoint failed with it)."""
    import shutil

    from fp8ptq.eval.engine_check import EngineCheckResult
    from fp8ptq.report import save_eval
    from fp8ptq.results import read_json, to_json

    out = tmp_path / "q"
    shutil.copytree(tiny_q[0], out)
    ok = EngineCheckResult(
        model=str(out),
        engine="vllm",
        ok=True,
        vllm={"platform": "cpu"},
        dtype="bfloat16",
        agreement={"prefix_match_mean": 5.5, "tokens_per_prompt": 8, "teacher_forced_agreement": 0.875},
        logprob_delta={"simulated": 0.0123, "reference": 0.0456},
    )
    assert save_eval(out, "engine", to_json(ok)) == out / "report.html"
    assert read_json(out / "fp8ptq_evals" / "engine.json", EngineCheckResult) == ok
    text = (out / "report.md").read_text()
    assert "## Evaluation: engine (vllm vs fp8ptq's simulation, bfloat16)" in text
    assert "identical prefix 5.5 of 8 tokens, teacher-forced top-1 agreement 87.5%" in text
    assert "simulated 0.0123, reference 0.0456" in text
    failed = EngineCheckResult(model=str(out), engine="vllm", ok=False, vllm={"stage": "load", "error": "no kernel"})
    save_eval(out, "engine", to_json(failed))
    assert "vllm could not run it (load): no kernel" in (out / "report.md").read_text()
    assert "Evaluation: engine" in dump_dom(out / "report.html")
    # a quality record from before the schema keys (no off_domain key) still renders
    old = {"model": "m", "reference": "r", "tokens": 10, "ppl_reference": 10.0, "ppl": 11.0, "kl": 0.01, "top1": 0.9}
    save_eval(out, "quality", {**old, "numerics": {}, "data": "d", "config": {}})
    assert "PPL 10.000 → 11.000, KL 0.01000 per token" in (out / "report.md").read_text()


def test_lm_eval_records_render_typed_and_old(tiny_q, tmp_path):
    """An lm-eval record (HarnessResult: rows without a baseline carry nulls) and one from before the schema
    keys (rows without the keys) both render: '–' where there is no baseline, the delta and its CI where
    there is."""
    import shutil

    from fp8ptq.eval.harness import BaselineRun, HarnessResult, TaskScore
    from fp8ptq.report import save_eval
    from fp8ptq.results import to_json

    out = tmp_path / "q"
    shutil.copytree(tiny_q[0], out)
    config = {"data": None, "num_fewshot": None, "limit": 4, "max_gen_toks": None}
    alone = HarnessResult(
        model=str(out),
        tasks={"arc": TaskScore(metric="acc", n=4, score=50.0, stderr=None)},
        numerics={"backend": "hf (fp32)"},
        group=None,
        config=config,
    )
    save_eval(out, "tasks", to_json(alone))
    text = (out / "report.md").read_text()
    assert "| arc | 4 | 50.0 ± n/a | – | – |" in text, text
    paired = alone.model_copy(
        update={
            "tasks": {"arc": TaskScore(metric="acc", n=4, score=50.0, stderr=25.0, baseline=75.0, delta=-25.0,
                                       delta_ci95=(-70.0, 20.0))},
            "baseline": BaselineRun(model="base", numerics={"backend": "hf (fp32)"}),
        }
    )  # fmt: skip
    save_eval(out, "tasks", to_json(paired))
    text = (out / "report.md").read_text()
    assert "| arc | 4 | 50.0 ± 25.0 | 75.0 | -25.0 [-70.0, +20.0] |" in text and "; baseline base;" in text, text
    old = {"model": "m", "tasks": {"arc": {"metric": "acc", "n": 4, "score": 50.0, "stderr": 1.0}}, "group": None}
    save_eval(out, "tasks", {**old, "numerics": {"backend": "hf (fp32)"}, "config": config})
    assert "| arc | 4 | 50.0 ± 1.0 | – | – |" in (out / "report.md").read_text()
    assert "Evaluation: tasks" in dump_dom(out / "report.html")


def test_the_export_is_a_model_card_the_hub_parses(tiny_q):
    from huggingface_hub import ModelCard

    out, m = tiny_q
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None  # a local folder is no Hub id
    assert {"fp8ptq", "compressed-tensors", "fp8", "kv-cache-quantized"} <= set(card.data.tags)
    assert f"vllm serve {out} --kv-cache-dtype fp8" in card.text and "sglang.launch_server" in card.text
    assert f"{m['quality']['kl']:.5f}" in card.text and "| `kl<=1000` |" in card.text


def test_the_card_names_the_base_model_and_keeps_the_source_licence(tiny_q, tmp_path):
    from huggingface_hub import ModelCard

    from fp8ptq.export.card import card_metadata, write_card
    from fp8ptq.manifest import Manifest

    out, _ = tiny_q
    manifest = Manifest.load(out)
    assert card_metadata(manifest.model_copy(update={"model": "gemma3-270m"}))["base_model"] == "google/gemma-3-270m"
    hub = card_metadata(manifest.model_copy(update={"model": "org/some-model"}))
    assert hub["base_model"] == "org/some-model" and hub["base_model_relation"] == "quantized"
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\ntags: [theirs]\n---\n# The float model\n")
    for _ in range(2):  # the source's card, then the re-render of our own: the licence stays
        write_card(tmp_path, manifest, "# body\n")
        card = ModelCard.load(tmp_path / "README.md")
        assert card.data.license == "apache-2.0" and "theirs" not in card.data.tags and "The float" not in card.text


def test_push_dry_run_lists_the_export_and_leaves_out_what_is_not_its_own(tiny_q, tmp_path):
    import os
    import shutil

    out = tmp_path / "export"
    shutil.copytree(tiny_q[0], out)
    (tmp_path / "secret.txt").write_text("canary")
    os.symlink(tmp_path / "secret.txt", out / "notes.txt")  # a link out of the folder: never uploaded
    (out / ".out.lock").write_text("")
    r = runner.invoke(app, ["push", str(out), "me/tiny-fp8-kv8", "--dry-run"])
    assert r.exit_code == 0, r.output
    listed = [line.split("│")[1].strip() for line in r.output.splitlines() if line.count("│") == 3]
    assert listed[0] == "README.md" and "model.safetensors" in listed and "fp8ptq_manifest.json" in listed
    assert "notes.txt" not in listed and ".out.lock" not in listed and "left out: notes.txt" in r.output
    assert "would create 'me/tiny-fp8-kv8' (public" in r.output
    r = runner.invoke(app, ["push", str(out), "me/bad name", "--dry-run"])
    assert r.exit_code == 2 and "is not a Hub repository id" in r.output, r.output
    r = runner.invoke(app, ["push", str(tmp_path), "me/x", "--dry-run"])
    assert r.exit_code == 2 and "is not a finished fp8ptq export" in r.output, r.output
