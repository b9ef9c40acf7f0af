"""Tests for privmon.estimators.risk: individual privacy risk |f_p(z)| (MACE eq. 8, §4.1) with
Lemma 5 (Clopper–Pearson, histogram) and Lemma 6/11 (KDE) intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import beta, gaussian_kde, norm

import privmon
from privmon.estimators.risk import IndividualRisk, individual_risk

METHODS = ("histogram", "kde")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def f_true(x, mu: float, prior: float):
    """Analytic f_p(x) for members N(μ,1) vs non-members N(0,1)."""
    a = prior * norm.pdf(x - mu)
    b = (1 - prior) * norm.pdf(x)
    return (a - b) / (a + b)


def f_of(pm, qm, prior):
    return (prior * pm - (1 - prior) * qm) / (prior * pm + (1 - prior) * qm)


def bin_of(x: float, low: float, high: float, bins: int):
    """privmon's cell of x on the grid [low, high] with ``bins`` cells, and the cell's edges."""
    width = (high - low) / bins
    j = min(max(math.floor((x - low) / width), 0), bins - 1)
    return j, low + j * width, low + (j + 1) * width


def lemma5(k1, n1, k2, n2, prior, delta):
    """MACE Lemma 5 by hand: two-sided Clopper–Pearson at level 1 − δ/2 for P and for Q."""
    a = delta / 4
    p_lo = 0.0 if k1 == 0 else beta.ppf(a, k1, n1 - k1 + 1)
    p_hi = 1.0 if k1 == n1 else beta.ppf(1 - a, k1 + 1, n1 - k1)
    q_lo = 0.0 if k2 == 0 else beta.ppf(a, k2, n2 - k2 + 1)
    q_hi = 1.0 if k2 == n2 else beta.ppf(1 - a, k2 + 1, n2 - k2)
    f_lo = f_of(p_lo, q_hi, prior)
    f_hi = f_of(p_hi, q_lo, prior)
    if f_lo <= 0 <= f_hi:
        return 0.0, max(abs(f_lo), abs(f_hi)), f_lo, f_hi
    return min(abs(f_lo), abs(f_hi)), max(abs(f_lo), abs(f_hi)), f_lo, f_hi


# ----------------------------------------------------------------------------- analytic truth


@pytest.mark.parametrize("prior", [0.5, 0.3])
@pytest.mark.parametrize("method", METHODS)
def test_signed_risk_matches_analytic_f(method, prior):
    mu, n = 2.0, 20_000
    rng = np.random.default_rng(1)
    m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
    xs = np.array([-0.5, 0.5, 1.0, 1.5, 2.5])
    r = individual_risk(xs, m, h, prior=prior, method=method)
    if method == "histogram":
        # the histogram estimates the bin average of f without bias: compare with the exact bin
        # value, within 5 standard deviations of the delta method (A, B: the bin probabilities)
        low, high = min(m.min(), h.min()), max(m.max(), h.max())
        for i, x in enumerate(xs):
            _, a, b = bin_of(x, low, high, 100)
            pa, pb = norm.cdf(b - mu) - norm.cdf(a - mu), norm.cdf(b) - norm.cdf(a)
            den = prior * pa + (1 - prior) * pb
            g = 2 * prior * (1 - prior) / den**2
            sd = math.sqrt((g * pb) ** 2 * pa * (1 - pa) / n + (g * pa) ** 2 * pb * (1 - pb) / n)
            assert abs(r.signed[i] - f_of(pa, pb, prior)) <= 5 * sd
            assert sd < 0.04
        np.testing.assert_allclose(r.signed, f_true(xs, mu, prior), atol=0.15)
    else:
        np.testing.assert_allclose(r.signed, f_true(xs, mu, prior), atol=0.07)
    np.testing.assert_array_equal(r.value, np.abs(r.signed))
    np.testing.assert_array_equal(r.posterior, (1 + r.signed) / 2)
    assert np.all(r.lower <= r.value + 1e-12) and np.all(r.value <= r.upper + 1e-12)
    assert np.all((r.lower >= 0) & (r.upper <= 1))
    assert np.all(r.upper - r.lower < 0.35)  # informative at this size


@pytest.mark.parametrize(("prior", "delta"), [(0.5, 0.1), (0.3, 0.3)])
def test_histogram_interval_coverage(prior, delta):
    """Lemma 5 is exact Clopper–Pearson: the bin's true |f| is covered in >= 1 − δ of runs."""
    mu, x0, n, runs = 1.0, 0.3, 300, 200
    misses, widths = 0, []
    for seed in range(runs):
        rng = np.random.default_rng(500 + seed)
        m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
        _, a, b = bin_of(x0, min(m.min(), h.min()), max(m.max(), h.max()), 100)
        pm = norm.cdf(b - mu) - norm.cdf(a - mu)
        qm = norm.cdf(b) - norm.cdf(a)
        target = abs(f_of(pm, qm, prior))
        r = individual_risk([x0], m, h, prior=prior, delta=delta)
        misses += not (r.lower[0] <= target <= r.upper[0])
        widths.append(r.upper[0] - r.lower[0])
    slack = 3 * math.sqrt(delta * (1 - delta) / runs)
    assert misses / runs <= delta + slack
    assert np.mean(widths) < 0.95  # not the vacuous [0, 1]


