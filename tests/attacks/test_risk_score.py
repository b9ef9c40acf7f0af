"""Tests for privmon.attacks.risk_score: Song & Mittal's privacy risk score (§4.1, eq. 13-15),
computed with privmon's individual-risk estimator, and its calibration check (§4.2.1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from privmon import auc, individual_risk
from privmon.attacks.metric import METRICS, metric_values
from privmon.attacks.risk_score import Calibration, PrivacyRiskScore, calibration

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Synthetic binary task with a known answer: the true-class probability p_y is Beta(a, 1) with
# a depending on membership and on the class (class 0 leaks more than class 1). Mentr is a
# decreasing function of p_y for two classes, so the true posterior given (Mentr, y) is
# p·f1(p_y) / (p·f1(p_y) + (1 − p)·f0(p_y)) with f = Beta(a, 1) densities.
BETA_A = {0: (8.0, 2.0), 1: (3.0, 2.0)}  # class: (member a, non-member a)


def draw(rng, n, member: bool):
    y = rng.integers(0, 2, n)
    a = np.array([BETA_A[int(k)][0 if member else 1] for k in (0, 1)])[y]
    py = rng.beta(a, 1.0)
    probs = np.where(y[:, None] == 0, np.stack([py, 1 - py], 1), np.stack([1 - py, py], 1))
    return probs, y, py


def true_posterior(py, y, prior):
    a1 = np.array([BETA_A[0][0], BETA_A[1][0]])[y]
    a0 = np.array([BETA_A[0][1], BETA_A[1][1]])[y]
    f1, f0 = a1 * py ** (a1 - 1), a0 * py ** (a0 - 1)
    return prior * f1 / (prior * f1 + (1 - prior) * f0)


def synthetic(prior=0.5, n_members=5000, seed=0):
    """Fitting and held-out sets, each with members : non-members = prior : 1 − prior."""
    rng = np.random.default_rng(seed)
    n_non = round(n_members * (1 - prior) / prior)
    fit = (*draw(rng, n_members, True)[:2], *draw(rng, n_non, False)[:2])
    mp, my, mpy = draw(rng, n_members, True)
    hp, hy, hpy = draw(rng, n_non, False)
    held = (
        np.concatenate([mp, hp]),
        np.concatenate([my, hy]),
        np.r_[np.ones(n_members, bool), np.zeros(n_non, bool)],
        np.concatenate([mpy, hpy]),
    )
    return fit, held


# --- the estimator is privmon's individual risk ------------------------------------------------


def ecdf(ref, x):
    """Empirical CDF of the fitting values ``ref`` at x, clipped into the fitted range."""
    ref = np.sort(ref)
    u = np.searchsorted(ref, x, side="right") / len(ref)
    return np.clip(u, np.searchsorted(ref, ref[0], side="right") / len(ref), 1.0)


@pytest.mark.parametrize("metric", METRICS)
def test_pooled_score_is_individual_risk_posterior_on_the_quantile_scale(metric):
    (pm, ym, ph, yh), (x, y, _, _) = synthetic(n_members=600, seed=1)
    x, y = x[:500], y[:500]
    r = PrivacyRiskScore(0.4, metric, class_conditional=False, bins=7).fit(pm, ym, ph, yh)
    vm, vh, vx = (metric_values(a, b, metric) for a, b in ((pm, ym), (ph, yh), (x, y)))
    ref = np.concatenate([vm, vh])
    want = individual_risk(ecdf(ref, vx), ecdf(ref, vm), ecdf(ref, vh), prior=0.4, bins=7)
    got = r.risk(x, y)
    np.testing.assert_allclose(got.posterior, want.posterior, rtol=0, atol=1e-15)
    np.testing.assert_allclose(r.score(x, y), (1 + want.signed) / 2, rtol=0, atol=1e-15)
    np.testing.assert_allclose(got.lower, want.lower, atol=1e-15)
    np.testing.assert_allclose(got.upper, want.upper, atol=1e-15)
    assert ((got.lower <= got.value + 1e-12) & (got.value <= got.upper + 1e-12)).all()


@pytest.mark.parametrize("prior", [0.5, 0.3])
def test_interpolated_score_is_linear_between_the_cells_posteriors(prior):
    """Peer computation in numpy: equal-width cells on the quantile scale, each occupied cell's
    node at the mean quantile of its fitting records, the posterior of its counts there, and
    np.interp between the nodes; the intervals at the nodes are Lemma 5's at delta / 2."""
    (pm, ym, ph, yh), (x, y, _, _) = synthetic(n_members=600, seed=11)
    x, y = x[:700], y[:700]
    r = PrivacyRiskScore(prior, "mentr", class_conditional=False, bins=6, interpolate=True)
    got = r.fit(pm, ym, ph, yh).risk(x, y)
    vm, vh, vx = (metric_values(a, b) for a, b in ((pm, ym), (ph, yh), (x, y)))
    ref = np.concatenate([vm, vh])
    um, uh, ux = ecdf(ref, vm), ecdf(ref, vh), ecdf(ref, vx)
    u = np.concatenate([um, uh])
    lo, hi = u.min(), u.max()
    cell = np.minimum(np.floor((u - lo) / ((hi - lo) / 6)).astype(int), 5)
    c1 = np.bincount(cell[: len(um)], minlength=6) / len(um)
    c0 = np.bincount(cell[len(um) :], minlength=6) / len(uh)
    full = np.bincount(cell, minlength=6) > 0
    nodes = (np.bincount(cell, weights=u, minlength=6) / np.maximum(np.bincount(cell), 1))[full]
    post = (prior * c1 / (prior * c1 + (1 - prior) * c0))[full]
    want = np.interp(ux, nodes, post)
    np.testing.assert_allclose(got.posterior, want, rtol=0, atol=1e-12)
    assert len(np.unique(got.posterior)) > 100  # the step histogram gives at most 6
    assert ((got.lower <= got.value + 1e-12) & (got.value <= got.upper + 1e-12)).all()
    at_nodes = individual_risk(nodes, um, uh, prior=prior, delta=0.025, bins=6)
    # the f_p bounds are Lemma 5's at the nodes (at delta / 2), interpolated the same way
    for name in ("signed_lower", "signed_upper"):
        want = np.interp(ux, nodes, getattr(at_nodes, name))
        np.testing.assert_allclose(getattr(got, name), want, rtol=0, atol=1e-12)


