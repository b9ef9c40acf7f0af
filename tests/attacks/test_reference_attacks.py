"""LiRA, RMIA and difficulty calibration against the papers' formulas (privmon.attacks.reference).

Hand-computed cases, Gaussian fits against scipy.stats.norm, brute-force pairwise RMIA counts,
and property tests (affine invariance of LiRA, monotonicity, NaN handling).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as hs
from hypothesis.extra import numpy as hnp

import privmon
from privmon.attacks import calibrated_score, leave_one_out, lira, rmia

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_case(seed, k=12, n=7):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(k, n)) * rng.uniform(0.5, 2, size=n) + rng.normal(size=n)
    m = rng.random((k, n)) < 0.5
    m[:3] = True  # at least 3 in and 3 out per record
    m[3:6] = False
    t = rng.normal(size=n) * 2
    return t, s, m


# --- LiRA -----------------------------------------------------------------------------------------


def test_lira_hand_computed_online_and_offline():
    # record 0: in scores {1, 3} -> N(2, 1); out scores {-1, 1} -> N(0, 1); t = 2
    # online: log N(2; 2, 1) - log N(2; 0, 1) = 0 - (-2) = 2
    # offline: log Phi((2 - 0) / 1)
    t = [2.0]
    s = [[1.0], [3.0], [-1.0], [1.0]]
    m = [[True], [True], [False], [False]]
    assert lira(t, s, m, fixed_variance=False)[0] == pytest.approx(2.0, abs=1e-12)
    off = lira(t, s, m, online=False, fixed_variance=False)[0]
    assert off == pytest.approx(math.log(st.norm.cdf(2.0)), abs=1e-12)
    # one record: the fixed variance is that record's variance, same values
    assert lira(t, s, m, fixed_variance=True)[0] == pytest.approx(2.0, abs=1e-12)


def test_lira_online_per_record_matches_scipy_fits():
    t, s, m = random_case(0)
    got = lira(t, s, m, online=True, fixed_variance=False)
    want = []
    for j in range(len(t)):
        mu_in, sd_in = st.norm.fit(s[m[:, j], j])
        mu_out, sd_out = st.norm.fit(s[~m[:, j], j])
        want.append(st.norm.logpdf(t[j], mu_in, sd_in) - st.norm.logpdf(t[j], mu_out, sd_out))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_lira_offline_per_record_matches_scipy_logcdf():
    t, s, m = random_case(1)
    got = lira(t, s, m, online=False, fixed_variance=False)
    want = [st.norm.logcdf(t[j], *st.norm.fit(s[~m[:, j], j])) for j in range(len(t))]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_lira_fixed_variance_is_the_mean_per_record_variance_per_side():
    t, s, m = random_case(2)
    n = len(t)
    var_in = np.mean([st.norm.fit(s[m[:, j], j])[1] ** 2 for j in range(n)])
    var_out = np.mean([st.norm.fit(s[~m[:, j], j])[1] ** 2 for j in range(n)])
    mu_in = np.array([s[m[:, j], j].mean() for j in range(n)])
    mu_out = np.array([s[~m[:, j], j].mean() for j in range(n)])
    want = st.norm.logpdf(t, mu_in, math.sqrt(var_in)) - st.norm.logpdf(
        t, mu_out, math.sqrt(var_out)
    )
    np.testing.assert_allclose(lira(t, s, m, fixed_variance=True), want, rtol=1e-10)
    off = st.norm.logcdf(t, mu_out, math.sqrt(var_out))
    np.testing.assert_allclose(lira(t, s, m, online=False, fixed_variance=True), off, rtol=1e-10)


def test_lira_fixed_variance_by_default_below_64_models():
    t, s, m = random_case(3, k=12)
    np.testing.assert_array_equal(lira(t, s, m), lira(t, s, m, fixed_variance=True))
    t, s, m = random_case(4, k=64)
    np.testing.assert_array_equal(lira(t, s, m), lira(t, s, m, fixed_variance=False))
    assert not np.allclose(lira(t, s, m), lira(t, s, m, fixed_variance=True))


def test_lira_runs_on_torch_tensors_and_returns_numpy():
    t, s, m = random_case(5)
    got = lira(torch.tensor(t), torch.tensor(s, dtype=torch.float32), torch.tensor(m))
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_allclose(got, lira(t, s.astype(np.float32), m), rtol=1e-12)


def test_lira_non_finite_scores():
    t, s, m = random_case(6)
    t[0] = np.nan
    t[1] = np.inf
    s2 = s.copy()
    s2[0, 2] = np.nan  # a shadow score left out of record 2's fit
    got = lira(t, s2, m, fixed_variance=False)
    assert np.isnan(got[0]) and np.isnan(got[1])
    keep = np.arange(len(s)) != 0
    want = lira(t[2:3], s[keep, 2:3], m[keep, 2:3], fixed_variance=False)
    assert got[2] == pytest.approx(want[0], rel=1e-12)
    # fewer than two in-scores: no per-record variance -> NaN; one suffices for a fixed variance
    s3, m3 = s.copy(), m.copy()
    m3[:, 4] = False
    m3[0, 4] = True
    assert np.isnan(lira(t, s3, m3, fixed_variance=False)[4])
    assert np.isfinite(lira(t, s3, m3, fixed_variance=True)[4])
    assert np.isfinite(lira(t, s3, m3, online=False, fixed_variance=False)[4])


def test_lira_equal_shadow_scores_give_finite_extreme_scores():
    s = np.ones((6, 1))
    m = np.array([[True], [True], [True], [False], [False], [False]])
    s[m[:, 0], 0] = 5.0
    got = lira([5.0], s, m, fixed_variance=False)
    assert np.isfinite(got[0]) and got[0] > 1e50


def test_lira_scores_a_record_whose_scores_all_equal_the_target_as_no_evidence():
    """φ capped at one value in every model (a confidence that rounds to 1): the target equals
    both fits' means, so eq. 4 gives 0 and the offline test log Φ(0). The sum over 7 copies of
    the cap divided by 7 misses the value by a rounding error, which the floored variance
    turned into a score of −35.6."""
    cap = math.log((1 - 1e-6) / 1e-6)  # ML Privacy Meter's cap; 7 copies sum inexactly
    s = np.full((16, 2), cap)
    s[:, 1] = np.random.default_rng(0).normal(size=16)
    m = np.zeros((16, 2), bool)
    m[:7] = True  # 7 models in, 9 out
    online = lira([cap, 0.3], s, m, online=True, fixed_variance=False)
    offline = lira([cap, 0.3], s, m, online=False, fixed_variance=False)
    assert online[0] == 0.0 and offline[0] == pytest.approx(math.log(0.5), abs=1e-15)
    assert np.isfinite(online[1]) and np.isfinite(offline[1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_scores": [[1.0]]}, "target_scores must be"),
        ({"shadow_scores": [1.0, 2.0]}, "shadow_scores must be"),
        ({"shadow_scores": np.zeros((4, 3))}, r"shadow_scores must have shape \(k, n\)"),
        ({"shadow_in": np.zeros((4, 3), bool)}, "shadow_in must be a boolean array of shape"),
        ({"shadow_in": np.full((4, 2), 2)}, "True / False"),
        ({"shadow_in": None}, "shadow_in is required"),
        ({"online": "yes"}, "online must be True or False"),
        ({"fixed_variance": 1}, "fixed_variance must be True or False"),
        ({"target_scores": []}, "target_scores is empty"),
    ],
)
def test_lira_errors_name_the_argument(kwargs, match):
    args = {
        "target_scores": [1.0, 2.0],
        "shadow_scores": np.zeros((4, 2)),
        "shadow_in": np.eye(4, 2, dtype=bool),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        lira(**args)


@settings(max_examples=40, deadline=None)
@given(
    seed=hs.integers(0, 2**32 - 1),
    alpha=hs.floats(0.01, 100),
    beta=hs.floats(-100, 100),
    online=hs.booleans(),
    fixed=hs.booleans(),
)
def test_lira_is_invariant_under_affine_maps_of_the_statistic(seed, alpha, beta, online, fixed):
    """The Gaussian log-likelihood ratio and the standardized offline test do not change when
    every score (target and shadow) goes through x -> alpha * x + beta, alpha > 0."""
    t, s, m = random_case(seed)
    a = lira(t, s, m, online=online, fixed_variance=fixed)
    b = lira(alpha * t + beta, alpha * s + beta, m, online=online, fixed_variance=fixed)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    s=hnp.arrays(np.float64, (8, 1), elements=hs.floats(-50, 50)),
    t=hnp.arrays(np.float64, 2, elements=hs.floats(-100, 100), unique=True),
)
def test_lira_offline_is_increasing_in_the_target_score(s, t):
    m = np.zeros((8, 1), dtype=bool)
    assume(np.ptp(s) > 1e-3)
    lo, hi = np.sort(t)
    a = lira([lo], s, m, online=False, fixed_variance=False)[0]
    b = lira([hi], s, m, online=False, fixed_variance=False)[0]
    assert b >= a


# --- RMIA -----------------------------------------------------------------------------------------


def brute_rmia(p_t, pr_x, pop, gamma):
    r = p_t / pr_x
    return np.array([np.mean(r[i] / r[pop] >= gamma) for i in range(len(r))])


def test_rmia_hand_computed_offline():
    # Pr_out(x) = 0.5, a = 0.3: Pr(x) = 0.5 * (1.3 * 0.5 + 0.7) = 0.675
    # records: target probs 0.9, 0.675, 0.3 over the same Pr -> r = 1.333, 1, 0.444
    p_t = [0.9, 0.675, 0.3]
    shadow = np.full((2, 3), 0.5)
    got = rmia(p_t, shadow, None, population=[1, 2], online=False, a=0.3)
    # r(x) / r(z) >= 1 against z in {1, 0.444}: 2/2, 2/2 (itself), 1/2
    np.testing.assert_allclose(got, [1.0, 1.0, 0.5])
    got = rmia(p_t, shadow, None, population=[1, 2], online=False, a=0.3, gamma=1.5)
    # r(x)/r(z): record 0: 1.333, 3.0 -> 1/2; record 1: 1, 2.25 -> 1/2; record 2: 0.444, 1 -> 0
    np.testing.assert_allclose(got, [0.5, 0.5, 0.0])


def test_rmia_online_uses_the_mean_of_all_reference_models():
    rng = np.random.default_rng(0)
    p_t = rng.uniform(0.05, 0.95, 40)
    shadow = rng.uniform(0.05, 0.95, (6, 40))
    mask = rng.random((6, 40)) < 0.5
    pop = np.arange(20, 40)
    got = rmia(p_t, shadow, mask, population=pop, online=True, gamma=1.3)
    np.testing.assert_array_equal(got, brute_rmia(p_t, shadow.mean(0), pop, 1.3))
    # the mask plays no part online
    np.testing.assert_array_equal(got, rmia(p_t, shadow, None, population=pop, gamma=1.3))


def test_rmia_offline_uses_only_the_out_models():
    rng = np.random.default_rng(1)
    p_t = rng.uniform(0.05, 0.95, 30)
    shadow = rng.uniform(0.05, 0.95, (8, 30))
    mask = rng.random((8, 30)) < 0.5
    mask[0] = False
    pr_out = np.array([shadow[~mask[:, j], j].mean() for j in range(30)])
    pr = 0.5 * ((1 + 0.6) * pr_out + (1 - 0.6))
    pop = np.zeros(30, dtype=bool)
    pop[::3] = True
    got = rmia(p_t, shadow, mask, population=pop, online=False, a=0.6)
    np.testing.assert_array_equal(got, brute_rmia(p_t, pr, pop, 1.0))


@settings(max_examples=50, deadline=None)
@given(
    p=hnp.arrays(np.float64, 12, elements=hs.floats(1e-6, 1.0)),
    shadow=hnp.arrays(np.float64, (3, 12), elements=hs.floats(1e-6, 1.0)),
    gamma=hs.floats(0.5, 2.0),
    online=hs.booleans(),
    a=hs.floats(0.0, 1.0),
)
def test_rmia_equals_the_pairwise_count(p, shadow, gamma, online, a):
    pr = shadow.mean(0) if online else 0.5 * ((1 + a) * shadow.mean(0) + (1 - a))
    r = p / pr
    pop = np.arange(6, 12)
    lr = r[:, None] / r[None, pop]
    assume(np.all(np.abs(lr - gamma) > 1e-9 * gamma))  # the binary search divides once
    got = rmia(p, shadow, None, population=pop, online=online, a=a, gamma=gamma)
    np.testing.assert_array_equal(got, (lr >= gamma).mean(axis=1))
    assert np.all((got >= 0) & (got <= 1))


def test_rmia_nan_and_errors():
    p_t = np.array([0.5, np.nan, 0.7, 0.2])
    shadow = np.full((2, 4), 0.5)
    shadow[:, 3] = np.nan  # no reference probability: Pr(x) cannot be formed
    got = rmia(p_t, shadow, population=[0, 2])
    assert np.isnan(got[1]) and np.isnan(got[3]) and np.isfinite(got[[0, 2]]).all()
    with pytest.raises(ValueError, match="target_probs must be probabilities"):
        rmia([1.5, 0.2], np.full((2, 2), 0.5), population=[0])
    with pytest.raises(ValueError, match=r"a must be in the closed interval \[0, 1\]"):
        rmia([0.5], [[0.5]], population=[0], online=False, a=1.2)
    with pytest.raises(ValueError, match="gamma must be finite and > 0"):
        rmia([0.5], [[0.5]], population=[0], gamma=0)
    with pytest.raises(ValueError, match=r"population indices must lie in \[0, 1\]"):
        rmia([0.5, 0.5], np.full((2, 2), 0.5), population=[2])
    with pytest.raises(ValueError, match="population must name at least one record"):
        rmia([0.5, 0.5], np.full((2, 2), 0.5), population=np.zeros(2, dtype=bool))
    with pytest.raises(ValueError, match="no record with a finite probability ratio"):
        rmia([0.5, np.nan], np.full((2, 2), 0.5), population=[1])


# --- difficulty calibration -----------------------------------------------------------------------


def test_calibrated_score_hand_computed():
    # -loss scores; record 0's out models: -1.0 and -3.0 (mean -2); record 1 has no in model
    t = [-0.5, -1.0]
    s = [[-1.0, -2.0], [-3.0, -4.0], [-0.1, -6.0]]
    m = [[False, False], [False, False], [True, False]]
    np.testing.assert_allclose(calibrated_score(t, s, m), [-0.5 + 2.0, -1.0 + 4.0])
    # without a mask every model is a reference trained without the record
    np.testing.assert_allclose(calibrated_score(t, s), [-0.5 + 4.1 / 3, -1.0 + 4.0])
    t[0] = math.inf
    m = [[True, False], [True, False], [True, False]]
    got = calibrated_score(t, s, m)
    assert np.isnan(got[0]) and got[1] == pytest.approx(3.0)


# --- leave-one-model-out --------------------------------------------------------------------------


@pytest.mark.parametrize("attack", ["lira", "lira_offline", "rmia", "rmia_offline", "calibrated"])
def test_leave_one_out_is_the_attack_with_each_model_as_the_target(attack):
    rng = np.random.default_rng(7)
    k, n = 9, 30
    phi = rng.normal(size=(k, n)) * 2
    masks = rng.random((k, n)) < 0.5
    got = leave_one_out(phi, masks, attack=attack, a=0.4, gamma=1.2)
    p, neg_loss = 1 / (1 + np.exp(-phi)), -np.log1p(np.exp(-phi))
    for i in range(k):
        o = np.arange(k) != i
        if attack.startswith("lira"):
            want = lira(phi[i], phi[o], masks[o], online=attack == "lira")
        elif attack.startswith("rmia"):
            want = rmia(
                p[i],
                p[o],
                masks[o],
                population=~masks[i],
                online=attack == "rmia",
                a=0.4,
                gamma=1.2,
            )
        else:
            want = calibrated_score(neg_loss[i], neg_loss[o], masks[o])
        np.testing.assert_allclose(got[i], want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(leave_one_out(phi, masks, attack="loss"), neg_loss, rtol=1e-12)


def test_leave_one_out_errors():
    with pytest.raises(ValueError, match="attack must be one of"):
        leave_one_out(np.zeros((3, 2)), np.zeros((3, 2), bool), attack="shokri")
    with pytest.raises(ValueError, match="at least 3 models for 'lira', got 2"):
        leave_one_out(np.zeros((2, 2)), np.array([[True, False], [False, True]]), attack="lira")


@pytest.mark.parametrize("attack", ["rmia", "rmia_offline", "lira", "calibrated"])
def test_leave_one_out_a_model_that_scores_nothing_gets_nan_and_spares_the_others(attack):
    rng = np.random.default_rng(0)
    masks = rng.random((6, 40)) < 0.5
    phi = rng.normal(size=(6, 40)) + masks
    phi[2] = np.nan  # a diverged model
    got = leave_one_out(phi, masks, attack=attack)
    assert np.isnan(got[2]).all()
    assert np.isfinite(np.delete(got, 2, axis=0)).mean() > 0.9


def test_exports():
    assert privmon.attacks.lira is lira
    assert privmon.attacks.rmia is rmia
    assert privmon.attacks.calibrated_score is calibrated_score


def test_lira_pools_the_fixed_variance_over_records_with_two_scores_a_side():
    """Models 0-1 trained on every record, 2-3 on none; record 2 has one in-score (the other
    is NaN), so its in-side variance is not pooled. Population variances: in side, records 0-1
    ({1, 3} and {0, 4}): (1 + 4) / 2 = 2.5; out side, records 0-2 ({0, 2}, {1, 1}, {2, 4}):
    (1 + 0 + 1) / 3 = 2/3. Pooling record 2's single in-score (variance 0) would give 5/3."""
    t = np.array([2.0, 1.0, 4.0])
    s = np.array([[1, 0, 5], [3, 4, np.nan], [0, 1, 2], [2, 1, 4]], dtype=np.float64)
    m = np.zeros((4, 3), dtype=bool)
    m[:2] = True
    mu_in, mu_out = np.array([2.0, 2.0, 5.0]), np.array([1.0, 1.0, 3.0])
    want = st.norm.logpdf(t, mu_in, math.sqrt(2.5)) - st.norm.logpdf(t, mu_out, math.sqrt(2 / 3))
    got = lira(t, s, m, online=True, fixed_variance=True)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(got, [0.089122, -0.860878, -0.110878], atol=5e-7)