def test_kde_interval_narrows_with_n():
    widths = []
    for n in (500, 8000):
        rng = np.random.default_rng(n)
        m, h = rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n)
        r = individual_risk([1.5], m, h, method="kde")
        widths.append(float(r.upper[0] - r.lower[0]))
        assert r.lower[0] <= abs(f_true(1.5, 1.0, 0.5)) <= r.upper[0]
    assert widths[1] < widths[0] / 2


# ----------------------------------------------------------------------------- Lemma 5 by hand


@pytest.mark.parametrize("prior", [0.5, 0.3, 0.8])
@pytest.mark.parametrize("delta", [0.05, 0.2])
def test_lemma5_by_hand_explicit_counts(prior, delta):
    # bins = 2 on [0, 1]: cell 0 = [0, 0.5), cell 1 = [0.5, 1]
    members = np.r_[np.full(29, 0.1), 0.0, np.full(10, 0.9)]  # 30 in cell 0, 10 in cell 1
    nonmembers = np.r_[np.full(3, 0.2), np.full(36, 0.7), 1.0]  # 3 in cell 0, 37 in cell 1
    r = individual_risk([0.25, 0.75, 0.5], members, nonmembers, prior=prior, delta=delta, bins=2)
    for i, (k1, k2) in enumerate([(30, 3), (10, 37), (10, 37)]):
        lo, hi, f_lo, f_hi = lemma5(k1, 40, k2, 40, prior, delta)
        assert r.signed[i] == pytest.approx(f_of(k1 / 40, k2 / 40, prior), abs=1e-12)
        assert r.lower[i] == pytest.approx(lo, abs=1e-9)
        assert r.upper[i] == pytest.approx(hi, abs=1e-9)
        if getattr(r, "signed_lower", None) is not None:
            assert r.signed_lower[i] == pytest.approx(f_lo, abs=1e-9)
            assert r.signed_upper[i] == pytest.approx(f_hi, abs=1e-9)


def test_lemma5_closed_form_corners():
    """All 40 members in one cell, no non-member there: CP bounds have closed forms."""
    members, nonmembers = np.linspace(0.0, 0.4, 40), np.linspace(0.6, 1.0, 40)
    delta = 0.05
    a = (delta / 4) ** (1 / 40)  # CP lower for 40/40 = CP upper complement for 0/40
    r = individual_risk([0.2, 0.8], members, nonmembers, delta=delta, bins=2)
    np.testing.assert_allclose(r.signed, [1.0, -1.0])
    np.testing.assert_allclose(r.lower, [2 * a - 1, 2 * a - 1], atol=1e-12)
    np.testing.assert_allclose(r.upper, [1.0, 1.0])
    np.testing.assert_allclose(r.posterior, [1.0, 0.0])
    # prior 0.3: f_lo = (0.3a − 0.7(1 − a)) / (0.3a + 0.7(1 − a))
    r3 = individual_risk([0.2], members, nonmembers, delta=delta, bins=2, prior=0.3)
    expected = (0.3 * a - 0.7 * (1 - a)) / (0.3 * a + 0.7 * (1 - a))
    assert r3.lower[0] == pytest.approx(expected, abs=1e-12)


def test_lemma5_straddling_interval_tiny_sample():
    # bins = 2 on [0, 1]: query 0.1 sees k1 = 3 of 4 members, k2 = 1 of 4 non-members
    members = [0.05, 0.15, 0.15, 0.95]
    nonmembers = [0.0, 0.55, 0.95, 1.0]
    r = individual_risk([0.1], members, nonmembers, bins=2)
    _, hi, f_lo, f_hi = lemma5(3, 4, 1, 4, 0.5, 0.05)
    assert f_lo < 0 < f_hi
    assert r.signed[0] == pytest.approx(0.5)
    assert r.lower[0] == 0.0
    assert r.upper[0] == pytest.approx(hi, abs=1e-12)