def test_interpolation_keeps_tied_metric_values_on_their_own_cell():
    """Correctness takes two values: each is its cell's node, so nothing is blended."""
    (pm, ym, ph, yh), (x, y, _, _) = synthetic(n_members=800, seed=12)
    step = PrivacyRiskScore(metric="correctness", bins=8).fit(pm, ym, ph, yh)
    interp = PrivacyRiskScore(metric="correctness", bins=8, interpolate=True)
    interp.fit(pm, ym, ph, yh)
    np.testing.assert_allclose(interp.score(x, y), step.score(x, y), rtol=0, atol=1e-15)


def test_interpolation_resolves_400_plus_400_records_and_stays_calibrated():
    """Gaussian losses, N(1, 1) for members and N(0, 1) for non-members (seen through a
    two-class output whose true-class probability is sigmoid(loss)), so the true posterior is
    sigmoid(s − 1/2). From 400 + 400 fitting records the default cells give 4 distinct scores;
    interpolated, the score takes hundreds of values, keeps the step score's calibration on
    10,000 + 10,000 new records and is closer to the truth."""
    rng = np.random.default_rng(7)

    def outputs(n):
        s = np.r_[rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n)]
        p = 1 / (1 + np.exp(-s))
        return np.stack([p, 1 - p], 1), np.zeros(2 * n, np.int64), np.arange(2 * n) < n, s

    pf, yf, mf, _ = outputs(400)
    px, yx, mx, s = outputs(10_000)
    truth = 1 / (1 + np.exp(-(s - 0.5)))
    got = {}
    for interp in (False, True):
        r = PrivacyRiskScore(metric="confidence", interpolate=interp)
        score = r.fit(pf[mf], yf[mf], pf[~mf], yf[~mf]).score(px, yx)
        got[interp] = (
            len(np.unique(score)),
            calibration(score, mx).rmse,
            float(np.sqrt(np.mean((score - truth) ** 2))),
        )
    assert got[False][0] == 4 and got[True][0] > 200, got
    assert got[True][1] <= 0.05 and got[True][1] <= got[False][1] + 0.01, got
    assert got[True][2] < 0.8 * got[False][2], got


