"""Tests for privmon.estimators.generalized: MACE eq. 4 presets, Thm 1 thresholds, Algorithm 2
on Gaussian pairs against closed-form truths, Lemma 7 / App. D bounds against brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from scipy.stats import norm

from privmon.estimators.advantage import optimal_advantage
from privmon.estimators.estimates import accuracy_advantage
from privmon.estimators.generalized import (
    GeneralizedEstimate,
    _population_form,
    _ratio_min,
    generalized_advantage,
)
from privmon.estimators.generalized_metric import ACC, F1, PPV, TNR, TPR, WA, GeneralizedMetric
from privmon.estimators.lemma7 import _lemma7_candidates, _ratio_of_sums_max, lemma7_bounds

# Members N(1, 1), non-members N(0, 1): the likelihood ratio increases in x; P >= Q iff x >= 1/2.
PHI = norm.cdf(0.5)


def _confusion(prior, tpr, fpr):
    return prior * tpr, (1 - prior) * fpr, prior * (1 - tpr), (1 - prior) * (1 - fpr)


def _gaussians(n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n)


# --- presets: the coefficient form reproduces the named formula (MACE App. B) -----------------


def test_presets_match_direct_formulas():
    rng = np.random.default_rng(0)
    for prior in rng.uniform(0.02, 0.98, size=25):
        tpr, fpr = rng.uniform(0, 1, 200), rng.uniform(0, 1, 200)
        tp, fp, fn, tn = _confusion(prior, tpr, fpr)
        np.testing.assert_allclose(tp + fp + fn + tn, 1.0)
        np.testing.assert_allclose(ACC.value(tp, fp, fn, tn), (tp + tn) / (tp + fp + fn + tn))
        np.testing.assert_allclose(PPV.value(tp, fp, fn, tn), tp / (tp + fp))
        np.testing.assert_allclose(TPR.value(tp, fp, fn, tn), tp / (tp + fn))
        np.testing.assert_allclose(TPR.value(tp, fp, fn, tn), tpr)
        np.testing.assert_allclose(TNR.value(tp, fp, fn, tn), tn / (fp + tn))
        np.testing.assert_allclose(F1.value(tp, fp, fn, tn), 2 * tp / (2 * tp + fp + fn))
        np.testing.assert_allclose(
            WA.value(tp, fp, fn, tn), (2 * tp + 2 * tn) / (2 * tp + 2 * tn + fp + fn)
        )
        w1, w2, w3, w4 = rng.uniform(0.1, 5, 4)
        np.testing.assert_allclose(
            GeneralizedMetric.wa(w1, w2, w3, w4).value(tp, fp, fn, tn),
            (w1 * tp + w2 * tn) / (w1 * tp + w2 * tn + w3 * fp + w4 * fn),
        )
        # AM = (TPR + TNR)/2 with TPR = TP/(TP + FN), TNR = TN/(TN + FP): exact at its own prior
        am = GeneralizedMetric.am(prior)
        np.testing.assert_allclose(
            am.value(tp, fp, fn, tn), (tp / (tp + fn) + tn / (tn + fp)) / 2, rtol=1e-12
        )
        # ACC of a rule is (1 + its accuracy advantage)/2 (MACE eq. 2)
        np.testing.assert_allclose(
            ACC.value(tp, fp, fn, tn), (1 + accuracy_advantage(tpr, fpr, prior)) / 2
        )


def test_value_scalar_and_undefined():
    assert isinstance(ACC.value(0.3, 0.1, 0.2, 0.4), float)
    assert ACC.value(0.3, 0.1, 0.2, 0.4) == pytest.approx(0.7)
    assert math.isnan(PPV.value(0.0, 0.0, 0.5, 0.5))  # never says member: 0/0
    out = PPV.value([0.0, 0.25], [0.0, 0.25], [0.5, 0.25], [0.5, 0.25])
    assert math.isnan(out[0]) and out[1] == pytest.approx(0.5)


def test_linearity_flags():
    for m in (ACC, TPR, TNR, GeneralizedMetric.am(0.2)):
        assert m.is_linear and m.has_closed_form_threshold
    for m in (PPV, F1, WA):
        assert not m.is_linear
    assert WA.has_closed_form_threshold  # w1·w3 = w2·w4
    assert not PPV.has_closed_form_threshold and not F1.has_closed_form_threshold
    assert not GeneralizedMetric.wa(2, 1, 1, 1).has_closed_form_threshold


# --- Bayes thresholds (MACE Thm 1, §3.3; Koyejo et al. for the rest) -------------------------


def test_theorem1_thresholds():
    assert ACC.bayes_threshold() == pytest.approx(0.5)
    assert TPR.bayes_threshold() == pytest.approx(0.0)
    assert TNR.bayes_threshold() == pytest.approx(1.0)
    assert WA.bayes_threshold() == pytest.approx(0.5)
    assert GeneralizedMetric.wa(3, 1, 1, 3).bayes_threshold() == pytest.approx(
        0.25
    )  # w2 / (w1 + w2)
    for p in (0.01, 0.1, 0.3, 0.5, 0.9):
        assert GeneralizedMetric.am(p).bayes_threshold() == pytest.approx(p)
    assert PPV.bayes_threshold(optimum=0.8) == pytest.approx(0.8)
    assert F1.bayes_threshold(optimum=0.6) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="optimum"):
        PPV.bayes_threshold()


@pytest.mark.parametrize("seed", range(6))
def test_threshold_rule_is_optimal_by_enumeration(seed):
    """On a discrete query (8 cells), 'member when η >= t' reaches the best ℓ of all 2^8 rules."""
    rng = np.random.default_rng(seed)
    k = 8
    pm, qm = rng.dirichlet(np.ones(k)), rng.dirichlet(np.ones(k))
    prior = float(rng.uniform(0.05, 0.95))
    eta = prior * pm / (prior * pm + (1 - prior) * qm)
    rules = np.array(list(itertools.product([0.0, 1.0], repeat=k)))  # (256, 8)
    tpr, fpr = rules @ pm, rules @ qm
    for metric in (
        ACC,
        PPV,
        TPR,
        TNR,
        F1,
        WA,
        GeneralizedMetric.wa(1, 3, 2, 1),
        GeneralizedMetric.am(prior),
    ):
        vals = metric.value(*_confusion(prior, tpr, fpr))
        best = np.nanmax(vals)
        t = (
            metric.bayes_threshold()
            if metric.has_closed_form_threshold
            else metric.bayes_threshold(optimum=best)
        )
        rule = (eta >= t).astype(float)
        got = metric.value(*_confusion(prior, rule @ pm, rule @ qm))
        assert got == pytest.approx(best, abs=1e-12), metric.name


# --- Lemma 7 and App. D: the reductions against brute force ----------------------------------


def _lemma7_literal(metric, prior, t, x, y):
    """MACE Lemma 7's objective exactly as printed (n1..n4, d1..d4, the indicator in x, y)."""
    n1, n2 = metric.a0 + metric.a01, metric.a0 + metric.a00
    n3, n4 = metric.a11 - metric.a01, metric.a10 - metric.a00
    d1, d2 = metric.b0 + metric.b01, metric.b0 + metric.b00
    d3, d4 = metric.b11 - metric.b01, metric.b10 - metric.b00
    ind = (x >= (1 - prior) * t / ((1 - t) * prior) * y).astype(float)
    xp, yq = x * prior, y * (1 - prior)
    num = n1 * xp + n2 * yq + n3 * xp * ind + n4 * yq * ind
    den = d1 * xp + d2 * yq + d3 * xp * ind + d4 * yq * ind
    return num / den


