"""lm-eval integration: local MMLU-Pro-format data, validation errors, paired deltas, custom local tasks.
Runs on the tiny random model (fast); the real model is in test_real_eval.py."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8ptq.cli import app
from fp8ptq.cli.common import GATE_FAILED_EXIT
from fp8ptq.errors import DataError
from fp8ptq.eval.harness import HarnessConfig, HarnessResult, _categories, _mmlu_pro_files, _paired_delta, run
from fp8ptq.results import read_json

pytestmark = pytest.mark.tiny

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mmlu_pro_tiny"
runner = CliRunner()


def test_fixture_is_mmlu_pro_shaped():
    fmt, files = _mmlu_pro_files(str(FIXTURE))
    assert fmt == "json" and set(files) == {"test", "validation"}
    assert _categories(fmt, files, 5) == ["biology", "computer science", "history", "math"]


def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        _mmlu_pro_files(str(tmp_path / "nope"))
    shutil.copy(FIXTURE / "test.jsonl", tmp_path / "test.jsonl")
    with pytest.raises(DataError, match="no validation split") as e:
        _mmlu_pro_files(str(tmp_path))
    assert "validation.jsonl" in str(e.value)
    fmt, files = _mmlu_pro_files(str(FIXTURE))
    with pytest.raises(DataError, match="fewer than 6 examples") as e:
        _categories(fmt, files, 6)
    assert "--num-fewshot to 5" in str(e.value)
    rows = [json.loads(l) for l in (FIXTURE / "validation.jsonl").read_text().splitlines()]
    (tmp_path / "validation.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "cot_content"}) + "\n" for r in rows)
    )
    with pytest.raises(DataError, match="lacks columns \\['cot_content'\\]"):
        _categories(*_mmlu_pro_files(str(tmp_path)), 5)


def test_paired_delta():
    cand = {"a": {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}}
    base = {"a": {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0}}
    delta, lo, hi = _paired_delta(cand, base, ["a"])
    # diffs 0,1,0,1: mean 0.5, sample sd 0.57735, se 0.288675
    assert delta == pytest.approx(50.0)
    assert lo == pytest.approx(50 - 1.96 * 28.8675, abs=1e-3) and hi == pytest.approx(50 + 1.96 * 28.8675, abs=1e-3)


def test_mmlu_pro_runs_on_tiny_model(tiny_dir):
    r = run(HarnessConfig(model=str(tiny_dir), data=str(FIXTURE), limit=1, max_gen_toks=4, num_fewshot=1))
    assert set(r.tasks) == {
        "mmlu_pro",
        "mmlu_pro_biology",
        "mmlu_pro_computer_science",
        "mmlu_pro_history",
        "mmlu_pro_math",
    }
    assert r.tasks["mmlu_pro"].n == 4 and r.tasks["mmlu_pro"].metric == "exact_match" and r.group == "mmlu_pro"
    assert 0 <= r.tasks["mmlu_pro"].score <= 100 and r.tasks["mmlu_pro"].delta is None and r.baseline is None


LOCAL_TASK = """
task: fixture_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{options}}}}"
doc_to_target: answer_index
metric_list:
  - metric: acc
"""


def test_eval_tasks_local_task_with_baseline_and_gate(tiny_dir, tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "fixture_mc.yaml").write_text(LOCAL_TASK.format(test=FIXTURE / "test.jsonl"))
    args = [
        "eval",
        "tasks",
        str(tiny_dir),
        "--tasks",
        "fixture_mc",
        "--include-path",
        str(tmp_path / "tasks"),
        "--baseline",
        str(tiny_dir),
        "--limit",
        "6",
        "--json",
        "--save",
        str(tmp_path / "r.json"),
    ]
    r = runner.invoke(app, [*args, "--gate", "fixture_mc_delta>=0", "--gate", "fixture_mc>100"])
    assert r.exit_code == GATE_FAILED_EXIT, r.output
    res = json.loads((tmp_path / "r.json").read_text())
    row = res["tasks"]["fixture_mc"]
    assert row["metric"] == "acc" and row["n"] == 6
    assert row["delta"] == 0.0 and row["baseline"] == row["score"]  # same model twice: identical answers
    assert [g["passed"] for g in res["gates"]] == [True, False]
    assert "fixture_mc>100: FAILED" in r.output
    assert res["schema"] == "lm-eval"
    back = read_json(tmp_path / "r.json", HarnessResult)  # the saved result reads back through validation
    assert back.tasks["fixture_mc"].delta_ci95 is not None and back.baseline.model == str(tiny_dir)


def test_unknown_task_or_gate_is_a_clear_error(tiny_dir):
    r = runner.invoke(app, ["eval", "tasks", str(tiny_dir), "--tasks", "mmlu_pro_biologee"])
    assert r.exit_code == 2 and "unknown lm-eval task 'mmlu_pro_biologee'" in r.output
    r = runner.invoke(app, ["eval", "mmlu_pro", str(tiny_dir), "--data", str(FIXTURE), "--gate", "kl<=0.1"])
    assert r.exit_code == 2 and "produces no 'kl'" in r.output


def test_mmlu_pro_without_local_data_fails_offline(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    r = runner.invoke(app, ["eval", "mmlu_pro", str(tiny_dir), "--limit", "1"])
    assert r.exit_code == 2, r.output
    assert "--data DIR" in r.output
