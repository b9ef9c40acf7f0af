"""privmon.audit.one_run_epsilon / epsilon_from_guesses: the count-level bounds against plain scipy
implementations of the formula sheet (Steinke et al.'s p-value; Mahloujifar et al.'s Algorithm 3
step by step), Opacus's GDP conversion, monotonicity, and the score-level audit's choices,
ties, missing scores, inputs and errors. The null rate over 200 runs is in
benchmarks/one_run_audit.py; here only a smoke check."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants.analysis.gdp import eps_from_mu
from scipy import optimize, stats

from privmon.audit import OneRunAudit, epsilon_from_guesses, one_run_epsilon
from privmon.audit.one_run import BONFERRONI_GRID
from privmon.audit.one_run_math import fdp_mu, gdp_epsilon, steinke_p_value

# --- plain implementations of the formula sheet --------------------------------------------


def ref_steinke_p(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """β + α·δ·2m with scipy's binomial, α over every i = 1..v."""
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    i = np.arange(1, v + 1)
    inside = stats.binom.cdf(v - 1, r, q) - stats.binom.cdf(v - i - 1, r, q)
    alpha = float(np.max(inside / i, initial=0.0))
    return min(1.0, beta + alpha * delta * 2 * m)


def ref_steinke_eps(m: int, r: int, v: int, delta: float, s: float) -> float:
    """The ε where the p-value reaches s (brentq; the p-value rises with ε)."""
    if ref_steinke_p(m, r, v, 0.0, delta) >= s:
        return 0.0
    hi = 1.0
    while ref_steinke_p(m, r, v, hi, delta) < s:
        hi *= 2
    return optimize.brentq(lambda e: ref_steinke_p(m, r, v, e, delta) - s, 0.0, hi, xtol=1e-9)


def ref_algorithm3_rejects(m: int, c_prime: int, c: int, mu: float, tau: float) -> bool:
    """Algorithm 3 of "Auditing f-Differential Privacy in One Run" with lists, k = 2:
    f̄⁻¹(x) = Φ(Φ⁻¹(x) - μ) (f̄⁻¹(1) = 1)."""
    normal = NormalDist()

    def blow_up_inverse(x: float) -> float:
        return 1.0 if x >= 1.0 else normal.cdf(normal.inv_cdf(x) - mu)

    r = [0.0] * (c + 1)
    h = [0.0] * (c + 1)
    r[c] = tau * c / m
    h[c] = tau * (c_prime - c) / m
    for i in range(c - 1, -1, -1):
        h[i] = max(h[i + 1], blow_up_inverse(r[i + 1]))
        r[i] = r[i + 1] + (i / (c_prime - i)) * (h[i] - h[i + 1])
    return r[0] + h[0] > c_prime / m


def ref_fdp_mu(m: int, c_prime: int, c: int, tau: float) -> float:
    """The largest refuted μ by bisection on the list implementation."""
    if not ref_algorithm3_rejects(m, c_prime, c, 1e-12, tau):
        return 0.0
    lo, hi = 0.0, 1.0
    while ref_algorithm3_rejects(m, c_prime, c, hi, tau):
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ref_algorithm3_rejects(m, c_prime, c, mid, tau) else (lo, mid)
    return lo


COUNTS = [  # (m, r, v): hand-picked, from a small audit to the benchmark's size
    (100, 20, 18),
    (1000, 100, 80),
    (1000, 200, 150),
    (10_000, 500, 450),
    (100_000, 2000, 1800),
    (100_000, 800, 790),
]


@pytest.mark.parametrize(("m", "r", "v"), COUNTS)
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_steinke_p_value_equals_the_formula(m, r, v, delta):
    eps = np.array([0.0, 0.3, 1.0, 2.0, 3.5])
    got = steinke_p_value(m, r, v, eps, delta)
    want = [ref_steinke_p(m, r, v, e, delta) for e in eps]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize(("m", "r", "v"), COUNTS)
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_steinke_bound_is_where_the_p_value_reaches_significance(m, r, v, delta):
    got = epsilon_from_guesses(
        n_canaries=m, n_guesses=r, n_correct=v, delta=delta, significance=0.05, method="steinke"
    )
    want = ref_steinke_eps(m, r, v, delta, 0.05)
    assert want - 1e-3 <= got <= want  # rounded down, never up
    assert got == 0.0 or ref_steinke_p(m, r, v, got, delta) < 0.05