def test_class_conditional_score_uses_each_class_alone():
    (pm, ym, ph, yh), (x, y, _, _) = synthetic(n_members=800, seed=2)
    r = PrivacyRiskScore(bins=5).fit(pm, ym, ph, yh)
    assert r.class_fitted_.tolist() == [True, True]
    got = r.score(x, y)
    for k in (0, 1):
        one = PrivacyRiskScore(class_conditional=False, bins=5).fit(
            pm[ym == k], ym[ym == k], ph[yh == k], yh[yh == k]
        )
        np.testing.assert_array_equal(got[y == k], one.score(x[y == k], y[y == k]))


def test_fallback_to_pooled_for_small_and_unseen_classes():
    rng = np.random.default_rng(3)
    (pm, ym, ph, yh), _ = synthetic(n_members=1000, seed=3)
    # three classes: relabel a few records as class 2 (too few for its own estimate)
    pm, ph = np.pad(pm, ((0, 0), (0, 1))), np.pad(ph, ((0, 0), (0, 1)))
    ym, yh = ym.copy(), yh.copy()
    ym[:30], yh[:30] = 2, 2
    pm[:30] = rng.dirichlet(np.ones(3), 30)
    ph[:30] = rng.dirichlet(np.ones(3), 30)
    r = PrivacyRiskScore(min_class_records=50).fit(pm, ym, ph, yh)
    assert r.class_fitted_.tolist() == [True, True, False]
    pooled = PrivacyRiskScore(class_conditional=False).fit(pm, ym, ph, yh)
    q = rng.dirichlet(np.ones(3), 40)
    np.testing.assert_array_equal(r.score(q, np.full(40, 2)), pooled.score(q, np.full(40, 2)))
    # a class absent at fit time (4 classes known, class 3 never seen) also gets the pooled one
    r4 = PrivacyRiskScore().fit(np.pad(pm, ((0, 0), (0, 1))), ym, np.pad(ph, ((0, 0), (0, 1))), yh)
    assert not r4.class_fitted_[3]
    p4 = PrivacyRiskScore(class_conditional=False).fit(
        np.pad(pm, ((0, 0), (0, 1))), ym, np.pad(ph, ((0, 0), (0, 1))), yh
    )
    q4 = np.pad(q, ((0, 0), (0, 1)))
    np.testing.assert_array_equal(r4.score(q4, np.full(40, 3)), p4.score(q4, np.full(40, 3)))
    # with class_conditional=False every class is pooled
    assert not pooled.class_fitted_.any()


@pytest.mark.parametrize("method", ["histogram", "kde"])
@pytest.mark.parametrize("class_conditional", [True, False])
def test_score_does_not_depend_on_record_order(method, class_conditional):
    (pm, ym, ph, yh), (x, y, _, _) = synthetic(n_members=400, seed=4)
    x, y = x[:300], y[:300]
    kw = {"method": method, "class_conditional": class_conditional, "min_class_records": 50}
    a = PrivacyRiskScore(**kw).fit(pm, ym, ph, yh).score(x, y)
    rng = np.random.default_rng(5)
    i, j = rng.permutation(len(ym)), rng.permutation(len(yh))
    b = PrivacyRiskScore(**kw).fit(pm[i], ym[i], ph[j], yh[j]).score(x, y)
    np.testing.assert_array_equal(a, b)
    # scoring order: each record's score is its own
    k = rng.permutation(len(y))
    np.testing.assert_array_equal(
        PrivacyRiskScore(**kw).fit(pm, ym, ph, yh).score(x[k], y[k]), a[k]
    )