def test_histogram_risk_2d_matches_direct_counts():
    rng = np.random.default_rng(3)
    m = rng.normal(0, 1, (400, 2)) + np.array([1.0, 0.0])
    h = rng.normal(0, 1, (300, 2))
    q = rng.normal(0.5, 1.0, (6, 2))
    pooled = np.concatenate([m, h])
    rng_ = [(pooled[:, k].min(), pooled[:, k].max()) for k in range(2)]
    bins = 8
    a, _ = np.histogramdd(m, bins=bins, range=rng_)
    b, _ = np.histogramdd(h, bins=bins, range=rng_)
    r = individual_risk(q, m, h, bins=bins, prior=0.4)
    for i, x in enumerate(q):
        j = [bin_of(x[k], *rng_[k], bins)[0] for k in range(2)]
        lo, hi, _, _ = lemma5(a[j[0], j[1]], 400, b[j[0], j[1]], 300, 0.4, 0.05)
        assert r.signed[i] == pytest.approx(f_of(a[tuple(j)] / 400, b[tuple(j)] / 300, 0.4))
        assert r.lower[i] == pytest.approx(lo, abs=1e-9)
        assert r.upper[i] == pytest.approx(hi, abs=1e-9)


def test_histogram_risk_3d_sparse_matches_direct_counts():
    rng = np.random.default_rng(4)
    m = rng.normal(0, 1, (300, 3)) + np.array([1.0, 0.0, 0.0])
    h = rng.normal(0, 1, (300, 3))
    q = np.concatenate([m[:4], h[:4]])
    pooled = np.concatenate([m, h])
    rng_ = [(pooled[:, k].min(), pooled[:, k].max()) for k in range(3)]
    bins = 4
    a, _ = np.histogramdd(m, bins=bins, range=rng_)
    b, _ = np.histogramdd(h, bins=bins, range=rng_)
    r = individual_risk(q, m, h, bins=bins)
    for i, x in enumerate(q):
        j = tuple(bin_of(x[k], *rng_[k], bins)[0] for k in range(3))
        lo, hi, _, _ = lemma5(a[j], 300, b[j], 300, 0.5, 0.05)
        assert r.signed[i] == pytest.approx(f_of(a[j] / 300, b[j] / 300, 0.5))
        assert r.lower[i] == pytest.approx(lo, abs=1e-9)
        assert r.upper[i] == pytest.approx(hi, abs=1e-9)


# ----------------------------------------------------------------------------- KDE (Lemma 6/11)


@pytest.mark.parametrize("prior", [0.5, 0.25])
def test_kde_risk_matches_scipy_and_lemma11_by_hand(prior):
    rng = np.random.default_rng(5)
    m, h = rng.normal(0.8, 1.0, 300), rng.normal(0.0, 1.2, 250)
    xs = np.array([-1.0, 0.0, 0.4, 1.2, 3.0])
    delta = 0.1
    r = individual_risk(xs, m, h, prior=prior, method="kde", delta=delta)
    z = norm.ppf(1 - delta / 4)
    corners = []
    for data in (m, h):
        k = gaussian_kde(data)
        dens = k(xs)
        mu_over_hd = (4 * math.pi) ** -0.5 / math.sqrt(k.covariance[0, 0])  # ∫K_H² in 1-D
        half = z * np.sqrt(mu_over_hd * dens / len(data))
        corners.append((dens, np.maximum(dens - half, 0), dens + half))
    (pd, p_lo, p_hi), (qd, q_lo, q_hi) = corners
    np.testing.assert_allclose(r.signed, f_of(pd, qd, prior), atol=1e-9)
    f_lo, f_hi = f_of(p_lo, q_hi, prior), f_of(p_hi, q_lo, prior)
    straddles = (f_lo <= 0) & (f_hi >= 0)
    lower = np.where(straddles, 0.0, np.minimum(abs(f_lo), abs(f_hi)))
    upper = np.maximum(abs(f_lo), abs(f_hi))
    np.testing.assert_allclose(r.lower, lower, atol=1e-9)
    np.testing.assert_allclose(r.upper, upper, atol=1e-9)


def test_kde_signed_finite_where_densities_underflow():
    rng = np.random.default_rng(6)
    m, h = rng.normal(1.0, 1.0, 200), rng.normal(0.0, 1.0, 200)
    r = individual_risk([1e4, -1e4], m, h, method="kde")
    assert np.all(np.isfinite(r.signed))
    assert np.all(np.abs(r.signed) <= 1.0)
    np.testing.assert_array_equal(r.lower, [0.0, 0.0])  # no evidence: [0, 1]
    np.testing.assert_array_equal(r.upper, [1.0, 1.0])


