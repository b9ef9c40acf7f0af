"""Tests for privmon.estimators.roc: values vs sklearn, closed forms and hand examples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.integrate import trapezoid
from scipy.stats import norm
from sklearn.metrics import accuracy_score, roc_auc_score
from sklearn.metrics import roc_curve as sk_roc_curve

from privmon.estimators.roc import (
    accuracy_at_median,
    auc,
    roc_curve,
    roc_summary,
    top_q_precision,
    tpr_at_fpr,
)


def _pooled(pos, neg):
    y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    return y, np.r_[pos, neg]


# --- AUC ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rounded", [False, True])
def test_auc_matches_sklearn(seed, rounded):
    rng = np.random.default_rng(seed)
    pos = rng.normal(0.4, 1.0, size=rng.integers(1, 400))
    neg = rng.normal(0.0, 1.0, size=rng.integers(1, 400))
    if rounded:  # heavy ties: about 7 distinct values
        pos, neg = np.round(pos), np.round(neg)
    y, s = _pooled(pos, neg)
    assert auc(pos, neg) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_auc_hand_example_with_ties():
    # pairs (m, h): 2>1, 2>0, 2=2 (1/2); 1=1 (1/2), 1>0, 1<2  ->  (1+1+.5+.5+1+0)/6 = 4/6
    assert auc([2.0, 1.0], [1.0, 0.0, 2.0]) == pytest.approx(4 / 6, abs=1e-15)
    assert auc([1.0, 1.0], [1.0]) == 0.5
    assert auc([3.0], [1.0, 2.0]) == 1.0
    assert auc([0.0], [1.0, 2.0]) == 0.0


def test_auc_gaussian_closed_form():
    # members ~ N(mu, 1), non-members ~ N(0, 1): AUC = P(X - Y > 0) = Phi(mu / sqrt 2).
    # The empirical AUC (a U-statistic) has sd <= sqrt((n1 + n0 + 1) / (12 n1 n0)) (its value under
    # the null, which upper-bounds it for moderate mu); with n1 = n0 = 20000 that is ~0.0029, so a
    # tolerance of 0.015 is > 5 sd (fixed seed, but it would hold for almost every seed).
    rng = np.random.default_rng(0)
    n = 20_000
    for mu in (0.0, 0.5, 1.5):
        pos = rng.normal(mu, 1.0, n)
        neg = rng.normal(0.0, 1.0, n)
        sd = math.sqrt((2 * n + 1) / (12 * n * n))
        assert abs(auc(pos, neg) - norm.cdf(mu / math.sqrt(2))) < 5 * sd


# --- ROC curve ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rounded", [False, True])
def test_roc_curve_matches_sklearn_exactly(seed, rounded):
    rng = np.random.default_rng(100 + seed)
    pos = rng.normal(0.3, 1.0, size=rng.integers(1, 300))
    neg = rng.normal(0.0, 1.0, size=rng.integers(1, 300))
    if rounded:
        pos, neg = np.round(2 * pos), np.round(2 * neg)
    y, s = _pooled(pos, neg)
    fpr, tpr, thr = roc_curve(pos, neg)
    sk_fpr, sk_tpr, sk_thr = sk_roc_curve(y, s, drop_intermediate=False)
    np.testing.assert_array_equal(fpr, sk_fpr)
    np.testing.assert_array_equal(tpr, sk_tpr)
    np.testing.assert_array_equal(thr, sk_thr)
    assert thr[0] == np.inf and (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1, 1)


def test_roc_curve_hand_example():
    fpr, tpr, thr = roc_curve([3.0, 2.0], [2.0, 1.0])
    np.testing.assert_array_equal(thr, [np.inf, 3.0, 2.0, 1.0])
    np.testing.assert_array_equal(tpr, [0.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(fpr, [0.0, 0.0, 0.5, 1.0])


# --- TPR at FPR -----------------------------------------------------------------------------------


def test_tpr_at_fpr_hand_example():
    # 10 non-members 0..9, members 9.5, 8.5, 8.5, 5.5, 0.5 (n1 = 5).
    neg = np.arange(10.0)
    pos = np.array([9.5, 8.5, 8.5, 5.5, 0.5])
    # ROC points (fpr, tpr): (0, 0), (0, .2) @9.5, (.1, .2) @9, (.1, .6) @8.5, (.2, .6) @8, ...,
    # (.4, .6) @6, (.4, .8) @5.5, (.5, .8) @5, ..., (.9, .8) @1, (.9, 1) @.5, (1, 1) @0.
    got = tpr_at_fpr(pos, neg, fpr=(0.05, 0.1, 0.35, 0.4, 0.99))
    assert got == {0.05: 0.2, 0.1: 0.6, 0.35: 0.6, 0.4: 0.8, 0.99: 1.0}
    # below 1/n0 only the points with fpr = 0 count; none of them here above tpr = 0.2
    assert tpr_at_fpr(pos, neg, fpr=0.001) == {0.001: 0.2}
    # defaults
    assert list(tpr_at_fpr(pos, neg)) == [0.1, 0.01, 0.001]


def test_tpr_at_fpr_is_max_tpr_over_roc_points():
    rng = np.random.default_rng(7)
    pos = np.round(rng.normal(1.0, 1.0, 500), 1)
    neg = np.round(rng.normal(0.0, 1.0, 700), 1)
    fpr, tpr, _ = roc_curve(pos, neg)
    targets = (0.3, 0.1, 0.01, 0.001)
    got = tpr_at_fpr(pos, neg, fpr=targets)
    for t in targets:
        assert got[t] == tpr[fpr <= t].max()


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, float("nan"), (0.1, 2.0), ()])
def test_tpr_at_fpr_rejects_bad_fpr(bad):
    with pytest.raises(ValueError, match="fpr"):
        tpr_at_fpr([1.0], [0.0], fpr=bad)
    with pytest.raises(ValueError, match="fpr"):
        roc_summary([1.0], [0.0], fpr=bad)


# --- accuracy at the median -----------------------------------------------------------------------


def test_accuracy_at_median_hand_example():
    # pooled: 1 2 3 4 | 5 6 7 8 -> tau = 4.5. members {5, 6, 7, 2}: 3 above tau; non-members
    # {1, 3, 4, 8}: 3 at or below tau  ->  6 / 8.
    assert accuracy_at_median([5.0, 6.0, 7.0, 2.0], [1.0, 3.0, 4.0, 8.0]) == 0.75
    # odd count, tie at tau: pooled 1 2 2 2 3 -> tau = 2; a member at 2 is predicted non-member
    # members {2, 3}: 1 correct; non-members {1, 2, 2}: 3 correct  ->  4 / 5
    assert accuracy_at_median([2.0, 3.0], [1.0, 2.0, 2.0]) == 0.8
    # all scores equal: everything predicted non-member
    assert accuracy_at_median([1.0, 1.0, 1.0], [1.0]) == 0.25


@pytest.mark.parametrize("seed", range(4))
def test_accuracy_at_median_matches_domias_reference(seed):
    # DOMIAS's evaluator: accuracy_score(y, scores > np.median(scores))
    rng = np.random.default_rng(200 + seed)
    pos = np.round(rng.normal(0.5, 1.0, size=rng.integers(1, 200)), seed % 2)
    neg = np.round(rng.normal(0.0, 1.0, size=rng.integers(1, 200)), seed % 2)
    y, s = _pooled(pos, neg)
    assert accuracy_at_median(pos, neg) == pytest.approx(
        accuracy_score(y, s > np.median(s)), abs=1e-15
    )


# --- top-q precision ------------------------------------------------------------------------------


def test_top_q_precision_hand_example_with_ties():
    # pooled sorted: 9(m) 8(m) 8(h) 8(h) 7(m) 5(h) 4(m) 3(h) 2(h) 1(h), n = 10, 4 members
    pos = [9.0, 8.0, 7.0, 4.0]
    neg = [8.0, 8.0, 5.0, 3.0, 2.0, 1.0]
    # q = .1: k = 1 -> {9}: 1
    # q = .2: k = 2 -> 9 plus 1 of the tied group {8m, 8h, 8h}: (1 + 1/3) / 2 = 2/3
    # q = .3: k = 3 -> 9 plus 2 of the tied group: (1 + 2/3) / 3 = 5/9
    # q = .4: k = 4 -> 9 and the whole tied group: 2 / 4
    # q = .25: k = ceil(2.5) = 3 -> 5/9;  q = 1: member fraction 4/10
    got = top_q_precision(pos, neg, q=[0.1, 0.2, 0.3, 0.4, 0.25, 1.0])
    np.testing.assert_allclose(got, [1.0, 2 / 3, 5 / 9, 0.5, 5 / 9, 0.4], rtol=0, atol=1e-15)
    assert isinstance(got, np.ndarray)
    single = top_q_precision(pos, neg, q=0.2)
    assert isinstance(single, float) and single == pytest.approx(2 / 3, abs=1e-15)
    # tiny q still takes one record
    assert top_q_precision(pos, neg, q=1e-9) == 1.0


def test_top_q_precision_without_ties_is_member_fraction_of_top_k():
    rng = np.random.default_rng(3)
    pos = rng.normal(1.0, 1.0, 137)
    neg = rng.normal(0.0, 1.0, 211)
    y, s = _pooled(pos, neg)
    order = np.argsort(-s)
    qs = np.array([0.01, 0.05, 0.2, 0.5, 1.0])
    got = top_q_precision(pos, neg, q=qs)
    for q, p in zip(qs, got, strict=True):
        k = math.ceil(round(q * len(s), 9))
        assert p == pytest.approx(y[order[:k]].mean(), abs=1e-12)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01, float("nan"), [0.5, 0.0], []])
def test_top_q_precision_rejects_bad_q(bad):
    with pytest.raises(ValueError, match="q must"):
        top_q_precision([1.0], [0.0], q=bad)


# --- summary --------------------------------------------------------------------------------------


def test_roc_summary_equals_individual_functions():
    rng = np.random.default_rng(11)
    pos = np.round(rng.normal(0.7, 1.0, 800), 1)
    neg = np.round(rng.normal(0.0, 1.0, 900), 1)
    s = roc_summary(pos, neg)
    assert list(s) == ["auc", "tpr@fpr=0.1", "tpr@fpr=0.01", "tpr@fpr=0.001", "accuracy_at_median"]
    assert s["auc"] == auc(pos, neg)
    t = tpr_at_fpr(pos, neg)
    assert [s["tpr@fpr=0.1"], s["tpr@fpr=0.01"], s["tpr@fpr=0.001"]] == list(t.values())
    assert s["accuracy_at_median"] == accuracy_at_median(pos, neg)
    assert all(isinstance(v, float) for v in s.values())
    assert list(roc_summary(pos, neg, fpr=[0.05])) == ["auc", "tpr@fpr=0.05", "accuracy_at_median"]


def test_summary_sorts_once(monkeypatch):
    import privmon.estimators.roc as roc

    calls = []
    real = roc._sort_descending

    def counting(x):
        calls.append(1)
        return real(x)

    monkeypatch.setattr(roc, "_sort_descending", counting)
    roc_summary([1.0, 2.0, 3.0], [0.5, 2.0])
    # reading the scores the other way round re-uses the same sort
    roc_summary([1.0, 2.0, 3.0], [0.5, 2.0, 7.0], higher_is_member=None)
    assert len(calls) == 2


def test_descending_sort_numpy_path_equals_torch_sort():
    import privmon.estimators.roc as roc

    x = torch.from_numpy(np.round(np.random.default_rng(0).normal(size=2000), 1))
    values, order = roc._sort_descending(x)
    torch.testing.assert_close(values, torch.sort(x, descending=True).values, rtol=0, atol=0)
    torch.testing.assert_close(x[order], values, rtol=0, atol=0)


def test_ascending_sort_numpy_path_equals_torch_sort():
    from privmon.estimators.order_statistics import sort_ascending

    x = torch.from_numpy(np.round(np.random.default_rng(0).normal(size=(2000, 2)), 1))
    torch.testing.assert_close(sort_ascending(x), torch.sort(x, dim=0).values, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(5))
def test_orientation_equals_negating_the_scores(seed):
    rng = np.random.default_rng(seed)
    m = np.round(rng.normal(-0.3, 1.0, 301), 1)  # ties, and members lower: AUC < 0.5
    n = np.round(rng.normal(0.0, 1.0, 250), 1)
    flipped = roc_summary(-m, -n)
    assert roc_summary(m, n, higher_is_member=False) == flipped
    assert roc_summary(m, n, higher_is_member=None) == flipped
    assert roc_summary(-m, -n, higher_is_member=None) == flipped  # already >= 0.5: kept
    assert roc_summary(m, n, higher_is_member=True) == roc_summary(m, n)
    with pytest.raises(ValueError, match="higher_is_member"):
        roc_summary(m, n, higher_is_member="yes")


# --- inputs: torch / numpy, shapes, NaN, errors ---------------------------------------------------


def test_torch_and_numpy_identical():
    rng = np.random.default_rng(5)
    pos = np.round(rng.normal(0.5, 1.0, 300), 1)
    neg = np.round(rng.normal(0.0, 1.0, 250), 1)
    tp, tn = torch.from_numpy(pos), torch.from_numpy(neg)
    tn_col = tn.reshape(-1, 1)
    assert auc(pos, neg) == auc(tp, tn) == auc(tp, tn_col) == auc(pos.tolist(), tn_col)
    assert auc(tp.float(), tn.float()) == auc(pos.astype(np.float32), neg.astype(np.float32))
    for a, b in zip(roc_curve(pos, neg), roc_curve(tp, tn_col), strict=True):
        np.testing.assert_array_equal(a, b)
    assert roc_summary(pos, neg) == roc_summary(tp, tn)
    np.testing.assert_array_equal(
        top_q_precision(pos, neg, q=[0.1, 0.5]), top_q_precision(tp, tn, q=(0.1, 0.5))
    )
    # requires_grad tensors are fine (detached)
    assert auc(tp.clone().requires_grad_(), tn) == auc(pos, neg)


def test_nan_and_inf_rows_dropped():
    pos = np.array([3.0, np.nan, 1.0, np.inf])
    neg = np.array([2.0, -np.inf, np.nan, 0.0])
    clean_pos, clean_neg = np.array([3.0, 1.0]), np.array([2.0, 0.0])
    assert auc(pos, neg) == auc(clean_pos, clean_neg) == 0.75
    for a, b in zip(roc_curve(pos, neg), roc_curve(clean_pos, clean_neg), strict=True):
        np.testing.assert_array_equal(a, b)
    assert accuracy_at_median(pos, neg) == accuracy_at_median(clean_pos, clean_neg)


@pytest.mark.parametrize(
    "fn",
    [
        auc,
        roc_curve,
        roc_summary,
        accuracy_at_median,
        lambda a, b: tpr_at_fpr(a, b, fpr=0.1),
        lambda a, b: top_q_precision(a, b, q=0.5),
    ],
)
def test_errors_name_the_argument(fn):
    good = np.array([0.0, 1.0])
    with pytest.raises(ValueError, match="member_scores"):
        fn(np.array([]), good)
    with pytest.raises(ValueError, match="nonmember_scores"):
        fn(good, np.array([np.nan, np.nan]))
    with pytest.raises(ValueError, match="member_scores"):
        fn(np.zeros((3, 2)), good)  # more than one dimension per record
    with pytest.raises(ValueError, match="nonmember_scores"):
        fn(good, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="nonmember_scores"):
        fn(good, np.zeros((2, 2, 2)))


# --- properties -----------------------------------------------------------------------------------

_score = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
_scores = st.lists(st.one_of(_score, st.integers(-3, 3).map(float)), min_size=1, max_size=40)


@settings(max_examples=100, deadline=None)
@given(_scores, _scores)
def test_auc_antisymmetric(a, b):
    assert auc(a, b) + auc(b, a) == pytest.approx(1.0, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(_scores, _scores)
def test_auc_invariant_to_increasing_transform(a, b):
    # strictly increasing on the reals and exact enough in float64 not to merge distinct inputs
    def f(x):
        return np.arctan(np.asarray(x) * 1e-6) * 3.0 - 7.0

    fa, fb = f(a), f(b)
    pooled = np.r_[a, b]
    assume(len(np.unique(f(pooled))) == len(np.unique(pooled)))  # no float collapse of inputs
    assert auc(fa, fb) == auc(a, b)


@settings(max_examples=100, deadline=None)
@given(_scores, _scores, st.integers(0, 5), st.integers(0, 5))
def test_nan_dropped_not_counted_as_ties(a, b, na, nb):
    with_nan_a = a + [float("nan")] * na
    with_nan_b = [float("nan")] * nb + b
    assert auc(with_nan_a, with_nan_b) == auc(a, b)
    assert accuracy_at_median(with_nan_a, with_nan_b) == accuracy_at_median(a, b)


@settings(max_examples=100, deadline=None)
@given(_scores, _scores)
def test_auc_matches_sklearn_property(a, b):
    y, s = _pooled(np.asarray(a), np.asarray(b))
    assert auc(a, b) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    fpr, tpr, _ = roc_curve(a, b)
    assert auc(a, b) == pytest.approx(trapezoid(tpr, fpr), abs=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    rng = np.random.default_rng(9)
    pos = torch.from_numpy(np.round(rng.normal(0.5, 1.0, 400), 1))
    neg = torch.from_numpy(np.round(rng.normal(0.0, 1.0, 300), 1))
    # non-members on CPU are moved onto the members' device
    assert roc_summary(pos.cuda(), neg) == roc_summary(pos, neg)
    assert top_q_precision(pos.cuda(), neg.cuda(), q=0.1) == top_q_precision(pos, neg, q=0.1)
    for a, b in zip(roc_curve(pos.cuda(), neg), roc_curve(pos, neg), strict=True):
        np.testing.assert_array_equal(a, b)
