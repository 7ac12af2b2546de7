"""CI recipes: every built-in recipe runs end to end on the demo model through the CLI, as a user runs it:
its gates are evaluated, printed and recorded, the exit code follows them, the report is written.

Calibration is small here (8 x 128 tokens, 1 held-out sample, round to nearest for
conftest.RECIPE_CI_RTN, nvfp4 with one SmoothQuant alpha: conftest.RECIPE_CI_OPTIONS;
conftest.recipe_export, whose exports the engine tests in test_vllm_real.py serve too): the mechanics,
not the quality.
Each recipe's quality against its own gates, on the 8 x 256 calibration and 4 held-out samples the gates
were set for (what this test asserted until issue 31), is `make bench` (benchmarks/quality/recipes_bench.py;
results in BENCHMARKS.md)."""

import math
from html import escape

import pytest

from fp8ptq.cli.common import GATE_FAILED_EXIT
from fp8ptq.manifest import Manifest
from fp8ptq.recipe import Recipe, builtin_names, load_recipe
from tests.conftest import RECIPE_CI_OPTIONS, RECIPE_CI_RTN

pytestmark = pytest.mark.slow


OPS = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t, "<": lambda v, t: v < t, ">": lambda v, t: v > t}


@pytest.mark.parametrize("name", builtin_names())
def test_recipe_runs_and_evaluates_its_gates_on_demo_model(name, recipe_export):
    recipe = load_recipe(name)
    assert recipe.gates, f"recipe {name} carries no gates"
    out, output, exit_code = recipe_export(name)  # conftest: the CLI run, shared with the engine tests
    m = Manifest.load(out)
    assert not m.gates_skipped and [g.gate for g in m.gates] == list(recipe.gates), (m.gates, recipe.gates)
    for g in m.gates:  # each gate scored on a real number, and its verdict is the comparison's
        assert g.value is not None and math.isfinite(g.value), g
        assert g.passed == OPS[g.op](g.value, g.threshold), g
        assert f"{g.gate}: {'passed' if g.passed else 'FAILED'}" in output, output
    # the size gate does not depend on how much calibration ran: it holds here as on every model
    size = [g for g in m.gates if g.metric == "weight_bits"]
    assert len(size) == 1 and size[0].passed, size
    # the exit code follows the gates: 0 when all pass, GATE_FAILED_EXIT naming the failures otherwise
    assert exit_code == (0 if all(g.passed for g in m.gates) else GATE_FAILED_EXIT), output
    print(name, {g.gate: (round(g.value, 5), g.passed) for g in m.gates})
    assert m.quality is not None and math.isfinite(m.quality.kl)
    run = Recipe.model_validate(m.recipe)  # the recipe as run: conftest's --weights rtn applied
    assert run.calibration.weight_method == ("rtn" if name in RECIPE_CI_RTN else recipe.calibration.weight_method)
    assert m.calibration.tokens == 8 * 128 if run.needs_data else m.calibration is None
    options = RECIPE_CI_OPTIONS.get(name, [])
    if "--smooth-alpha" in options:  # the fixed alpha was applied, not searched
        alpha = float(options[options.index("--smooth-alpha") + 1])
        assert run.smooth.alpha == alpha and all(
            g["alpha"] == alpha for layer in m.layers for g in layer["transforms"]["smooth"].values()
        )
    html = (out / "report.html").read_text()
    assert all(f"<code>{escape(g.gate)}</code>" in html for g in m.gates)  # the report's gate table