@pytest.mark.parametrize(("m", "r", "v"), COUNTS)
def test_fdp_bound_is_algorithm_3_step_by_step(m, r, v):
    mu = fdp_mu(m, r, v, 0.05)
    want = ref_fdp_mu(m, r, v, 0.05)
    assert want > 0.0
    assert want - 2e-3 <= mu <= want
    assert ref_algorithm3_rejects(m, r, v, mu, 0.05)
    eps = epsilon_from_guesses(n_canaries=m, n_guesses=r, n_correct=v, delta=1e-5, method="fdp")
    assert eps == pytest.approx(eps_from_mu(mu=mu, delta=1e-5), abs=1e-8)


@pytest.mark.parametrize(("mu", "want"), [(1.0, 4.37), (0.5, 1.99)])
def test_gdp_conversion_matches_the_sheet_and_opacus(mu, want):
    # the formula sheet's "theory ε" of the idealised Gaussian mechanism (σ = 1 / μ)
    assert gdp_epsilon(mu, 1e-5) == pytest.approx(want, abs=0.01)
    assert gdp_epsilon(mu, 1e-5) == pytest.approx(eps_from_mu(mu=mu, delta=1e-5), abs=1e-9)


def test_gdp_conversion_is_zero_when_delta_covers_the_curve():
    # μ-GDP is (0, δ)-DP once δ >= 2Φ(μ/2) - 1
    mu = 0.1
    assert gdp_epsilon(mu, 2 * stats.norm.cdf(mu / 2) - 1 + 1e-9) == 0.0
    assert gdp_epsilon(mu, 2 * stats.norm.cdf(mu / 2) - 1 - 1e-3) > 0.0


@pytest.mark.parametrize("method", ["steinke", "fdp"])
@pytest.mark.parametrize(("m", "r"), [(1000, 100), (100_000, 5000), (50, 50)])
def test_no_better_than_chance_gives_zero(method, m, r):
    assert epsilon_from_guesses(
        n_canaries=m, n_guesses=r, n_correct=r // 2, delta=1e-5, method=method
    ) == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("method", ["steinke", "fdp"])
def test_no_guesses_and_no_correct_guess_give_zero(method):
    for r, v in [(0, 0), (10, 0)]:
        assert epsilon_from_guesses(
            n_canaries=100, n_guesses=r, n_correct=v, delta=1e-5, method=method
        ) == pytest.approx(0.0, abs=1e-3)


counts = st.integers(10, 3000).flatmap(
    lambda m: st.tuples(st.just(m), st.integers(1, m)).flatmap(
        lambda mr: st.tuples(st.just(mr[0]), st.just(mr[1]), st.integers(0, mr[1]))
    )
)


@settings(max_examples=40, deadline=None)
@given(counts, st.sampled_from(["steinke", "fdp"]))
def test_bounds_are_monotone(mrv, method):
    m, r, v = mrv

    def bound(**kw):
        args = {"n_canaries": m, "n_guesses": r, "n_correct": v, "delta": 1e-5, "method": method}
        return epsilon_from_guesses(**(args | kw))

    tol = 2e-3  # two bounds on one grid: rounding may differ by one grid step
    base = bound()
    if v < r:
        assert bound(n_correct=v + 1) >= base - tol  # one more correct guess
    if r < m and v > 0:
        assert bound(n_guesses=r + 1) <= base + tol  # one more wrong guess
    assert bound(delta=1e-3) <= base + tol  # a weaker claim is harder to refute
    assert bound(significance=0.2) >= base - tol  # less confidence, larger bound


def test_steinke_p_value_rises_with_epsilon():
    eps = np.linspace(0.0, 6.0, 400)
    for m, r, v in COUNTS:
        p = steinke_p_value(m, r, v, eps, 1e-5)
        assert np.all(np.diff(p) >= -1e-15)


# --- the score-level audit -------------------------------------------------------------------