# ----------------------------------------------------------------------------- non-finite, range


@pytest.mark.parametrize("method", METHODS)
def test_nan_queries_give_nan_aligned(method):
    rng = np.random.default_rng(7)
    m, h = rng.normal(1.0, 1.0, 500), rng.normal(0.0, 1.0, 500)
    q = np.array([0.5, np.nan, 0.2, np.inf, -np.inf, 1.5])
    m_dirty = np.r_[m, np.nan, np.inf]
    r = individual_risk(q, m_dirty, h, method=method)
    finite = np.isfinite(q)
    clean = individual_risk(q[finite], m, h, method=method)
    for name in ("value", "lower", "upper", "signed", "posterior"):
        arr = getattr(r, name)
        assert arr.shape == (6,)
        assert np.all(np.isnan(arr[~finite]))
        np.testing.assert_array_equal(arr[finite], getattr(clean, name))
    assert r.n_dropped == 3 + 2
    assert clean.n_dropped == 0


@pytest.mark.parametrize("prior", [0.5, 0.3])
def test_query_outside_data_range_has_no_evidence(prior):
    rng = np.random.default_rng(8)
    m, h = rng.normal(1.0, 1.0, 500), rng.normal(0.0, 1.0, 500)
    r = individual_risk([100.0, -100.0], m, h, prior=prior)
    np.testing.assert_array_equal(r.lower, [0.0, 0.0])
    np.testing.assert_array_equal(r.upper, [1.0, 1.0])
    np.testing.assert_allclose(r.signed, [2 * prior - 1] * 2)
    np.testing.assert_allclose(r.posterior, [prior, prior])


def test_query_at_the_range_edges_is_inside():
    m, h = np.array([0.0, 0.1, 0.2, 1.0]), np.array([0.5, 0.6, 0.9, 0.95])
    r = individual_risk([0.0, 1.0], m, h, bins=2)
    # 0.0 -> cell 0 (3 members, 0 non-members); 1.0 -> last cell, closed on the right (1, 4)
    np.testing.assert_allclose(r.signed, [1.0, f_of(1 / 4, 4 / 4, 0.5)])


# ----------------------------------------------------------------------------- consistency


def test_posterior_equals_song_mittal_calibration_in_sample():
    """In-sample, the histogram posterior of a cell is the member share of the prior-weighted
    records in that cell: p·a/N1 / (p·a/N1 + (1−p)·b/N2)."""
    rng = np.random.default_rng(9)
    m, h = rng.normal(0.5, 1.0, 600), rng.normal(0.0, 1.0, 600)
    r = individual_risk(np.r_[m, h], m, h)
    is_member = np.r_[np.ones(600), np.zeros(600)]
    # records in the same cell share a posterior; the member share per cell equals it
    for post in np.unique(np.round(r.posterior, 12))[:20]:
        sel = np.isclose(r.posterior, post, atol=1e-12)
        assert is_member[sel].mean() == pytest.approx(post, abs=1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_numpy_torch_float32_agree(method):
    rng = np.random.default_rng(10)
    m, h = rng.normal(1.0, 1.0, 300), rng.normal(0.0, 1.0, 300)
    q = rng.normal(0.5, 1.0, 7)
    ref = individual_risk(q, m, h, method=method)
    tr = individual_risk(
        torch.from_numpy(q), torch.from_numpy(m), torch.from_numpy(h), method=method
    )
    for name in ("value", "lower", "upper", "signed", "posterior"):
        np.testing.assert_array_equal(getattr(tr, name), getattr(ref, name))
        assert isinstance(getattr(tr, name), np.ndarray)
    f32 = [a.astype(np.float32) for a in (q, m, h)]
    r32 = individual_risk(*f32, method=method)
    t32 = individual_risk(*[torch.from_numpy(a) for a in f32], method=method)
    np.testing.assert_array_equal(r32.value, t32.value)
    assert isinstance(privmon.individual_risk(q, m, h), IndividualRisk)


def test_2d_kde_risk_matches_analytic():
    rng = np.random.default_rng(11)
    n = 20_000
    m = rng.normal(0, 1, (n, 2)) + np.array([1.5, 0.0])
    h = rng.normal(0, 1, (n, 2))
    xs = np.array([[0.0, 0.0], [0.75, 1.0], [1.5, -0.5]])
    r = individual_risk(xs, m, h, method="kde")
    np.testing.assert_allclose(r.signed, f_true(xs[:, 0], 1.5, 0.5), atol=0.1)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n1=st.integers(5, 120),
    n2=st.integers(5, 120),
    mu=st.floats(-3, 3),
    prior=st.floats(0.05, 0.95),
    delta=st.floats(0.01, 0.5),
    method=st.sampled_from(METHODS),
)
def test_risk_invariants_and_swap_symmetry(seed, n1, n2, mu, prior, delta, method):
    rng = np.random.default_rng(seed)
    m, h = rng.normal(mu, 1.0, n1), rng.normal(0.0, 1.5, n2)
    q = np.r_[rng.normal(0.0, 2.0, 10), m[:3], h[:3], 50.0]
    r = individual_risk(q, m, h, prior=prior, delta=delta, method=method)
    assert np.all((r.lower >= 0) & (r.lower <= r.value + 1e-12))
    assert np.all((r.value <= r.upper + 1e-12) & (r.upper <= 1))
    np.testing.assert_array_equal(r.value, np.abs(r.signed))
    np.testing.assert_array_equal(r.posterior, (1 + r.signed) / 2)
    assert r.n_dropped == 0
    # members <-> non-members with prior p <-> 1 − p: f ↦ −f, the |f| interval is unchanged
    s = individual_risk(q, h, m, prior=1 - prior, delta=delta, method=method)
    np.testing.assert_allclose(s.signed, -r.signed, atol=1e-9)
    np.testing.assert_allclose(s.lower, r.lower, atol=1e-9)
    np.testing.assert_allclose(s.upper, r.upper, atol=1e-9)


