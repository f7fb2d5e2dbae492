"""The rules every exactness verdict rests on (``examples/_exact.py``), in one process.

Each case builds two small parameter sets by hand, with gradients whose errors are known in
closed form, so a change to the rules that would pass a wrong model shows here.
"""

from __future__ import annotations

import math

import pytest
import torch

from _exact import TOL, ZERO_FLOOR, grad_errors


def _model(**grads) -> torch.nn.Module:
    """A module with one parameter per keyword, its ``.grad`` the given tensor (or None)."""
    m = torch.nn.Module()
    for name, g in grads.items():
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = g
        m.register_parameter(name, p)
    return m


ONES = torch.ones(4)


def test_each_gradient_is_held_to_its_own_norm() -> None:
    errors = grad_errors(_model(w=ONES * (1 + 1e-6), b=ONES * 1e-3 * (1 + 3e-5)), _model(w=ONES, b=ONES * 1e-3))
    assert errors["w"] == pytest.approx(1e-6, rel=0.1) and errors["b"] == pytest.approx(3e-5, rel=0.01)  # fp32 steps


def test_a_gradient_on_one_side_only_is_wrong_unless_the_other_side_is_zero() -> None:
    # An output the loss ignores: eager autograd leaves its parameters' .grad None, a compiled graph
    # gives them zeros. Both mean zero; a nonzero gradient against None does not.
    errors = grad_errors(_model(w=ONES, pooler=torch.zeros(4), head=ONES), _model(w=ONES, pooler=None, head=None))
    assert errors == {"w": 0.0, "pooler": 0.0, "head": math.inf}
    assert grad_errors(_model(w=ONES, pooler=None), _model(w=ONES, pooler=torch.zeros(4)))["pooler"] == 0.0


def test_a_gradient_zero_in_exact_arithmetic_is_held_to_a_fraction_of_the_whole() -> None:
    # ||whole|| = 2 (w), so the floor is ZERO_FLOOR * 2; k_bias's reference is fp32 noise.
    noise = ONES * 1e-9
    got = _model(w=ONES, k_bias=noise + ZERO_FLOOR / 2)  # off by ZERO_FLOOR / 2 * ||ones(4)||: half the floor
    errors = grad_errors(got, _model(w=ONES, k_bias=noise), zero=["k_bias"])
    assert errors["k_bias"] == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(AssertionError, match="listed as zero"):  # a gradient that is not small
        grad_errors(got, _model(w=ONES, k_bias=ONES), zero=["k_bias"])


def test_an_ill_conditioned_gradient_is_judged_against_the_float64_truth() -> None:
    true = ONES.double()
    want = ONES * (1 + 4e-5)  # the fp32 one-process run is itself 4e-5 off the truth
    near = grad_errors(_model(g=ONES * (1 - 6e-5)), _model(g=want), truth={"g": true})["g"]  # 6e-5 <= 2 * 4e-5
    far = grad_errors(_model(g=ONES * (1 - 9e-5)), _model(g=want), truth={"g": true})["g"]  # 9e-5 > 2 * 4e-5
    assert near <= TOL < far
