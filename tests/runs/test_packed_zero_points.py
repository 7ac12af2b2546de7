"""Asymmetric grouped INT weights of a Linear with few output rows: compressed-tensors cannot unpack their
packed zero points, so the recipe is refused before any work, naming the Linears."""

import pytest

from fp8ptq.errors import RecipeError
from fp8ptq.recipe import load_recipe
from fp8ptq.runs.context import check_packed_zero_points


def test_a_few_row_linear_refuses_asymmetric_grouped_int_weights():
    recipe = load_recipe("w4a16")
    weights = [recipe.scheme.weights]
    outs, widths = {"mlp.gate": 4, "mlp.down_proj": 64}, {"mlp.gate": 256, "mlp.down_proj": 256}
    with pytest.raises(RecipeError) as e:
        check_packed_zero_points(recipe, weights, outs, widths)
    assert "mlp.gate (4)" in str(e.value) and "down_proj" not in str(e.value) and "ignore" in e.value.fix
    check_packed_zero_points(recipe, weights, outs, {"mlp.gate": 64, "mlp.down_proj": 256})  # one group: readable
    fp8 = load_recipe("fp8-dynamic")
    check_packed_zero_points(fp8, [fp8.scheme.weights], outs, widths)  # float weights: no zero points