# ----------------------------------------------------------------------------- bad input

GM, GH = np.linspace(-1, 2, 40), np.linspace(-2, 1, 30)


@pytest.mark.parametrize("bad", [0, 1, -0.1, float("nan")])
@pytest.mark.parametrize("arg", ["prior", "delta"])
def test_bad_prior_delta(arg, bad):
    with pytest.raises(ValueError, match=arg):
        individual_risk([0.0], GM, GH, **{arg: bad})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"method": "hist"}, "method"), ({"bandwidth": -1}, "bandwidth"), ({"bins": 0}, "bins")],
)
def test_bad_configuration(kwargs, name):
    with pytest.raises(ValueError, match=name):
        individual_risk([0.0], GM, GH, **kwargs)


# regression: bins was not validated (TypeError in 1-D)
def test_bad_bins_float_raises_value_error():
    with pytest.raises(ValueError, match="bins"):
        individual_risk([0.0], GM, GH, bins=2.5)


# regression: bins <= 0 was accepted above 2 dimensions
@pytest.mark.parametrize("bins", [0, -2])
def test_bad_bins_3d_raises_value_error(bins):
    x = np.random.default_rng(0).normal(size=(30, 3))
    with pytest.raises(ValueError, match="bins"):
        individual_risk(x[:3], x, x + 1, bins=bins)


@pytest.mark.parametrize(
    ("q", "m", "h", "name"),
    [
        ([], GM, GH, "scores"),
        ([0.0], [], GH, "member_scores"),
        ([0.0], GM, [np.nan, np.nan], "nonmember_scores"),
        (np.zeros((2, 2)), GM, GH, "scores"),
        ([0.0], GM, np.zeros((5, 2)), "nonmember_scores"),
    ],
)
def test_bad_scores(q, m, h, name):
    with pytest.raises(ValueError, match=name):
        individual_risk(q, m, h)


def test_all_nan_queries_give_all_nan():
    r = individual_risk([np.nan, np.inf], GM, GH)
    assert np.all(np.isnan(r.value)) and r.n_dropped == 2


def test_memoised_clopper_pearson_bounds_equal_direct_ones():
    from privmon.estimators import risk as risk_mod
    from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper

    rng = np.random.default_rng(0)
    for n, delta in ((500, 0.05), (500, 0.1), (73, 0.05), (500, 0.05)):
        k = rng.integers(0, n + 1, 300).astype(np.float64)
        lo, hi = risk_mod._cp_interval(k, n, delta)
        np.testing.assert_array_equal(lo, clopper_pearson_lower(k, n, delta / 4))
        np.testing.assert_array_equal(hi, clopper_pearson_upper(k, n, delta / 4))
    assert (500, 0.05) in risk_mod._CP_TABLES and len(risk_mod._CP_TABLES) <= 8
    # counts above the table size, or non-integer ones, take the direct path
    lo, _ = risk_mod._cp_interval(np.array([2.5, 3.0]), 10, 0.05)
    np.testing.assert_array_equal(lo, clopper_pearson_lower(np.array([2.5, 3.0]), 10, 0.0125))