def test_lemma7_corners_and_switching_line_match_grid_search():
    rng = np.random.default_rng(1)
    grid = np.linspace(0.0, 1.0, 401)
    for _ in range(40):
        a = rng.uniform(-1, 2, 5)
        b = np.r_[rng.uniform(0.2, 1), rng.uniform(0, 2, 4)]
        metric = GeneralizedMetric(
            a0=a[0], a11=a[1], a10=a[2], a01=a[3], a00=a[4],
            b0=b[0], b11=b[1], b10=b[2], b01=b[3], b00=b[4],
        )  # fmt: skip
        prior, t = rng.uniform(0.05, 0.95), rng.uniform(0.05, 0.95)
        x_lo, x_hi = np.sort(rng.uniform(0.01, 1, 2))
        y_lo, y_hi = np.sort(rng.uniform(0.01, 1, 2))
        xs, ys = np.meshgrid(x_lo + grid * (x_hi - x_lo), y_lo + grid * (y_hi - y_lo))
        brute = _lemma7_literal(metric, prior, t, xs, ys)
        eta_lo = x_lo * prior / (x_lo * prior + y_hi * (1 - prior))
        eta_hi = x_hi * prior / (x_hi * prior + y_lo * (1 - prior))
        n, d, valid = _lemma7_candidates(metric, t, np.array([eta_lo]), np.array([eta_hi]))
        r = np.where(valid, n / d, np.nan)
        lo, hi = np.nanmin(r), np.nanmax(r)
        span = max(hi - lo, 1e-9)
        # every feasible point lies inside the candidates' range, and the range is attained
        assert brute.min() >= lo - 1e-12 and brute.max() <= hi + 1e-12
        assert brute.min() <= lo + 0.01 * span and brute.max() >= hi - 0.01 * span


