"""The p-values of the mechanism checks under their null hypotheses, on seeded simulations: the
noise test's p-values are uniform when the noise is N(0, σ²C²); the sampling tests' are uniform
when the rows are Binomial(N, q) with N known, and conservative (P(p ≤ α) ≤ α) over the interval
of N that Opacus' expected batch size allows; and each test has the power the faults need.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from privmon.audit.mechanism_math import (
    RowCounts,
    binomial_population,
    dispersion_p_value,
    mean_p_value,
    noise_p_value,
)

RUNS = 400
KS_LEVEL = 1e-3  # a seeded KS test of uniformity rejects below this


def _counts(rows: np.ndarray, rates: np.ndarray) -> RowCounts:
    counts = RowCounts()
    for k, q in zip(rows, rates, strict=True):
        counts.add(int(k), float(q))
    return counts


def test_noise_p_values_are_uniform_under_the_accounted_noise():
    rng = np.random.default_rng(0)
    sigma_c = 2.5
    p = []
    for _ in range(RUNS):
        z = rng.normal(0, sigma_c, size=(30, 200))  # 30 steps of 200 values
        p.append(noise_p_value(float((z**2).sum() / sigma_c**2), z.size))
    assert stats.kstest(p, "uniform").pvalue > KS_LEVEL


def test_noise_test_sees_a_little_less_noise_and_not_more():
    rng = np.random.default_rng(1)
    z = rng.normal(0, 0.95, size=200_000)  # 5 % less noise than accounted
    assert noise_p_value(float((z**2).sum()), z.size) < 1e-20
    z = rng.normal(0, 1.5, size=200_000)  # more noise is no privacy fault
    assert noise_p_value(float((z**2).sum()), z.size) == pytest.approx(1.0)
    assert noise_p_value(0.0, 1000) == 0.0
    assert noise_p_value(5.0, 0) == 1.0


@pytest.mark.parametrize("test", [mean_p_value, dispersion_p_value])
@pytest.mark.parametrize(("population", "rate", "steps"), [(600, 0.1, 40), (5000, 0.002, 60)])
def test_sampling_p_values_are_uniform_when_n_is_known(test, population, rate, steps):
    rng = np.random.default_rng(2)
    rates = np.full(steps, rate)
    p = [
        test(_counts(rng.binomial(population, rate, steps), rates), population, population)
        for _ in range(RUNS)
    ]
    assert stats.kstest(p, "uniform").pvalue > KS_LEVEL


@pytest.mark.parametrize("test", [mean_p_value, dispersion_p_value])
def test_sampling_p_values_are_conservative_over_the_interval_of_n(test):
    """N anywhere in [E/q, (E+1)/q): the p-value is the largest over the interval, so
    P(p ≤ α) ≤ α for every α (up to the simulation's binomial noise)."""
    rng = np.random.default_rng(3)
    expected, rate, steps = 60, 0.1, 50
    n_low, n_high = binomial_population(expected, rate)
    p = np.array(
        [
            test(_counts(rng.binomial(int(n), rate, steps), np.full(steps, rate)), n_low, n_high)
            for n in rng.integers(600, 610, RUNS)
        ]
    )
    for alpha in (0.01, 0.05, 0.1, 0.5):
        ceiling = stats.binom.ppf(0.999, RUNS, alpha) / RUNS
        assert np.mean(p <= alpha) <= ceiling, alpha


def test_sampling_p_values_with_accumulated_rates():
    """Steps at q and at 2q (two accumulated batches, as Opacus' accountant counts them)."""
    rng = np.random.default_rng(4)
    rates = np.where(np.arange(60) % 3 == 0, 0.2, 0.1)
    p = [
        (mean_p_value(c, 600, 600), dispersion_p_value(c, 600, 600))
        for c in (_counts(rng.binomial(600, rates), rates) for _ in range(RUNS))
    ]
    for column in zip(*p, strict=True):
        assert stats.kstest(column, "uniform").pvalue > KS_LEVEL


@pytest.mark.parametrize(
    ("rows", "test"),
    [
        (lambda rng: np.full(40, 60), dispersion_p_value),  # fixed batches (shuffling)
        (lambda rng: np.full(40, 600), mean_p_value),  # every record every step
        (lambda rng: rng.binomial(600, 0.2, 40), mean_p_value),  # twice the rate
        (lambda rng: 4 * rng.binomial(600, 0.1, 40), mean_p_value),  # 4 rows per record
        (lambda rng: 4 * rng.binomial(600, 0.025, 40), dispersion_p_value),  # same mean, 4×4 var
    ],
    ids=["fixed", "full-batch", "double-rate", "four-views", "four-views-at-q/4"],
)
def test_the_sampling_faults_give_tiny_p_values(rows, test):
    counts = _counts(rows(np.random.default_rng(5)), np.full(40, 0.1))
    assert test(counts, *binomial_population(60, 0.1)) < 1e-6


def test_row_counts_edge_cases_and_state():
    counts = RowCounts()
    assert mean_p_value(counts, 10, 20) == dispersion_p_value(counts, 10, 20) == 1.0
    counts.add(50, 1.0)  # q = 1: a full batch carries no test
    assert counts.steps == 0
    for k in (8, 12, 9):
        counts.add(k, 0.1)
    again = RowCounts()
    again.load(counts.state())
    assert again.state() == counts.state()
    assert (again.k_min, again.k_max, again.steps) == (8, 12, 3)
    assert counts.dispersion(100) == pytest.approx(sum((k - 10) ** 2 / 9 for k in (8, 12, 9)))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000), st.integers(1, 5_000))
def test_the_population_interval_holds_opacus_dataset_size(n, batch):
    """``make_private``: q = 1 / len(loader), E = int(N q); N lies in the interval."""
    rate = 1 / math.ceil(n / batch)
    expected = int(n * rate)
    low, high = binomial_population(expected, rate)
    assert low <= n <= high
