"""Scores of extreme magnitude (1e300, 1e-300, subnormals) give the figures of the same scores
at an ordinary scale: the figures are scale-invariant, and the estimators rescale such columns by
an exact power of two before computing (privmon/estimators/magnitude.py). Above 2-D the learned
rule's summaries read the scores' own units (the softmax entropy depends on their scale); on the
mean shifts here the rule it takes is a logistic one, which is invariant."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privmon import analyse, optimal_advantage
from privmon.estimators.magnitude import SAFE_EXPONENT, magnitude_scale

FIGURES = ("value", "lower", "lower_check", "plugin", "upper")


def _scores(d: int, seed: int = 0):
    g = np.random.default_rng(seed)
    return g.normal(0.5, 1.0, (500, d)), g.normal(0.0, 1.0, (500, d))


def _assert_same(a, b):
    """Two analyse results agree in every figure (to rounding: the scaled scores are rounded
    once more), and neither lost anything."""
    assert a.failures == {} and b.failures == {}
    assert set(a.estimates) == set(b.estimates) == {"histogram", "kde"}
    for method in a.estimates:
        for f in FIGURES:
            x, y = getattr(a.estimates[method], f), getattr(b.estimates[method], f)
            assert math.isfinite(x) and y == pytest.approx(x, abs=1e-12), (method, f)
    assert b.roc == pytest.approx(a.roc, abs=1e-12)
    assert b.risk == pytest.approx(a.risk, abs=1e-12)
    assert b.top_records == a.top_records


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("scale", [1e155, 1e300, 1e-300])
def test_extreme_magnitudes_give_the_ordinary_figures(d, scale):
    m, h = _scores(d)
    # errors="raise": the 1-D KDE's padding overflowed (OverflowError), 2-D raised or read 0.0
    # and above 2 D the learned rule's standardisation overflowed to a silent 0.0
    _assert_same(analyse(m, h), analyse(m * scale, h * scale))


def test_subnormal_scores_lose_no_figure():
    """Scores near 5e-320 keep only a few digits (the ordinary figures cannot be expected), but
    every figure is computed and finite."""
    m, h = _scores(2)
    result = analyse(m * 5e-320, h * 5e-320)
    assert result.failures == {} and set(result.estimates) == {"histogram", "kde"}
    for est in result.estimates.values():
        assert all(math.isfinite(getattr(est, f)) for f in FIGURES)
        assert 0.0 <= est.value <= 1.0


def test_one_extreme_column_beside_ordinary_ones():
    m, h = _scores(3)
    factor = np.array([1e300, 1.0, 1e-300])
    _assert_same(analyse(m, h), analyse(m * factor, h * factor))


def test_the_three_dimensional_value_is_not_lost_at_1e200():
    """A mean shift at d = 4: the learned rule's figure at 1e200 is the ordinary one, well
    above 0 (it read 0.0 when squares of the scores overflowed)."""
    g = torch.Generator().manual_seed(0)
    m = torch.randn(600, 4, generator=g, dtype=torch.float64) + 0.5
    h = torch.randn(1800, 4, generator=g, dtype=torch.float64)
    ordinary = optimal_advantage(m, h)
    extreme = optimal_advantage(m * 1e200, h * 1e200)
    assert ordinary.value > 0.3
    assert extreme.value == pytest.approx(ordinary.value, abs=1e-12)
    assert extreme.lower == pytest.approx(ordinary.lower, abs=1e-12)


@pytest.mark.parametrize("method", ["histogram", "kde"])
@pytest.mark.parametrize("d", [1, 2])
def test_a_given_grid_is_rescaled_with_the_scores(method, d):
    """``low`` / ``high`` are in the scores' units: rescaled with them, the grid (and so every
    figure) is the one given; a scalar bound serves every dimension."""
    m, h = _scores(d)
    scale = 2.0**900
    kw = {"method": method, "low": -2.0, "high": [3.0] * d}
    ordinary = optimal_advantage(m, h, **kw)
    extreme = optimal_advantage(
        m * scale, h * scale, method=method, low=-2.0 * scale, high=[3.0 * scale] * d
    )
    default_grid = optimal_advantage(m, h, method=method)
    for f in FIGURES:
        assert getattr(extreme, f) == pytest.approx(getattr(ordinary, f), abs=1e-12), f
    # the bounds are honoured: a grid other than the default one gives other plug-ins
    assert ordinary.plugin != default_grid.plugin


@pytest.mark.parametrize("scale", [1.0, 1e300])
def test_a_bound_of_the_wrong_length_is_refused_by_name(scale):
    """(A RuntimeError from inside the binning before.)"""
    m, h = _scores(2)
    with pytest.raises(ValueError, match=r"low must be one number or one per dimension \(2\)"):
        optimal_advantage(m * scale, h * scale, low=[0.0] * 3, high=[1.0] * 3)
    with pytest.raises(ValueError, match="given together"):
        optimal_advantage(m * scale, h * scale, low=0.0)


def test_ordinary_scores_are_left_as_they_are():
    edge = 2.0**SAFE_EXPONENT
    x = torch.tensor([[edge, -1.0 / edge, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert magnitude_scale(x) is None  # the range's ends are inside, zero columns too
    assert magnitude_scale(torch.empty(0, 2, dtype=torch.float64)) is None
    beyond = torch.tensor(
        [[math.nextafter(edge, math.inf), 1.0, -math.nextafter(1 / edge, 0)]], dtype=torch.float64
    )
    assert magnitude_scale(beyond).tolist() == [2.0**-64, 1.0, 2.0**65]


finite = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(finite, min_size=3, max_size=3), min_size=1, max_size=6))
def test_the_scale_is_an_exact_power_of_two_bringing_each_column_into_range(rows):
    x = torch.tensor(rows, dtype=torch.float64)
    scale = magnitude_scale(x)
    largest = x.abs().amax(dim=0)
    inside = (largest == 0) | ((largest >= 2.0**-SAFE_EXPONENT) & (largest <= 2.0**SAFE_EXPONENT))
    if scale is None:
        assert bool(inside.all())
        return
    mantissa, _ = torch.frexp(scale)
    assert bool((mantissa == 0.5).all())  # a power of two: no digit of a score changes
    scaled = (x * scale).abs().amax(dim=0)
    for j in range(3):
        if bool(inside[j]):
            assert scale[j] == 1.0
        elif largest[j] >= 2.0**-1022:  # normal: brought into [1, 2), exactly
            assert 1.0 <= scaled[j] < 2.0
            # exact, but for scores so far below the column's largest that they turn subnormal
            column = x[:, j]
            normal = (column * scale[j]).abs() >= 2.0**-1022
            assert bool(((column * scale[j]) / scale[j] == column)[normal].all())
        else:  # subnormal: as far up as a finite power of two takes it
            assert scale[j] == 2.0**1023 and 2.0**-SAFE_EXPONENT <= scaled[j] < 2.0


@pytest.mark.parametrize("far", [1e155, 1e200, 1e300])
def test_one_far_score_in_1d_never_overflows(far):
    """The 1-D rules read ranks: one member moved from the top to ``far`` changes no rule
    figure. U_N, on the raw scale, is computed up to ~1e154 times the others' spread and
    beyond that reported lost by a ValueError naming why (never an OverflowError raised)."""
    rng = np.random.default_rng(12)
    mem, non = rng.normal(0.6, 1.0, 400), rng.normal(0.0, 1.0, 400)
    base = analyse(mem, non)
    mem[np.argmax(mem)] = far
    res = analyse(mem, non)  # errors="raise"
    for method in ("histogram", "kde"):
        for f in ("value", "lower", "lower_check"):
            assert getattr(res.estimates[method], f) == getattr(base.estimates[method], f)
    if far < 1e160:
        assert math.isfinite(res.estimates["kde"].plugin) and not res.failures
    else:
        assert math.isnan(res.estimates["kde"].plugin)
        assert res.failures["kde/plugin"].startswith("ValueError: a KDE kernel is wider")


def test_one_record_in_a_class_is_said_as_such_by_the_kde():
    # the spread of one record is undefined: it was reported as a kernel too wide for float64,
    # with torch's degrees-of-freedom warning on the way
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = analyse([1.0], [0.0, 2.0], errors="skip")
    assert result.failures == {
        "kde/plugin": "ValueError: a KDE needs at least 2 records in each class to set its "
        "bandwidth"
    }
