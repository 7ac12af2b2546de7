"""`fp8ptq eval mmlu_pro` on the real model, offline, on the project's MMLU-Pro-format test fixture
(tests/fixtures/mmlu_pro_tiny: original questions written for tests, NOT MMLU-Pro results)."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8ptq.cli import app
from fp8ptq.cli.common import GATE_FAILED_EXIT

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).parents[1] / "fixtures" / "mmlu_pro_tiny"


def test_mmlu_pro_fp8_kv8_vs_bf16_with_gates(smol_kv8, tmp_path):
    out = tmp_path / "kv8"
    shutil.copytree(smol_kv8[0], out)  # the eval records itself into the checkpoint's report
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "mmlu_pro",
            str(out),
            "--baseline",
            "smollm2-135m",
            "--data",
            str(FIXTURE),
            "--limit",
            "2",
            "--max-gen-toks",
            "64",
            "--save",
            str(tmp_path / "r.json"),
            "--gate",
            "mmlu_pro_delta>=-100",
            "--gate",
            "mmlu_pro>=101",
        ],
    )
    # The second gate cannot pass: the command must exit 3 and name it.
    assert r.exit_code == GATE_FAILED_EXIT, r.output
    assert "mmlu_pro>=101: FAILED" in r.output and "mmlu_pro_delta>=-100: passed" in r.output
    res = json.loads((tmp_path / "r.json").read_text())
    rows = res["tasks"]
    assert set(rows) == {
        "mmlu_pro",
        "mmlu_pro_biology",
        "mmlu_pro_computer_science",
        "mmlu_pro_history",
        "mmlu_pro_math",
    }
    assert rows["mmlu_pro"]["n"] == 8 and all(rows[c]["n"] == 2 for c in rows if c != "mmlu_pro")
    assert res["numerics"]["kv_layers"] == 30 and res["numerics"]["static_inputs"] == 210
    assert res["baseline"]["numerics"]["quantized_linears"] == 0
    lo, hi = rows["mmlu_pro"]["delta_ci95"]
    assert lo <= rows["mmlu_pro"]["delta"] <= hi
    # recorded beside the checkpoint and rendered into its report
    assert json.loads((out / "fp8ptq_evals" / "mmlu_pro.json").read_text())["tasks"] == rows
    md = (out / "report.md").read_text()
    assert "## Evaluation: mmlu_pro" in md and "| mmlu_pro_history | 2 |" in md