@pytest.mark.parametrize("interpolate", [False, True])
def test_scores_are_probabilities_nan_for_bad_rows_and_torch_inputs_agree(interpolate):
    (pm, ym, ph, yh), (x, y, _, _) = synthetic(n_members=500, seed=6)
    x = x[:200].copy()
    y = y[:200]
    x[5] = np.nan
    r = PrivacyRiskScore(interpolate=interpolate).fit(pm, ym, ph, yh)
    s = r.score(x, y)
    assert np.isnan(s[5]) and np.isfinite(np.delete(s, 5)).all()
    assert ((np.delete(s, 5) >= 0) & (np.delete(s, 5) <= 1)).all()
    risk = r.risk(x, y)
    assert risk.n_dropped == 1 and np.isnan(risk.lower[5]) and np.isnan(risk.value[5])
    t = PrivacyRiskScore(interpolate=interpolate)
    t.fit(*(torch.from_numpy(v) for v in (pm, ym, ph, yh)))
    np.testing.assert_array_equal(t.score(torch.from_numpy(x), torch.from_numpy(y)), s)
    pm2 = pm.copy()
    pm2[0] = np.inf
    assert PrivacyRiskScore().fit(pm2, ym, ph, yh).n_dropped_ == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prior": 0.0}, "prior"),
        ({"metric": "loss"}, "metric"),
        ({"class_conditional": 1}, "class_conditional"),
        ({"method": "flow"}, "method"),
        ({"bins": 0}, "bins"),
        ({"interpolate": 1}, "interpolate"),
        ({"min_class_records": 0}, "min_class_records"),
        ({"delta": 1.5}, "delta"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyRiskScore(**kwargs)


def test_unfitted_and_mismatched_inputs():
    with pytest.raises(RuntimeError, match="fit"):
        PrivacyRiskScore().score([[0.5, 0.5]], [0])
    (pm, ym, ph, yh), _ = synthetic(n_members=200)
    with pytest.raises(ValueError, match="classes"):
        PrivacyRiskScore().fit(pm, ym, np.full((3, 3), 1 / 3), [0, 1, 2])
    r = PrivacyRiskScore().fit(pm, ym, ph, yh)
    with pytest.raises(ValueError, match="classes"):
        r.score(np.full((3, 3), 1 / 3), [0, 1, 2])
    with pytest.raises(ValueError, match="softmax"):
        r.score([[3.0, -1.0]], [0])


# --- calibration ---------------------------------------------------------------------------------


def test_calibration_by_hand():
    scores = np.array([0.05, 0.12, 0.18, 0.95, 1.0, np.nan])
    member = np.array([0, 1, 0, 1, 1, 1])
    cal = calibration(scores, member, bins=10)
    assert isinstance(cal, Calibration)
    np.testing.assert_allclose(cal.centers, np.arange(0.05, 1, 0.1))
    np.testing.assert_array_equal(cal.counts, [1, 2, 0, 0, 0, 0, 0, 0, 0, 2])
    assert cal.observed[0] == 0 and cal.observed[1] == 0.5 and cal.observed[9] == 1.0
    assert np.isnan(cal.observed[2:9]).all()
    gaps = [0 - 0.05, 0.5 - 0.15, 0.5 - 0.15, 1 - 0.975, 1 - 0.975]
    assert cal.rmse == pytest.approx(math.sqrt(np.mean(np.square(gaps))), rel=1e-12)
    _, _, counts, rmse = calibration(torch.tensor(scores), torch.tensor(member > 0), bins=2)
    np.testing.assert_array_equal(counts, [3, 2])
    assert rmse == pytest.approx(math.sqrt((3 * (1 / 3 - 0.35 / 3 * 1) ** 2 + 2 * 0.025**2) / 5))


def test_calibration_of_a_calibrated_and_a_miscalibrated_score():
    rng = np.random.default_rng(0)
    s = rng.random(200_000)
    m = rng.random(200_000) < s
    assert calibration(s, m).rmse < 0.005
    assert calibration(np.clip(s + 0.1, 0, 1), m).rmse > 0.08
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        calibration([0.5, 1.2], [0, 1])
    with pytest.raises(ValueError, match="same shape"):
        calibration([0.5, 0.2], [0, 1, 1])
    with pytest.raises(ValueError, match="0 / 1"):
        calibration([0.5, 0.2], [0, 2])
    with pytest.raises(ValueError, match="bins"):
        calibration([0.5], [1], bins=0)


@pytest.mark.parametrize("prior", [0.5, 0.2])
def test_held_out_calibration_and_closeness_to_the_known_truth(prior):
    fit, (x, y, member, py) = synthetic(prior=prior, n_members=5000 if prior == 0.5 else 2000)
    truth = true_posterior(py, y, prior)
    rmse_truth = {}
    for cc in (True, False):
        s = PrivacyRiskScore(prior, class_conditional=cc).fit(*fit).score(x, y)
        cal = calibration(s, member)
        assert cal.rmse <= 0.03, (cc, cal)
        rmse_truth[cc] = float(np.sqrt(np.mean((s - truth) ** 2)))
    # the classes leak differently: only the class-conditional score recovers the truth
    assert rmse_truth[True] <= 0.05
    assert rmse_truth[False] > 1.5 * rmse_truth[True]


# --- a real overfit classifier -----------------------------------------------------------------


def train_mlp(x, y, train_idx, seed=0, epochs=200):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(x.shape[1], 128), nn.Tanh(), nn.Linear(128, int(y.max()) + 1))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(model(xt[train_idx]), yt[train_idx]).backward()
        opt.step()
    with torch.no_grad():
        return F.softmax(model(xt).double(), 1).numpy()