def test_ratio_of_sums_matches_enumeration():
    rng = np.random.default_rng(2)
    for _ in range(40):
        r = 4
        n = rng.uniform(-1, 2, (r, 4))
        d = rng.uniform(0.1, 2, (r, 4))
        zero = rng.uniform(size=(r, 4)) < 0.2  # 0/0 options (PPV's "non-member" records)
        n[zero], d[zero] = 0.0, 0.0
        valid = rng.uniform(size=(r, 4)) < 0.7
        valid[np.arange(r), rng.integers(0, 4, r)] = True
        w = rng.dirichlet(np.ones(r))
        best = -np.inf
        for pick in itertools.product(*[np.flatnonzero(v) for v in valid]):
            num = sum(w[i] * n[i, c] for i, c in enumerate(pick))
            den = sum(w[i] * d[i, c] for i, c in enumerate(pick))
            if den > 0:
                best = max(best, num / den)
        got = _ratio_of_sums_max(n, d, valid, w)
        if np.isfinite(best):
            assert got == pytest.approx(best, abs=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_lemma7_combination_is_the_population_metric_at_exact_eta(seed):
    """With exact η (zero-width intervals) the App. D combination equals ℓ(TP, FP, FN, TN) of the
    rule, for linear metrics (population form: TPR averages to TPR, not P(Ŷ=1)) and others."""
    rng = np.random.default_rng(10 + seed)
    k = 12
    pm, qm = rng.dirichlet(np.ones(k)), rng.dirichlet(np.ones(k))
    prior = float(rng.uniform(0.1, 0.9))
    eta = prior * pm / (prior * pm + (1 - prior) * qm)
    w = prior * pm + (1 - prior) * qm  # the experiment's mixture mass of each cell
    t = float(np.median(eta))
    rule = (eta >= t).astype(float)
    for metric in (
        ACC,
        TPR,
        TNR,
        GeneralizedMetric.am(prior),
        PPV,
        F1,
        WA,
        GeneralizedMetric.wa(1, 3, 2, 1),
    ):
        truth = metric.value(*_confusion(prior, rule @ pm, rule @ qm))
        lo, hi = lemma7_bounds(_population_form(metric, prior), t, eta, eta, w)
        assert lo == pytest.approx(truth, abs=1e-9) and hi == pytest.approx(truth, abs=1e-9)


def test_box_minimum_sits_at_a_corner():
    """ℓ(TPR, FPR) is linear-fractional: its minimum over a box is at a corner (certified bound)."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        prior = rng.uniform(0.05, 0.95)
        metric = GeneralizedMetric(a11=rng.uniform(0, 2), a00=rng.uniform(0, 2),
                                   a10=rng.uniform(-1, 1), b0=0.1, b11=rng.uniform(0, 2),
                                   b10=rng.uniform(0, 2), b01=rng.uniform(0, 2),
                                   b00=rng.uniform(0, 2))  # fmt: skip
        t_lo, t_hi = np.sort(rng.uniform(0, 1, 2))
        f_lo, f_hi = np.sort(rng.uniform(0, 1, 2))
        tt, ff = np.meshgrid(np.linspace(t_lo, t_hi, 101), np.linspace(f_lo, f_hi, 101))
        grid = metric.value(*_confusion(prior, tt, ff))
        ct, cf = np.meshgrid([t_lo, t_hi], [f_lo, f_hi])
        tp, fp, fn, tn = _confusion(prior, ct.ravel(), cf.ravel())
        num = metric.a0 + metric.a11 * tp + metric.a10 * fp + metric.a01 * fn + metric.a00 * tn
        den = metric.b0 + metric.b11 * tp + metric.b10 * fp + metric.b01 * fn + metric.b00 * tn
        assert _ratio_min(num, den) == pytest.approx(grid.min(), abs=1e-12)


# --- Algorithm 2 on Gaussian pairs -------------------------------------------------------------
# Tolerance 0.02: part 3 holds 6,667 records per class, so the measured TPR / TNR of the learned
# rule have binomial sd sqrt(0.69·0.31/6667) ≈ 0.0057 and ACC / AM (their mean) sd ≈ 0.004; the
# learned rule's shortfall from the Bayes rule is second order in its threshold error (a few 1e-3
# with 100 bins). 0.02 is about 4 sd plus that shortfall.


def test_acc_matches_optimal_accuracy_advantage():
    m, h = _gaussians(20_000, seed=0)
    truth = (1 + accuracy_advantage(PHI, 1 - PHI, 0.5)) / 2  # TPR* = Φ(1/2), FPR* = 1 − Φ(1/2)
    assert truth == pytest.approx((1 + (2 * PHI - 1)) / 2)
    est = generalized_advantage(m, h, metric=ACC, prior=0.5)
    assert isinstance(est, GeneralizedEstimate)
    assert est.threshold == 0.5 and est.metric == "ACC"
    assert est.value == pytest.approx(truth, abs=0.02)
    assert est.value == pytest.approx((1 + optimal_advantage(m, h).value) / 2, abs=0.02)
    assert est.lower <= est.value <= est.upper
    assert est.lower <= truth <= est.upper
    assert est.lower == est.certified_lower
    assert est.n_members == est.n_nonmembers == 20_000 and est.n_dropped == 0


def test_am_at_low_prior_matches_analytic_balanced_accuracy():
    prior = 0.1
    m, h = _gaussians(20_000, seed=1)

    def balanced_accuracy(c):  # rule "member when x >= c"
        return (norm.sf(c, loc=1.0) + norm.cdf(c, loc=0.0)) / 2

    res = minimize_scalar(lambda c: -balanced_accuracy(c), bounds=(-5, 5), method="bounded")
    truth = -res.fun
    # Thm 1: t_AM = p, and η >= p  <=>  P >= Q  <=>  x >= 1/2: the optimum is at the LR threshold
    assert res.x == pytest.approx(0.5, abs=1e-3)
    assert truth == pytest.approx(balanced_accuracy(0.5), abs=1e-9)
    est = generalized_advantage(m, h, metric="am", prior=prior)
    assert est.metric == "AM(p=0.1)" and est.threshold == pytest.approx(prior)
    assert est.value == pytest.approx(truth, abs=0.02)
    assert est.lower <= est.value <= est.upper
    assert est.lower <= truth <= est.upper
    # the accuracy metric at p = 0.1 is dominated by the trivial guess (always non-member: 0.9)
    acc = generalized_advantage(m, h, metric="acc", prior=prior)
    assert acc.value >= 0.9 - 0.01


def test_searched_threshold_for_f1():
    prior = 0.5
    m, h = _gaussians(20_000, seed=2)
    cs = np.linspace(-3, 3, 6001)
    tpr, fpr = norm.sf(cs, loc=1.0), norm.sf(cs, loc=0.0)
    truth = np.nanmax(F1.value(*_confusion(prior, tpr, fpr)))
    est = generalized_advantage(m, h, metric=F1, prior=prior)
    # Koyejo: t = ℓ*/2 for F1
    assert est.threshold == pytest.approx(truth / 2, abs=0.05)
    assert est.value == pytest.approx(truth, abs=0.02)
    assert est.lower <= est.value <= est.upper


@pytest.mark.parametrize(("metric", "prior"), [("acc", 0.5), ("am", 0.1)])
def test_lower_bound_coverage_small_n(metric, prior):
    truth = PHI  # both ACC at p = 0.5 and AM at any p equal Φ(1/2) here
    covered = 0
    for rep in range(40):
        m, h = _gaussians(300, seed=100 + rep)
        est = generalized_advantage(m, h, metric=metric, prior=prior, seed=rep)
        assert est.lower <= est.value <= est.upper
        covered += truth >= est.lower
    assert covered >= 38  # >= 95% (delta = 0.05; the certificate is conservative)


def test_kde_method_small_n():
    m, h = _gaussians(1_500, seed=3)
    est = generalized_advantage(m, h, metric=ACC, method="kde")
    assert est.method == "kde"
    assert est.value == pytest.approx(PHI, abs=0.05)
    assert est.lower <= est.value <= est.upper
    assert est.lemma7_lower <= est.plugin <= est.lemma7_upper


# --- behaviour ---------------------------------------------------------------------------------


def test_seeded_split_and_global_rng_untouched():
    m, h = _gaussians(600, seed=4)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()  # noqa: NPY002
    a = generalized_advantage(m, h, metric=F1, seed=7)
    b = generalized_advantage(torch.as_tensor(m), torch.as_tensor(h), metric=F1, seed=7)
    assert torch.equal(torch_state, torch.get_rng_state())
    assert np.array_equal(np_state[1], np.random.get_state()[1])  # noqa: NPY002
    assert a == b
    c = generalized_advantage(m, h, metric=F1, seed=8)
    assert c.value != a.value or c.threshold != a.threshold


def test_nan_rows_dropped_and_counted():
    m, h = _gaussians(600, seed=5)
    m[:3] = np.nan
    h[0] = np.inf
    est = generalized_advantage(m, h, metric=ACC)
    assert est.n_dropped == 4 and est.n_members == 597 and est.n_nonmembers == 599


def test_errors_name_the_argument():
    m, h = _gaussians(100, seed=6)
    with pytest.raises(ValueError, match="prior"):
        generalized_advantage(m, h, metric=ACC, prior=1.5)
    with pytest.raises(ValueError, match="delta"):
        generalized_advantage(m, h, metric=ACC, delta=0.0)
    with pytest.raises(ValueError, match="metric"):
        generalized_advantage(m, h, metric="auc")
    with pytest.raises(ValueError, match="metric"):
        generalized_advantage(m, h, metric=42)
    with pytest.raises(ValueError, match="prior"):
        generalized_advantage(m, h, metric=GeneralizedMetric.am(0.3), prior=0.1)
    with pytest.raises(ValueError, match="method"):
        generalized_advantage(m, h, metric=ACC, method="exact")
    with pytest.raises(ValueError, match="bins"):
        generalized_advantage(m, h, metric=ACC, bins=0)
    with pytest.raises(ValueError, match="seed"):
        generalized_advantage(m, h, metric=ACC, seed=1.5)
    with pytest.raises(ValueError, match="member_scores"):
        generalized_advantage(m[:4], h, metric=ACC)
    with pytest.raises(ValueError, match="dimension"):
        generalized_advantage(m, np.c_[h, h], metric=ACC)
    with pytest.raises(ValueError, match="prior"):
        GeneralizedMetric.preset("am")
    with pytest.raises(ValueError, match="prior"):
        GeneralizedMetric.am(0.0)
    with pytest.raises(ValueError, match="a11"):
        GeneralizedMetric(a11=float("nan"))
    with pytest.raises(ValueError, match="w3"):
        GeneralizedMetric.wa(2, 2, -1, 1)
    with pytest.raises(ValueError, match="metric"):
        generalized_advantage(m, h, metric=GeneralizedMetric(a11=1.0, b11=-1.0, b01=-1.0))


def test_preset_names():
    assert GeneralizedMetric.preset("ACC") is ACC and GeneralizedMetric.preset("recall") is TPR
    assert GeneralizedMetric.preset("precision") is PPV and GeneralizedMetric.preset("wa") is WA
    assert GeneralizedMetric.preset("am", prior=0.25) == GeneralizedMetric.am(0.25)
