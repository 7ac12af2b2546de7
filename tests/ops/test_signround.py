"""SignRound's pieces (ops/signround.py) on every weight grid fp8ptq solves on: the offsets start exactly at
the solver's codes, pass a straight-through gradient, stay within half a step, and every code they reach is
on the solver's grid with its params; GPTQ hands over the error-updated weights it rounded."""

import pytest
import torch

from fp8ptq.ops.signround import REACH, Offsets, step_of
from fp8ptq.quantization.weights import fake_quant_with, solve_group, split_group
from fp8ptq.recipe import load_recipe

GRIDS = ["w4a16", "w8a8-int8", "nvfp4a16", "mxfp4a16", "fp8-dynamic", "fp8-block", "mxfp8"]


def _solved(recipe: str, method: str = "rtn", H=None):
    r = load_recipe(recipe)
    cal = r.calibration.model_copy(update={"weight_method": method})
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    return solve_group({"m": w}, r.scheme.weights, cal, H, r.scheme.input_activations is None)


@pytest.mark.parametrize("recipe", GRIDS)
def test_offsets_start_at_the_solvers_codes_and_reach_only_its_grid(recipe):
    g = _solved(recipe)
    o = Offsets(g.start, g.q, step_of(g.scale, g.w.shape), lambda x: fake_quant_with(x, g))
    assert torch.equal(o.codes(), g.q)
    y = o.weight()
    assert torch.equal(y.detach(), g.q)  # forward: the grid's own fake-quant
    r = torch.randn_like(y)
    (y * r).sum().backward()
    assert torch.allclose(o.v.grad, r * o.step)  # straight through, in units of the weight's own step
    o.sign_step(0.75)
    assert o.v.grad is None and float(o.v.detach().abs().max()) == REACH
    moved = o.codes()
    assert not torch.equal(moved, g.q)  # half a step against every gradient sign flips codes ...
    assert torch.equal(fake_quant_with(moved, g), moved)  # ... onto the same grid, same params


def test_gptq_rounds_from_the_weights_it_hands_over():
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(1))
    g = _solved("w4a16", "gptq", 2 * x.T @ x)  # act-order, static groups, MSE clip
    assert not torch.equal(g.start, g.w)  # error-updated, not the float weights
    assert torch.equal(fake_quant_with(g.start, g), g.q)


@pytest.mark.parametrize("recipe", ["w4a16", "fp8-kv8"])
def test_the_reported_output_error_is_of_the_codes_installed(recipe):
    # GPTQ reports its own output error (no [out, in] x [in, in] product); once a refinement moves the codes
    # (SignRound sets q), the report is of the new codes
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(2))
    H = 2 * x.T @ x
    g = _solved(recipe, "gptq", H)
    solver_err = g.solver_err

    def reported_and_product(q):
        d = (q - g.w).double()
        product = float(((d @ H.double()) * d).sum() / ((g.w.double() @ H.double()) * g.w.double()).sum())
        return split_group(g, H)["m"].report["output_rel_err"], product**0.5

    assert solver_err is not None and solver_err[0] is g.q
    got, want = reported_and_product(g.q)
    assert got == pytest.approx(want, rel=1e-4)
    g.q = fake_quant_with(g.w * 1.02, g)  # other codes on the same grid
    moved, want_moved = reported_and_product(g.q)
    assert moved == pytest.approx(want_moved, rel=1e-4) and moved != pytest.approx(got, rel=1e-3)
