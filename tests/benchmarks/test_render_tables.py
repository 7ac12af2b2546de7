"""BENCHMARKS.md's rendered tables are what benchmarks/render_tables.py prints from the committed JSON:
a re-measured benchmark changes the page through its JSON, never by hand."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from render_tables import BLOCK, render_page  # noqa: E402


def results_copy(root: Path) -> Path:
    """Every JSON the page renders from, copied under root (a test changes one): root/benchmarks/results."""
    page = (REPO / "BENCHMARKS.md").read_text()
    for m in BLOCK.finditer(page):
        (root / m.group(3)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / m.group(3), root / m.group(3))
    return root / "benchmarks" / "results"


def test_benchmarks_page_equals_its_render():
    page = (REPO / "BENCHMARKS.md").read_text()
    assert BLOCK.search(page), "BENCHMARKS.md has no rendered table"
    assert render_page(page) == page, "run: python benchmarks/render_tables.py --write BENCHMARKS.md"


def test_a_changed_result_changes_the_page(tmp_path):
    page = (REPO / "BENCHMARKS.md").read_text()
    results = results_copy(tmp_path)
    data = json.loads((results / "recipes.json").read_text())
    data["recipes"][0]["quality"]["kl"] = 0.5
    data["recipes"][0]["passed"] = False
    (results / "recipes.json").write_text(json.dumps(data))
    changed = render_page(page, root=tmp_path)
    row = next(line for line in changed.splitlines() if line.startswith(f"| {data['recipes'][0]['recipe']} |"))
    assert changed != page and "| 0.5000 / " in row and "**no**" in row


def test_the_ci_suite_table_is_rendered_from_its_json(tmp_path):
    page = (REPO / "BENCHMARKS.md").read_text()
    results = results_copy(tmp_path)
    suite = json.loads((results / "ci-suite.json").read_text())
    row = {"stop": "99", "wall_s": 1234, "pytest_s": None, "tests": "1 passed", "ci_s": None, "machine": "M"}
    row |= {"commit": "abc1234", "cmd": "(a)", "link": None, "notes": {"wall_s": "⁹"}}
    suite["rows"].insert(0, row)
    (results / "ci-suite.json").write_text(json.dumps(suite))
    changed = render_page(page, root=tmp_path)
    assert "| 99 | 1234 ⁹ | — | 1 passed | — | M | abc1234 | (a) | — |" in changed and changed != page


def test_the_gguf_table_is_rendered_from_its_json(tmp_path):
    page = (REPO / "BENCHMARKS.md").read_text()
    results = results_copy(tmp_path)
    data = json.loads((results / "llamacpp.json").read_text())
    data["exports"]["fp8ptq Q4_K_M"] |= {"quant_kl": 0.0399, "engine_top1": 0.5, "commit": "abc1234"}
    data["exports"]["fp8ptq Q8_0"]["mb"] = 140.0
    data |= {"machine": "M9", "rows": 8}
    (results / "llamacpp.json").write_text(json.dumps(data))
    changed = render_page(page, root=tmp_path).splitlines()
    q4 = next(line for line in changed if line.startswith("| fp8ptq `--gguf-type Q4_K_M` |"))
    assert "| 100.6 | 0.0399 | 0.079 / 0.0055 / 0.500 | abc1234 | M9 |" in q4
    assert any(line.startswith("| fp8ptq Q6_K / Q8_0 | 132.0 / 140.0 | 0.0048 / 0.0012 |") for line in changed)
    assert any(line.startswith("Command: `make llama") and "8×256 held-out tokens" in line for line in changed)
