"""BENCHMARKS.md's rendered tables are what benchmarks/render_tables.py prints from the committed JSON:
a re-measured benchmark changes the page through its JSON, never by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from render_tables import BLOCK, render_page  # noqa: E402


def test_benchmarks_page_equals_its_render():
    page = (REPO / "BENCHMARKS.md").read_text()
    assert BLOCK.search(page), "BENCHMARKS.md has no rendered table"
    assert render_page(page) == page, "run: python benchmarks/render_tables.py --write BENCHMARKS.md"


def test_a_changed_result_changes_the_page(tmp_path):
    page = (REPO / "BENCHMARKS.md").read_text()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    data = json.loads((REPO / "benchmarks/results/recipes.json").read_text())
    data["recipes"][0]["quality"]["kl"] = 0.5
    data["recipes"][0]["passed"] = False
    (tmp_path / "benchmarks/results/recipes.json").write_text(json.dumps(data))
    suite = (REPO / "benchmarks/results/ci-suite.json").read_text()
    (tmp_path / "benchmarks/results/ci-suite.json").write_text(suite)
    changed = render_page(page, root=tmp_path)
    row = next(line for line in changed.splitlines() if line.startswith(f"| {data['recipes'][0]['recipe']} |"))
    assert changed != page and "| 0.5000 |" in row and "| **no** |" in row


def test_the_ci_suite_table_is_rendered_from_its_json(tmp_path):
    page = (REPO / "BENCHMARKS.md").read_text()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    data = json.loads((REPO / "benchmarks/results/recipes.json").read_text())
    (tmp_path / "benchmarks/results/recipes.json").write_text(json.dumps(data))
    suite = json.loads((REPO / "benchmarks/results/ci-suite.json").read_text())
    row = {"stop": "99", "wall_s": 1234, "pytest_s": None, "tests": "1 passed", "ci_s": None, "machine": "M"}
    row |= {"commit": "abc1234", "cmd": "(a)", "link": None, "notes": {"wall_s": "⁹"}}
    suite["rows"].insert(0, row)
    (tmp_path / "benchmarks/results/ci-suite.json").write_text(json.dumps(suite))
    changed = render_page(page, root=tmp_path)
    assert "| 99 | 1234 ⁹ | — | 1 passed | — | M | abc1234 | (a) | — |" in changed and changed != page