@pytest.mark.parametrize("label_noise", [0.0, 0.1])
def test_held_out_calibration_on_an_overfit_mlp_digits(label_noise):
    """An MLP overfit on half of load_digits (train accuracy 100 %), with clean labels (test
    accuracy ~97 %: a weak leak) or 10 % of the labels flipped, which the model memorizes on its
    members (a strong leak). The score is fitted on half of the members and half of the
    non-members and checked on the other halves."""
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    rng = np.random.default_rng(0)
    flip = rng.random(len(y)) < label_noise
    y = np.where(flip, rng.integers(0, 10, len(y)), y)
    member = np.zeros(len(y), bool)
    member[rng.permutation(len(y))[: len(y) // 2]] = True
    probs = train_mlp(x, y, np.flatnonzero(member))
    assert (probs[member].argmax(1) == y[member]).mean() == 1.0
    fit = rng.random(len(y)) < 0.5
    args = (probs[fit & member], y[fit & member], probs[fit & ~member], y[fit & ~member])
    held = member[~fit]
    for metric in ("mentr", "confidence"):
        s = PrivacyRiskScore(metric=metric).fit(*args).score(probs[~fit], y[~fit])
        cal = calibration(s, held)
        assert cal.rmse <= 0.05, (metric, cal)
        assert cal.counts.sum() == (~fit).sum()
        if label_noise:
            assert auc(s[held], s[~held]) > 0.62
            assert s[held].mean() > s[~held].mean() + 0.05


def test_kde_needs_distinct_values_and_pools_degenerate_classes():
    right = np.array([[0.9, 0.1], [0.8, 0.2]])  # both classified correctly: one value
    with pytest.raises(ValueError, match="histogram"):
        PrivacyRiskScore(metric="correctness", method="kde").fit(right, [0, 0], right, [0, 0])
    p = np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7], [0.6, 0.4]])
    y = np.array([0, 0, 1, 1])
    # class 1 non-members are all wrong (one correctness value): no KDE, so class 1 is pooled
    hp = np.array([[0.9, 0.1], [0.6, 0.4], [0.55, 0.45], [0.2, 0.8], [0.7, 0.3], [0.6, 0.4]])
    hy = np.array([0, 0, 0, 0, 1, 1])
    r = PrivacyRiskScore(metric="correctness", method="kde", min_class_records=2).fit(p, y, hp, hy)
    assert r.class_fitted_.tolist() == [True, False]
    assert ((r.score(p, y) >= 0) & (r.score(p, y) <= 1)).all()