def gaussian_canaries(seed: int, m: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """The idealised Gaussian mechanism: in ~ N(1, σ²), out ~ N(0, σ²), inclusion ~ Bernoulli(½)."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    scores = rng.normal(included.astype(float), sigma)
    return scores[included], scores[~included]


def recount(in_scores, out_scores, k_plus, k_minus):
    """Correct guesses on the k₊ highest and k₋ lowest of distinct scores."""
    y = np.concatenate([in_scores, out_scores])
    included = np.arange(y.size) < len(in_scores)
    order = np.argsort(-y)
    return int(included[order[:k_plus]].sum() + (~included[order[y.size - k_minus :]]).sum())


@pytest.mark.parametrize("method", ["steinke", "fdp"])
def test_fixed_pair_counts_and_bound(method):
    ins, outs = gaussian_canaries(0, 2000, 1.0)
    audit = one_run_epsilon(ins, outs, delta=1e-5, method=method, selection=(30, 20))
    assert isinstance(audit, OneRunAudit)
    assert (audit.k_plus, audit.k_minus, audit.n_guesses) == (30, 20, 50)
    assert audit.n_correct == recount(ins, outs, 30, 20)
    assert (audit.n_canaries, audit.n_selection, audit.selection) == (2000, 0, "fixed")
    assert (
        float(audit)
        == audit.epsilon
        == epsilon_from_guesses(
            n_canaries=2000, n_guesses=50, n_correct=audit.n_correct, delta=1e-5, method=method
        )
    )
    assert (audit.mu is None) == (method == "steinke")


def test_hand_made_scores():
    # two ins on top, two outs at the bottom, one in at the bottom: 4 of 5 guesses right
    audit = one_run_epsilon(
        [9.0, 8.0, -5.0], [0.0, 1.0, -3.0, -4.0, 2.0], delta=0.0, method="steinke", selection=(2, 3)
    )
    assert audit.n_correct == 4


@pytest.mark.parametrize("method", ["steinke", "fdp"])
def test_bonferroni_is_the_best_grid_pair_at_the_corrected_level(method):
    ins, outs = gaussian_canaries(1, 5000, 1.0)
    audit = one_run_epsilon(ins, outs, delta=1e-5, method=method, selection="bonferroni")
    ks = sorted({max(1, round(f * 5000)) for f in BONFERRONI_GRID})
    bounds = [
        epsilon_from_guesses(
            n_canaries=5000,
            n_guesses=2 * k,
            n_correct=recount(ins, outs, k, k),
            delta=1e-5,
            significance=0.05 / len(ks),
            method=method,
        )
        for k in ks
    ]
    assert audit.epsilon == pytest.approx(max(bounds), abs=2e-3)
    assert audit.k_plus == audit.k_minus == ks[int(np.argmax(bounds))]


@pytest.mark.parametrize("method", ["steinke", "fdp"])
def test_split_audits_the_other_part_with_its_fractions(method):
    ins, outs = gaussian_canaries(2, 20_000, 1.0)
    audit = one_run_epsilon(ins, outs, delta=1e-5, method=method, seed=3)
    assert (audit.n_selection, audit.n_canaries, audit.selection) == (2000, 18_000, "split")
    assert 0 < audit.n_guesses <= 18_000 and audit.n_correct <= audit.n_guesses
    assert audit.epsilon == epsilon_from_guesses(
        n_canaries=18_000,
        n_guesses=audit.n_guesses,
        n_correct=audit.n_correct,
        delta=1e-5,
        method=method,
    )
    assert audit.epsilon > 1.0  # σ = 1 leaks (theory ε 4.37 at δ = 1e-5)
    again = one_run_epsilon(ins, outs, delta=1e-5, method=method, seed=3)
    assert again == audit  # seeded


def test_strictly_increasing_transform_changes_nothing():
    ins, outs = gaussian_canaries(5, 3000, 1.5)
    a = one_run_epsilon(ins, outs, delta=1e-5, method="fdp")
    b = one_run_epsilon(np.exp(ins), np.exp(outs), delta=1e-5, method="fdp")
    assert a == b


def test_inputs_numpy_torch_lists_columns_give_one_result():
    ins, outs = gaussian_canaries(6, 1000, 0.7)
    want = one_run_epsilon(ins, outs, delta=1e-5, method="steinke", selection="bonferroni")
    for a, b in [
        (torch.from_numpy(ins), torch.from_numpy(outs)),
        (ins.tolist(), outs.tolist()),
        (ins[:, None], outs[:, None]),
        (torch.from_numpy(ins).to(torch.float64).requires_grad_(), torch.from_numpy(outs)),
    ]:
        got = one_run_epsilon(a, b, delta=1e-5, method="steinke", selection="bonferroni")
        assert got == want
    if torch.cuda.is_available():
        got = one_run_epsilon(
            torch.from_numpy(ins).cuda(),
            torch.from_numpy(outs).cuda(),
            delta=1e-5,
            method="steinke",
            selection="bonferroni",
        )
        assert got == want


def test_float32_and_integer_scores_are_accepted():
    ins, outs = gaussian_canaries(7, 1000, 0.7)
    want = one_run_epsilon(ins, outs, delta=1e-5)
    # float32 keeps the order of these scores: the same audit
    assert one_run_epsilon(ins.astype(np.float32), outs.astype(np.float32), delta=1e-5) == want
    # integer scores: many ties, still a clear leak (theory ε 6.65 at σ = 0.7)
    coarse = one_run_epsilon(
        np.round(ins * 3).astype(int), np.round(outs * 3).astype(int), delta=1e-5
    )
    assert coarse.epsilon > 2.0


def test_non_finite_scores_are_counted_and_abstained_on():
    ins, outs = gaussian_canaries(8, 1000, 0.7)
    bad_in = np.concatenate([ins, [np.nan, np.inf]])
    bad_out = np.concatenate([outs, [-np.inf, np.nan, np.nan]])
    audit = one_run_epsilon(bad_in, bad_out, delta=1e-5, selection=(40, 40))
    clean = one_run_epsilon(ins, outs, delta=1e-5, selection=(40, 40))
    assert audit.n_dropped == 5
    assert audit.n_canaries == 1005  # they still count as canaries
    assert audit.n_correct == clean.n_correct  # never guessed: ranked in the middle
    # guesses reaching the middle do guess them, so a fixed pair keeps its guess count
    full = one_run_epsilon(bad_in, bad_out, delta=1e-5, method="steinke", selection=(600, 405))
    assert full.n_guesses == 1005


def test_all_tied_scores_give_chance_guesses():
    rates = []
    for seed in range(10):
        audit = one_run_epsilon(
            np.zeros(500),
            np.zeros(500),
            delta=1e-5,
            method="steinke",
            selection=(250, 250),
            seed=seed,
        )
        rates.append(audit.n_correct / audit.n_guesses)
    assert 0.45 < np.mean(rates) < 0.55  # seeded tie-breaking, not the input order (all in first)
    assert one_run_epsilon(np.zeros(500), np.zeros(500), delta=1e-5).epsilon < 0.5


@pytest.mark.parametrize("method", ["steinke", "fdp"])
def test_null_smoke(method):
    # the 200-run level is benchmarks/one_run_audit.py's; here: most null runs give 0
    positive = 0
    for seed in range(10):
        rng = np.random.default_rng(100 + seed)
        included = rng.random(1000) < 0.5
        y = rng.normal(size=1000)
        positive += (
            one_run_epsilon(y[included], y[~included], delta=1e-5, method=method).epsilon > 0
        )
    assert positive <= 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"delta": -0.1}, "delta"),
        ({"delta": 1.0}, r"delta must be in \[0, 1\)"),
        ({"delta": float("nan")}, "delta"),
        ({"delta": 0.0, "method": "fdp"}, "delta must be > 0 for method='fdp'"),
        ({"significance": 0.0}, "significance"),
        ({"significance": 1.0}, "significance"),
        ({"method": "lira"}, "method must be one of"),
        ({"selection": "best"}, "selection must be"),
        ({"selection": (1,)}, "selection must be"),
        ({"selection": (-1, 2)}, "k_plus"),
        ({"selection": (2, 1.5)}, "k_minus"),
        ({"selection": (600, 600)}, "1200 guesses but there are 1000 canaries"),
        ({"selection_fraction": 0.0}, "selection_fraction"),
        ({"selection_fraction": 1.0}, "selection_fraction"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    ins, outs = gaussian_canaries(9, 1000, 1.0)
    with pytest.raises(ValueError, match=match):
        one_run_epsilon(ins, outs, **({"delta": 1e-5} | kwargs))


def test_bad_scores_are_refused():
    with pytest.raises(ValueError, match="in_scores is empty"):
        one_run_epsilon([], [1.0, 2.0], delta=1e-5)
    with pytest.raises(ValueError, match="out_scores is empty"):
        one_run_epsilon([1.0], np.array([]), delta=1e-5)
    with pytest.raises(ValueError, match="one score per canary"):
        one_run_epsilon(np.ones((5, 2)), np.ones((5, 2)), delta=1e-5)
    with pytest.raises(ValueError, match="no finite score"):
        one_run_epsilon([np.nan], [np.inf], delta=1e-5)
    with pytest.raises(ValueError, match="leaves no canary to audit"):
        one_run_epsilon([1.0], [0.0], delta=1e-5, selection_fraction=0.9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_canaries": 0}, "n_canaries"),
        ({"n_guesses": 11}, "n_guesses must be <= n_canaries"),
        ({"n_correct": 6}, "n_correct must be <= n_guesses"),
        ({"n_correct": -1}, "n_correct"),
        ({"method": "exact"}, "method"),
    ],
)
def test_bad_counts_name_themselves(kwargs, match):
    args = {"n_canaries": 10, "n_guesses": 5, "n_correct": 4, "delta": 1e-5}
    with pytest.raises(ValueError, match=match):
        epsilon_from_guesses(**(args | kwargs))
