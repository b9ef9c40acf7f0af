"""Tests for privmon.estimators.advantage: the optimal membership advantage (MACE §5).

Checked against analytic truth (Gaussian shift: members N(mu, 1), non-members N(0, 1)), against
direct numpy / scipy computations of the paper's plug-ins W_N and U_N, and by seeded repetition
for the coverage of the certified lower bound.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.integrate import quad, trapezoid
from scipy.stats import gaussian_kde, norm

import privmon
from privmon.estimators.advantage import optimal_advantage
from privmon.estimators.estimates import AdvantageEstimate, accuracy_advantage, mcdiarmid_halfwidth

METHODS = ("histogram", "kde")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@cache
def truth(mu: float, prior: float) -> float:
    """Optimal advantage ∫|p·φ(x−μ) − (1−p)·φ(x)| dx of N(μ,1) members vs N(0,1) non-members."""

    def integrand(x: float) -> float:
        return abs(prior * norm.pdf(x - mu) - (1 - prior) * norm.pdf(x))

    # the integrand has a kink where the two weighted densities cross
    lam = math.log(prior / (1 - prior))
    kinks = [mu / 2 - lam / mu] if mu != 0 else []
    kinks = [k for k in kinks if -15 < k < 15 + mu]
    value, err = quad(integrand, -15, 15 + mu, points=kinks or None, limit=400)
    assert err < 1e-8
    return value


def gaussian_pair(rng: np.random.Generator, mu: float, n1: int, n2: int, d: int = 1):
    m = rng.normal(0.0, 1.0, size=(n1, d))
    m[:, 0] += mu
    h = rng.normal(0.0, 1.0, size=(n2, d))
    if d == 1:
        return m[:, 0], h[:, 0]
    return m, h


# ----------------------------------------------------------------------------- analytic anchors


@pytest.mark.parametrize("mu", [0.0, 0.25, 1.0, 2.0])
def test_truth_helper_matches_closed_form_at_half(mu):
    # at p = 1/2 the optimal advantage is the total variation distance 2·Φ(μ/2) − 1
    assert truth(mu, 0.5) == pytest.approx(2 * norm.cdf(mu / 2) - 1, abs=1e-9)


def test_truth_helper_at_prior_floor():
    # identical distributions: the advantage is the trivial floor |2p − 1|
    assert truth(0.0, 0.2) == pytest.approx(0.6, abs=1e-9)
    assert truth(0.0, 0.9) == pytest.approx(0.8, abs=1e-9)


# ----------------------------------------------------------------------------- bias of .value


@pytest.mark.parametrize("method", METHODS)
def test_no_leak_small_sample_value_unbiased_plugin_biased(method):
    """μ = 0, 1k + 1k: the debiased value stays near 0, the plug-in over-reports."""
    vals, plugs = [], []
    for seed in range(6):
        m, h = gaussian_pair(np.random.default_rng(seed), 0.0, 1000, 1000)
        est = optimal_advantage(m, h, method=method)
        vals.append(est.value)
        plugs.append(est.plugin)
    vals, plugs = np.array(vals), np.array(plugs)
    assert np.mean(np.abs(vals - 0.0)) <= 0.03
    assert np.mean(plugs) > np.mean(vals) + 0.01
    if method == "histogram":
        # W_N with 100 bins on two identical 1k samples: ≈ Σ_j sqrt(P_j/(π N)) ≈ 0.14
        assert 0.11 <= np.mean(plugs) <= 0.18
        assert np.mean(plugs) - np.mean(vals) >= 0.1


BIAS_CASES = [
    (mu, prior, method) for mu in (0.25, 1.0, 2.0) for prior in (0.5, 0.2) for method in METHODS
]


@pytest.mark.parametrize(("mu", "prior", "method"), BIAS_CASES)
def test_value_bias_large_sample(mu, prior, method):
    """10k + 10k: mean |value − truth| ≤ 0.015 over seeded repetitions."""
    t = truth(mu, prior)
    errs = []
    for seed in range(3):
        m, h = gaussian_pair(np.random.default_rng(100 + seed), mu, 10_000, 10_000)
        est = optimal_advantage(m, h, method=method, prior=prior)
        errs.append(est.value - t)
        assert est.floor == pytest.approx(abs(2 * prior - 1))
        assert est.value >= est.floor
    assert np.mean(np.abs(errs)) <= 0.015


@pytest.mark.parametrize("method", METHODS)
def test_value_at_floor_when_no_leak_and_skewed_prior(method):
    m, h = gaussian_pair(np.random.default_rng(7), 0.0, 5000, 5000)
    est = optimal_advantage(m, h, method=method, prior=0.2)
    assert est.value == pytest.approx(0.6, abs=0.01)
    assert est.lower == pytest.approx(0.6, abs=1e-12)  # floored, and certified at the floor


# ----------------------------------------------------------------------------- lower: coverage

COVERAGE_CASES = [
    # (mu, prior, method, delta)
    (0.5, 0.5, "histogram", 0.05),
    (1.0, 0.5, "histogram", 0.3),
    (2.0, 0.3, "histogram", 0.3),
    (1.0, 0.7, "histogram", 0.3),  # p > 1/2: the certificate's ties go to "member"
    (1.0, 0.5, "kde", 0.3),
]


@pytest.mark.parametrize(("mu", "prior", "method", "delta"), COVERAGE_CASES)
def test_lower_bound_coverage(mu, prior, method, delta):
    runs, n = 200, 200
    t = truth(mu, prior)
    floor = abs(2 * prior - 1)
    misses = below_value = 0
    lowers = []
    for seed in range(runs):
        m, h = gaussian_pair(np.random.default_rng(10_000 + seed), mu, n, n)
        est = optimal_advantage(m, h, method=method, prior=prior, delta=delta)
        misses += est.lower > t
        below_value += est.lower <= est.value
        lowers.append(est.lower)
        assert est.lower >= floor  # always, by construction
        assert est.lower <= 1.0
    slack = 3 * math.sqrt(delta * (1 - delta) / runs)
    assert misses / runs <= delta + slack
    # typically lower <= value: at δ = 0.3 an exact bound sits only about half a standard
    # deviation of the estimate below it (179 of 200 at μ = 1 with the KDE)
    assert below_value / runs >= 0.85
    # and the bound is informative, not vacuous
    assert np.mean(lowers) >= t - (0.25 if delta < 0.1 else 0.15)


# ----------------------------------------------------------------------------- upper/halfwidth


@pytest.mark.parametrize(
    ("prior", "n1", "n2", "delta"),
    [(0.5, 1000, 1000, 0.05), (0.3, 300, 700, 0.01), (0.2, 50, 400, 0.2), (0.8, 37, 11, 0.5)],
)
def test_halfwidth_formula(prior, n1, n2, delta):
    expected = math.sqrt(2 * (prior**2 / n1 + (1 - prior) ** 2 / n2) * math.log(2 / delta))
    assert mcdiarmid_halfwidth(prior, n1, n2, delta) == pytest.approx(expected, rel=1e-14)
    rng = np.random.default_rng(n1 + n2)
    m, h = gaussian_pair(rng, 0.7, n1, n2)
    est = optimal_advantage(m, h, prior=prior, delta=delta)
    assert est.halfwidth == pytest.approx(expected, rel=1e-14)
    assert est.upper == min(est.plugin + est.halfwidth, 1.0)
    assert (est.n_members, est.n_nonmembers) == (n1, n2)


def test_halfwidth_balanced_sampling_identity():
    # N1 = p·N, N2 = (1 − p)·N: half-width sqrt(2/N·log(2/δ))
    for prior, n in [(0.3, 1000), (0.5, 400), (0.1, 2000)]:
        n1 = round(prior * n)
        hw = mcdiarmid_halfwidth(prior, n1, n - n1, 0.05)
        assert hw == pytest.approx(math.sqrt(2 / n * math.log(2 / 0.05)), rel=1e-12)


def test_upper_capped_at_one():
    m, h = gaussian_pair(np.random.default_rng(3), 8.0, 50, 50)
    est = optimal_advantage(m, h)
    assert est.plugin == pytest.approx(1.0)
    assert est.plugin + est.halfwidth > 1
    assert est.upper == 1.0
    assert est.value >= 0.95  # truth 2·Φ(4) − 1 = 0.99994


def test_accuracy_advantage_formula():
    assert accuracy_advantage(1.0, 0.0, 0.5) == 1.0
    assert accuracy_advantage(0.5, 0.5, 0.5) == 0.0
    # always guess "non-member" at p = 0.2: TPR = FPR = 0 -> floor 0.6
    assert accuracy_advantage(0.0, 0.0, 0.2) == pytest.approx(0.6)
    assert accuracy_advantage(0.7, 0.2, 0.3) == pytest.approx(2 * 0.3 * 0.7 - 2 * 0.7 * 0.2 + 0.4)


# ----------------------------------------------------------------------------- plug-ins vs numpy


@pytest.mark.parametrize("prior", [0.5, 0.3, 0.85])
@pytest.mark.parametrize("bins", [None, 37])
def test_plugin_w_n_equals_numpy_histogram(prior, bins):
    rng = np.random.default_rng(11)
    m, h = rng.normal(0.6, 1.2, 700), rng.standard_t(4, 450)
    nb = 100 if bins is None else bins
    pooled = np.concatenate([m, h])
    # the data range, cut to [Q1 - 5 IQR, Q3 + 5 IQR]; the t(4) tail records beyond the cut
    # are counted in the edge bins
    q1, q3 = np.quantile(pooled, [0.25, 0.75])
    lo, hi = max(pooled.min(), q1 - 5 * (q3 - q1)), min(pooled.max(), q3 + 5 * (q3 - q1))
    assert hi < pooled.max()  # the cut binds here
    edges = np.linspace(lo, hi, nb + 1)
    a, _ = np.histogram(np.clip(m, lo, hi), edges)  # last bin closed on the right, as in privmon
    b, _ = np.histogram(np.clip(h, lo, hi), edges)
    assert a.sum() == 700 and b.sum() == 450
    w_n = np.abs(prior * a / 700 - (1 - prior) * b / 450).sum()
    est = optimal_advantage(m, h, prior=prior, bins=bins)
    assert est.plugin == pytest.approx(w_n, abs=1e-12)


def test_plugin_w_n_2d_equals_numpy_histogramdd():
    rng = np.random.default_rng(12)
    m = rng.normal(0, 1, (600, 2)) + np.array([0.8, -0.3])
    h = rng.normal(0, 1, (500, 2)) @ np.array([[1.0, 0.4], [0.0, 0.8]])
    pooled = np.concatenate([m, h])
    rng_ = [(pooled[:, k].min(), pooled[:, k].max()) for k in range(2)]
    a, _ = np.histogramdd(m, bins=100, range=rng_)
    b, _ = np.histogramdd(h, bins=100, range=rng_)
    w_n = np.abs(0.4 * a / 600 - 0.6 * b / 500).sum()
    assert optimal_advantage(m, h, prior=0.4).plugin == pytest.approx(w_n, abs=1e-12)


def test_plugin_w_n_3d_equals_numpy_histogramdd():
    rng = np.random.default_rng(13)
    m = rng.normal(0, 1, (400, 3)) + np.array([1.0, 0, 0])
    h = rng.normal(0, 1, (300, 3))
    pooled = np.concatenate([m, h])
    rng_ = [(pooled[:, k].min(), pooled[:, k].max()) for k in range(3)]
    a, _ = np.histogramdd(m, bins=10, range=rng_)
    b, _ = np.histogramdd(h, bins=10, range=rng_)
    w_n = np.abs(0.5 * a / 400 - 0.5 * b / 300).sum()
    assert optimal_advantage(m, h, bins=10).plugin == pytest.approx(w_n, abs=1e-12)


@pytest.mark.parametrize("prior", [0.5, 0.3])
@pytest.mark.parametrize("bandwidth", ["scott", "silverman", 0.5])
def test_plugin_u_n_1d_equals_scipy_kde_quadrature(prior, bandwidth):
    rng = np.random.default_rng(21)
    m, h = rng.normal(0.5, 1.0, 300), rng.normal(0.0, 1.4, 400)
    km = gaussian_kde(m, bw_method=bandwidth)
    kh = gaussian_kde(h, bw_method=bandwidth)
    x = np.linspace(-12, 12, 24_001)
    u_n = trapezoid(np.abs(prior * km(x) - (1 - prior) * kh(x)), x)
    est = optimal_advantage(m, h, prior=prior, method="kde", bandwidth=bandwidth)
    assert est.plugin == pytest.approx(u_n, abs=2e-3)


def test_plugin_u_n_2d_equals_scipy_kde_quadrature():
    rng = np.random.default_rng(22)
    m = rng.normal(0, 1, (250, 2)) + np.array([1.0, 0.0])
    h = rng.normal(0, 1, (250, 2)) @ np.array([[1.0, 0.3], [0.0, 1.0]])
    km, kh = gaussian_kde(m.T), gaussian_kde(h.T)
    g = np.linspace(-7, 8, 241)
    xx, yy = np.meshgrid(g, g, indexing="ij")
    pts = np.stack([xx.ravel(), yy.ravel()])
    diff = np.abs(0.5 * km(pts) - 0.5 * kh(pts)).reshape(xx.shape)
    u_n = trapezoid(trapezoid(diff, g, axis=1), g)
    est = optimal_advantage(m, h, method="kde")
    assert est.plugin == pytest.approx(u_n, abs=5e-3)


def test_plugin_u_n_when_one_class_is_narrower_than_a_grid_cell():
    """A class whose bandwidth is below one 1-D grid cell: U_N must still match scipy."""
    rng = np.random.default_rng(25)
    m, h = rng.normal(0.5, 0.002, 300), rng.normal(0.0, 1.0, 300)
    km, kh = gaussian_kde(m), gaussian_kde(h)
    x = np.unique(np.r_[np.linspace(-8, 8, 20_001), np.linspace(0.45, 0.55, 20_001)])
    u_n = trapezoid(np.abs(0.5 * km(x) - 0.5 * kh(x)), x)
    est = optimal_advantage(m, h, method="kde")
    assert est.plugin == pytest.approx(u_n, abs=5e-3)
    # The rule reads ranks: the members' 300 ranks form one contiguous block, whose sharp edges
    # the KDE blurs by a bandwidth (~0.045 of the ranks), so a few non-members next to it count
    # as members: the value sits ~0.025 under the truth (≈ 0.995), conservative as it should.
    assert est.value >= 0.96 and est.lower >= 0.85


def test_plugin_u_n_3d_importance_sampling_matches_monte_carlo():
    """d = 3: U_N by importance sampling vs an independent scipy Monte Carlo of the integral."""
    rng = np.random.default_rng(23)
    m, h = gaussian_pair(rng, 1.0, 400, 400, d=3)
    km, kh = gaussian_kde(m.T), gaussian_kde(h.T)
    xs = np.concatenate([km.resample(20_000, seed=1), kh.resample(20_000, seed=2)], axis=1)
    pm, ph = km(xs), kh(xs)
    ref = np.mean(np.abs(0.5 * pm - 0.5 * ph) / (0.5 * pm + 0.5 * ph))
    est = optimal_advantage(m, h, method="kde", seed=5)
    assert est.plugin == pytest.approx(ref, abs=0.02)
    # the seed only moves the Monte Carlo error
    other = optimal_advantage(m, h, method="kde", seed=6)
    assert other.plugin == pytest.approx(est.plugin, abs=0.02)
    assert other.plugin != est.plugin
    assert optimal_advantage(m, h, method="kde", seed=5).plugin == est.plugin


def test_plugin_equals_in_sample_mean_of_individual_risk():
    """W_N = Σ_j (p a_j + (1−p) b_j)·|f_j| = p·mean|f̂(members)| + (1−p)·mean|f̂(non-members)|."""
    rng = np.random.default_rng(24)
    m, h = rng.normal(0.7, 1.0, 400), rng.normal(0.0, 1.3, 300)
    for prior in (0.5, 0.3):
        est = optimal_advantage(m, h, prior=prior)
        rm = privmon.individual_risk(m, m, h, prior=prior)
        rh = privmon.individual_risk(h, m, h, prior=prior)
        mix = prior * rm.value.mean() + (1 - prior) * rh.value.mean()
        assert est.plugin == pytest.approx(mix, abs=1e-12)


# ----------------------------------------------------------------------------- d = 2, 3


@pytest.mark.parametrize(
    ("d", "method", "n", "tol"),
    [
        (2, "histogram", 5000, 0.03),
        (2, "kde", 5000, 0.03),
        (3, "kde", 1500, 0.06),
        (3, "histogram", 1500, 0.06),
    ],
)
def test_multidimensional_shift_near_truth(d, method, n, tol):
    t = truth(1.0, 0.5)  # a shift along one axis: same as 1-D
    m, h = gaussian_pair(np.random.default_rng(31), 1.0, n, n, d=d)
    est = optimal_advantage(m, h, method=method)
    assert abs(est.value - t) <= tol
    assert est.lower <= t
    assert est.lower >= t - 0.15
    if method == "kde":
        assert abs(est.plugin - t) <= tol
    else:  # 100 x 100 bins: the plug-in is strongly biased upward, the value is not
        assert est.plugin > t + 0.1
    assert est.upper == min(est.plugin + est.halfwidth, 1.0)


def test_3d_histogram_value_conservative_and_plugin_biased():
    t = truth(1.0, 0.5)
    m, h = gaussian_pair(np.random.default_rng(32), 1.0, 3000, 3000, d=3)
    est = optimal_advantage(m, h)
    assert t - 0.12 <= est.value <= t + 0.03
    assert est.lower <= t
    assert est.plugin > 0.9  # 10^6 cells for 6000 records: nearly every record alone


# regression: the d>=3 histogram rule once over-smoothed (0.32 vs 0.383 here)
def test_3d_histogram_value_close_to_truth():
    t = truth(1.0, 0.5)
    m, h = gaussian_pair(np.random.default_rng(1), 1.0, 5000, 5000, d=3)
    assert abs(optimal_advantage(m, h).value - t) <= 0.03


# regression: the d>=3 histogram rule once gave 0 here (one Scott bin per axis)
def test_3d_histogram_value_separated_point_masses():
    m = np.tile([1.0, 0.5, -1.0], (10, 1))
    h = np.zeros((10, 3))
    assert optimal_advantage(m[:, :2], h[:, :2]).value == 1.0  # d = 2 reference
    assert optimal_advantage(m, h).value == pytest.approx(1.0)


def test_high_dim_kde_does_not_touch_global_rng():
    m, h = gaussian_pair(np.random.default_rng(33), 0.5, 200, 200, d=3)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    np_state = np.random.get_state()[1].copy()  # noqa: NPY002 (the legacy global RNG)
    optimal_advantage(m, h, method="kde", n_samples=512)
    assert torch.equal(torch.get_rng_state(), state)
    assert np.array_equal(np.random.get_state()[1], np_state)  # noqa: NPY002


# ----------------------------------------------------------------------------- properties

data_params = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(8, 80),  # n1
    st.integers(8, 80),  # n2
    st.floats(-3.0, 3.0),  # shift
    st.sampled_from(["normal", "integers", "exponential"]),
)


def draw_data(params):
    seed, n1, n2, mu, kind = params
    rng = np.random.default_rng(seed)
    if kind == "integers":  # ties and many points exactly on bin edges
        return (
            rng.integers(0, 4, n1).astype(float) + round(mu),
            rng.integers(0, 4, n2).astype(float),
        )
    if kind == "exponential":
        return rng.exponential(1.0, n1) + mu, rng.exponential(2.0, n2)
    return rng.normal(mu, 1.0, n1), rng.normal(0.0, 1.0, n2)


@settings(max_examples=30, deadline=None)
@given(params=data_params, prior=st.floats(0.02, 0.98), method=st.sampled_from(METHODS))
def test_estimates_within_floor_and_one(params, prior, method):
    m, h = draw_data(params)
    est = optimal_advantage(m, h, prior=prior, method=method)
    floor = abs(2 * prior - 1)
    assert est.floor == floor
    # W_N >= |Σ_j (p·a_j − (1−p)·b_j)| = |2p − 1| up to rounding (it can sit 1 ulp below);
    # U_N: quadrature of masses that sum to 1 up to rounding
    slack = 1e-12 if method == "histogram" else 1e-9
    for name in ("value", "lower", "plugin", "upper"):
        v = getattr(est, name)
        assert floor - slack <= v <= 1.0 + 1e-12, (name, v, floor)
    assert est.plugin <= est.upper
    assert est.halfwidth == pytest.approx(mcdiarmid_halfwidth(prior, len(m), len(h), 0.05))


@settings(max_examples=25, deadline=None)
@given(params=data_params, method=st.sampled_from(METHODS))
def test_swap_symmetry_at_half(params, method):
    m, h = draw_data(params)
    a = optimal_advantage(m, h, method=method)
    b = optimal_advantage(h, m, method=method)
    assert a.plugin == b.plugin  # |x − y| = |y − x| summed in the same order
    assert a.value == pytest.approx(b.value, abs=1e-12)  # rule ↦ 1 − rule, ties stay 1/2
    assert a.upper == b.upper


@settings(max_examples=20, deadline=None)
@given(params=data_params, prior=st.floats(0.05, 0.95), method=st.sampled_from(METHODS))
def test_swap_symmetry_with_complementary_prior(params, prior, method):
    m, h = draw_data(params)
    a = optimal_advantage(m, h, method=method, prior=prior)
    b = optimal_advantage(h, m, method=method, prior=1 - prior)
    assert a.plugin == pytest.approx(b.plugin, abs=1e-12)
    assert a.value == pytest.approx(b.value, abs=1e-9)
    assert a.halfwidth == pytest.approx(b.halfwidth, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(20, 300),
    mu=st.floats(-2.0, 2.0),
    scale=st.floats(1e-3, 1e3),
    shift=st.floats(-1e3, 1e3),
    prior=st.floats(0.1, 0.9),
)
def test_w_n_invariant_under_increasing_affine_map(seed, n, mu, scale, shift, prior):
    rng = np.random.default_rng(seed)
    m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n + 7)
    a = optimal_advantage(m, h, prior=prior)
    b = optimal_advantage(scale * m + shift, scale * h + shift, prior=prior)
    assert b.plugin == pytest.approx(a.plugin, abs=1e-12)
    assert b.value == pytest.approx(a.value, abs=1e-9)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("d", "scale"),
    [
        (2, 1e-3),
        (2, 1e-7),
        (2, 1e7),
        (3, 1e-3),
        (3, 1e3),
        (3, 1e-7),
        (3, 1e7),
    ],
)
def test_invariant_to_rescaling_one_axis(method, d, scale):
    """Grids are per axis and the KDE covariance is full: units of one axis do not matter."""
    m, h = gaussian_pair(np.random.default_rng(42), 1.0, 400, 400, d=d)
    a = optimal_advantage(m, h, method=method, n_samples=2048)
    axis = np.ones(d)
    axis[1] = scale
    b = optimal_advantage(m * axis, h * axis, method=method, n_samples=2048)
    assert b.value == pytest.approx(a.value, abs=1e-9)
    assert b.lower == pytest.approx(a.lower, abs=1e-9)
    assert b.plugin == pytest.approx(a.plugin, abs=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_value_invariant_under_affine_map(method):
    m, h = gaussian_pair(np.random.default_rng(41), 0.8, 500, 600)
    a = optimal_advantage(m, h, method=method)
    b = optimal_advantage(2.5 * m - 4.0, 2.5 * h - 4.0, method=method)
    assert b.value == pytest.approx(a.value, abs=1e-9)
    assert b.lower == pytest.approx(a.lower, abs=1e-9)
    assert b.plugin == pytest.approx(a.plugin, abs=1e-6)


# ----------------------------------------------------------------------------- bad input

GOOD_M = np.linspace(-1.0, 2.0, 40)
GOOD_H = np.linspace(-2.0, 1.0, 30)


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan"), float("inf"), "x", None])
@pytest.mark.parametrize("arg", ["prior", "delta"])
def test_bad_prior_or_delta(arg, bad):
    with pytest.raises(ValueError, match=arg):
        optimal_advantage(GOOD_M, GOOD_H, **{arg: bad})


@pytest.mark.parametrize(
    ("m", "h", "name"),
    [
        ([], GOOD_H, "member_scores"),
        (GOOD_M, np.array([]), "nonmember_scores"),
        (np.full(5, np.nan), GOOD_H, "member_scores"),
        (GOOD_M, [np.inf, -np.inf, np.nan], "nonmember_scores"),
        (np.zeros((4, 2, 2)), GOOD_H, "member_scores"),
        (["a", "b"], GOOD_H, "member_scores"),
        (np.zeros((4, 0)), GOOD_H, "member_scores"),
        (np.ones(4) + 1j, GOOD_H, "member_scores must be real"),
        (GOOD_M, torch.ones(4, dtype=torch.complex64), "nonmember_scores must be real"),
    ],
)
def test_bad_scores(m, h, name):
    with pytest.raises(ValueError, match=name):
        optimal_advantage(m, h)


def test_mismatched_dimensions():
    with pytest.raises(ValueError, match="member_scores and nonmember_scores"):
        optimal_advantage(np.zeros((5, 2)), np.zeros((5, 3)))
    with pytest.raises(ValueError, match="dimension"):
        optimal_advantage(np.zeros((5, 2)), np.zeros(5))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"method": "KDE"}, "method"),
        ({"method": "hist"}, "method"),
        ({"bins": 0}, "bins"),
        ({"bins": -3}, "bins"),
        ({"bins": 2.5}, "bins"),
        ({"bins": True}, "bins"),
        ({"folds": 3}, "folds"),
        ({"folds": 4.0}, "folds"),
        ({"folds": True}, "folds"),
        ({"n_samples": 1}, "n_samples"),
        ({"bandwidth": 0}, "bandwidth"),
        ({"bandwidth": -1.0}, "bandwidth"),
        ({"bandwidth": "scot"}, "bandwidth"),
    ],
)
def test_bad_configuration(kwargs, name):
    with pytest.raises(ValueError, match=name):
        optimal_advantage(GOOD_M, GOOD_H, **kwargs)


# ----------------------------------------------------------------------------- NaN / inf, inputs


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("d", [1, 2, 3])
def test_non_finite_rows_dropped_and_counted(method, d):
    rng = np.random.default_rng(51)
    m, h = gaussian_pair(rng, 0.7, 300, 250, d=d)
    m2 = np.concatenate([m[:100], np.full((2, *m.shape[1:]), np.nan), m[100:]])
    bad_row = np.full((1, *h.shape[1:]), 1.0)
    bad_row.flat[0] = np.inf
    h2 = np.concatenate([bad_row, h, -bad_row])
    clean = optimal_advantage(m, h, method=method, n_samples=1024)
    dirty = optimal_advantage(m2, h2, method=method, n_samples=1024)
    assert dirty.n_dropped == 4
    assert clean.n_dropped == 0
    expected = clean.as_dict() | {"n_dropped": 4}
    assert dirty.as_dict() == expected
    assert (dirty.n_members, dirty.n_nonmembers) == (300, 250)


@pytest.mark.parametrize("method", METHODS)
def test_numpy_torch_and_float32_inputs_agree(method):
    rng = np.random.default_rng(52)
    m, h = gaussian_pair(rng, 0.9, 400, 300)
    ref = optimal_advantage(m, h, method=method)
    assert optimal_advantage(torch.from_numpy(m), torch.from_numpy(h), method=method) == ref
    assert optimal_advantage(m.tolist(), list(h), method=method) == ref
    m32, h32 = m.astype(np.float32), h.astype(np.float32)
    ref32 = optimal_advantage(m32, h32, method=method)
    t32 = optimal_advantage(torch.from_numpy(m32), torch.from_numpy(h32), method=method)
    assert t32 == ref32
    assert isinstance(t32.value, float) and isinstance(t32.lower, float)
    assert t32.value == pytest.approx(ref.value, abs=0.01)
    # a tensor that requires grad is accepted too (detached)
    g = torch.from_numpy(m).requires_grad_(True)
    assert optimal_advantage(g, torch.from_numpy(h), method=method) == ref


# regression: torch.from_numpy rejected negative strides
def test_reversed_numpy_view_accepted():
    m, h = gaussian_pair(np.random.default_rng(55), 0.5, 200, 200)
    assert optimal_advantage(m[::-1], h) == optimal_advantage(m[::-1].copy(), h)


def test_column_vector_equals_flat():
    rng = np.random.default_rng(53)
    m, h = gaussian_pair(rng, 0.5, 200, 200)
    assert optimal_advantage(m[:, None], h) == optimal_advantage(m, h)


def test_result_type_and_float():
    m, h = gaussian_pair(np.random.default_rng(54), 1.0, 300, 300)
    est = privmon.optimal_advantage(m, h, prior=0.4, delta=0.1)
    assert isinstance(est, AdvantageEstimate)
    assert float(est) == est.value
    d = est.as_dict()
    assert d["prior"] == 0.4 and d["delta"] == 0.1 and d["method"] == "histogram"
    assert d["floor"] == pytest.approx(0.2)
    with pytest.raises(AttributeError):
        est.value = 0.0  # frozen


def test_fft_length_is_the_smallest_5_smooth_number_not_below_n():
    from privmon.estimators.smoothing import _fft_size

    def smooth(m):
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1

    for n in range(1, 3000):
        m = _fft_size(n)
        assert m >= n and smooth(m) and not any(smooth(k) for k in range(n, m))


def test_each_kernel_is_cut_at_its_own_width():
    # rows smoothed together give the same kernels as rows smoothed alone (the U_N plug-in must
    # not depend on the cross-fitting rows it shares an FFT with)
    from privmon.estimators.smoothing import _gaussian_kernels

    width = torch.tensor([0.01], dtype=torch.float64)
    narrow = torch.tensor([[[0.02**2]]], dtype=torch.float64)
    wide = torch.tensor([[[0.3**2]]], dtype=torch.float64)
    alone = _gaussian_kernels(narrow, width, (2000,))[0]
    together = _gaussian_kernels(torch.cat([narrow, wide]), width, (2000,))[0]
    pad = (together.numel() - alone.numel()) // 2
    assert alone.numel() == 2 * 8 + 1  # 4 sd = 8 cells each side
    torch.testing.assert_close(together[pad:-pad], alone, rtol=0, atol=0)
    assert float(together[:pad].abs().sum() + together[-pad:].abs().sum()) == 0.0


@pytest.mark.parametrize("sd", [0.25, 0.7, 3.0, 40.0])
def test_spectral_smoothing_equals_direct_convolution_with_sampled_gaussians(sd):
    # the 1-D KDE smooths in the frequency domain with the kernels' exact spectra (Poisson
    # summation); it must equal convolving with the sampled Gaussian (normalized to sum 1)
    from privmon.estimators.smoothing import _gaussian_smooth_1d

    cells = 300
    counts = torch.from_numpy(np.random.default_rng(1).poisson(3.0, (2, cells)).astype(float))
    var = torch.tensor([sd**2, (sd * 1.5) ** 2], dtype=torch.float64)
    ext, crop = _gaussian_smooth_1d(counts, var, cells, 1)
    for r in range(2):
        half = int(12 * math.sqrt(float(var[r]))) + 2
        j = np.arange(-half, half + 1)
        k = np.exp(-0.5 * j**2 / float(var[r]))
        direct = np.convolve(counts[r].numpy(), k / k.sum())  # full support, starts at -half
        on_grid = direct[half : half + cells]
        if r == 0:  # extended row: the whole circle holds the full convolution, tails wrapped
            assert float(ext[0].sum()) == pytest.approx(float(counts[0].sum()), rel=1e-12)
            np.testing.assert_allclose(ext[0, :cells].numpy(), on_grid, atol=1e-9)
        else:
            np.testing.assert_allclose(crop[0].numpy(), on_grid, atol=1e-9)


def test_joint_grid_estimates_equal_one_method_at_a_time():
    # The monitor estimates every method in one pass (one transfer, one pair of Clopper–Pearson
    # calls); each estimate must be the one advantage_from_state gives alone.
    from privmon.estimators.advantage import advantage_from_state
    from privmon.estimators.binned_scores import BinnedScores
    from privmon.estimators.selections import stream_selections
    from privmon.estimators.stages import grid_figures

    rng = np.random.default_rng(11)
    m = torch.from_numpy(rng.normal(0.4, 1.0, (900, 1)))
    h = torch.from_numpy(rng.normal(0.0, 1.0, (700, 1)))
    states = {}
    for method, bins in (("histogram", 100), ("kde", 2000)):
        states[method] = BinnedScores(bins=bins, margin=0.0, low=-5.0, high=5.0)
        states[method].update(m, h)
    grids = {method: stream_selections(state) for method, state in states.items()}
    joint, _, _ = grid_figures(grids, prior=0.3, delta=0.05, bandwidth="scott", n_dropped=2)
    for method, state in states.items():
        alone = advantage_from_state(state, prior=0.3, method=method, delta=0.05, n_dropped=2)
        assert joint[method] == alone