def test_rmia_offline_marginal_is_the_papers_linear_approximation():
    """Offline RMIA's Pr(x) = ½((1 + a)·Pr_out(x) + (1 − a)) (Zarifzadeh et al., §4): the
    out models' mean probability, moved towards 1 by the in models it lacks. (Its scale
    cancels in the scores, so only the marginal itself can show it.)"""
    from privmon.attacks.reference import rmia_marginal

    probs = torch.tensor([[0.2, 0.9], [0.4, 0.5], [0.6, 0.1]], dtype=torch.float64)
    shadow_in = torch.tensor([[True, False], [False, False], [False, True]])
    pr_out = np.array([(0.4 + 0.6) / 2, (0.9 + 0.5) / 2])
    for a in (0.0, 0.3, 1.0):
        got = rmia_marginal(probs, shadow_in, online=False, a=a).numpy()
        np.testing.assert_allclose(got, 0.5 * ((1 + a) * pr_out + (1 - a)), rtol=1e-12)
    online = rmia_marginal(probs, shadow_in, online=True, a=0.3).numpy()
    np.testing.assert_allclose(online, [0.4, 0.5], rtol=1e-12)


def test_rmia_population_mask_of_the_wrong_shape_is_refused_by_name():
    _, s, m = random_case(8)
    p = np.clip(np.abs(s) / 5, 0.01, 0.99)
    with pytest.raises(ValueError, match=r"population as a bool mask must have shape \(7,\)"):
        rmia(np.full(7, 0.5), p, m, population=np.ones(5, dtype=bool))
