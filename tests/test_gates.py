"""Quality gates: parsing, checking, margins."""

import math

import pytest

from fp8ptq.errors import RecipeError
from fp8ptq.gates import Gate, check, parse_gate
from fp8ptq.recipe import parse_recipe


@pytest.mark.parametrize(
    "text, gate",
    [
        ("kl<=0.03", Gate("kl", "<=", 0.03)),
        (" top1 >= 0.9 ", Gate("top1", ">=", 0.9)),
        ("mmlu_pro_delta>=-1.0", Gate("mmlu_pro_delta", ">=", -1.0)),
        ("ppl_ratio<1.05", Gate("ppl_ratio", "<", 1.05)),
        ("size_ratio>1e-3", Gate("size_ratio", ">", 1e-3)),
    ],
)
def test_parse(text, gate):
    assert parse_gate(text) == gate


@pytest.mark.parametrize("text", ["kl", "kl=0.1", "kl<=abc", "<=0.1", "kl=>0.1", "kl<=0.1 top1>=0.9"])
def test_parse_rejects(text):
    with pytest.raises(RecipeError, match="METRIC OP NUMBER"):
        parse_gate(text)


def test_check_pass_fail_and_margin():
    res = check(
        [parse_gate("kl<=0.05"), parse_gate("top1>=0.9"), parse_gate("mmlu_pro_delta>=-1")],
        {"kl": 0.07, "top1": 0.95, "mmlu_pro_delta": -0.5},
    )
    assert [r.passed for r in res] == [False, True, True]
    assert res[0].margin == pytest.approx(-0.02) and res[1].margin == pytest.approx(0.05)
    assert "FAILED" in res[0].describe() and "kl<=0.05" in res[0].describe()


def test_missing_or_nan_metric_fails():
    res = check([parse_gate("kl<=1"), parse_gate("top1>=0")], {"top1": math.nan})
    assert not any(r.passed for r in res)
    assert "produced no 'kl'" in res[0].describe()


def test_recipe_gates_validated():
    base = {"name": "x", "scheme": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}
    assert parse_recipe({**base, "gates": ["kl<=0.1"]}, "t").gates == ("kl<=0.1",)
    with pytest.raises(RecipeError, match="gates"):
        parse_recipe({**base, "gates": ["kl is small"]}, "t")
