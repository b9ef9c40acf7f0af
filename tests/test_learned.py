"""Tests for privmon.estimators.learned: the cross-fitted logistic Bayes rule above 2-D.

Checked against analytic truth (members N(0.1·1, I) vs N(0, I): 2Φ(‖μ‖/2) − 1; members
N(0, 1.25²·I) vs N(0, I): a difference of χ² CDFs at the radius where the densities cross), by
seeded repetition under the null, and by exact counts on degenerate inputs.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from scipy.stats import chi2, norm

from privmon.estimators.advantage import accuracy_advantage, certified_advantage
from privmon.estimators.learned import (
    ROUND_ROBIN_FOLDS,
    RuleCounts,
    _splits,
    learned_rule_counts,
)
from privmon.estimators.streaming import fold_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draw(n1: int, n2: int, d: int, seed: int, *, shift: float = 0.0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    m = scale * torch.randn(n1, d, generator=gen, dtype=torch.float64) + shift
    h = torch.randn(n2, d, generator=gen, dtype=torch.float64)
    return m, h


def value(c: RuleCounts, n1: int, n2: int, prior: float = 0.5) -> float:
    return accuracy_advantage(c.tp / n1, c.fp / n2, prior)


def lower(c: RuleCounts, prior: float = 0.5) -> float:
    bound = certified_advantage(c.cert_tp, c.n1_cert, c.cert_fp, c.n2_cert, prior=prior, delta=0.05)
    return float(bound)


def scale_truth(d: int, s: float) -> float:
    """Optimal advantage at prior 1/2 of N(0, s²I) vs N(0, I): the densities cross at
    ‖x‖² = r² = d·log(s²) / (1 − 1/s²), so it is P(χ²_d ≤ r²) − P(χ²_d ≤ r²/s²)."""
    r2 = d * math.log(s * s) / (1 - 1 / (s * s))
    return float(chi2.cdf(r2, d) - chi2.cdf(r2 / (s * s), d))


def test_scale_truth_matches_monte_carlo():
    gen = torch.Generator().manual_seed(7)
    d, s2, n = 16, 1.25**2, 400_000
    a = s2 * torch.randn(n, d, generator=gen, dtype=torch.float64).pow(2).sum(1)
    b = torch.randn(n, d, generator=gen, dtype=torch.float64).pow(2).sum(1)
    log_ratio = lambda r2: -d / 2 * math.log(s2) + r2 / 2 * (1 - 1 / s2)  # noqa: E731
    mc = float((log_ratio(a) > 0).double().mean() - (log_ratio(b) > 0).double().mean())
    assert scale_truth(d, 1.25) == pytest.approx(0.46721, abs=1e-4)
    assert mc == pytest.approx(scale_truth(d, 1.25), abs=0.005)


def learnable_shift_advantage(d: int, shift: float, n_train: float) -> float:
    """Advantage of the linear rule a held-out fold can get for members N(shift·1, I) against
    N(0, I): its direction is the difference of the class means of n_train + n_train records,
    μ + ε with ε ~ N(0, 2/n_train·I), and it thresholds at the midpoint; with ‖μ + ε‖²
    concentrated at ‖μ‖² + 2d/n_train, its advantage is 2Φ(Δ/2) − 1 with
    Δ = ‖μ‖² / sqrt(‖μ‖² + 2d/n_train) (Monte Carlo over ε: 0.1440 and 0.2825 at d = 16, 64)."""
    norm2 = d * shift**2
    return float(2 * norm.cdf(norm2 / math.sqrt(norm2 + 2 * d / n_train) / 2) - 1)


# d, shift, scale, truth, the figure the mean value is held to, and how closely
TRAIN = 2000 * (ROUND_ROBIN_FOLDS // 2) / ROUND_ROBIN_FOLDS  # records per class a rule learns on
CASES = {
    "shift 16": (16, 0.1, 1.0, 2 * norm.cdf(0.1 * 4 / 2) - 1, "learnable", 0.02),
    "shift 64": (64, 0.1, 1.0, 2 * norm.cdf(0.1 * 8 / 2) - 1, "learnable", 0.02),
    "scale 16": (16, 0.0, 1.25, scale_truth(16, 1.25), "truth", 0.03),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recovers_the_truth_at_2000_per_class(case):
    """Eight seeds; one run's value spreads by ~0.02 (standard deviation over seeds, measured)
    at this size, so a single run gets 0.08 from the truth. The held-out rules learn from 4/9 of
    the records (the round robin that keeps the null spread within that of a fixed rule, module
    docstring), and on a mean shift no rule learned from 889 + 889 records gets much closer
    than :func:`learnable_shift_advantage`: 0.143 and 0.282 against truths 0.159 and 0.311. The
    mean value is held to that figure within 0.02 (measured over 40 seeds at d = 64: 0.281,
    0.029 below the truth, at the edge of the issue's 0.03); the scale change, whose learned
    rule loses little, to the truth within 0.03."""
    d, shift, scale, truth, reference, tolerance = CASES[case]
    target = learnable_shift_advantage(d, shift, TRAIN) if reference == "learnable" else truth
    values = []
    for seed in range(8):
        m, h = draw(2000, 2000, d, seed, shift=shift, scale=scale)
        c = learned_rule_counts(m, h, prior=0.5)
        values.append(value(c, 2000, 2000))
        assert abs(values[-1] - truth) <= 0.08
        assert 0 < lower(c) <= truth + 0.03
    assert abs(statistics.mean(values) - target) <= tolerance
    assert statistics.mean(values) <= truth + 0.01


def test_nothing_leaking_at_d64_is_neither_reported_nor_certified():
    """Identical N(0, I) at d = 64, 2,000 + 2,000, 20 seeded runs. The round-robin fold terms
    are uncorrelated under the null, so the value spreads at most like one rule fixed in
    advance, sqrt((1/n1 + 1/n2) / 4) = 0.016, and P(value > 0.03) ≲ 3 %, which 20 runs cannot
    tell from 5 %: value ≤ 0.03 in ≥ 18 runs here; the 240-run rate is in benchmarks/learned.py
    and the spread is tested below. The certificate is at δ = 0.05: lower ≤ 0 in ≥ 19."""
    small, uncertified, values = 0, 0, []
    for seed in range(20):
        m, h = draw(2000, 2000, 64, 100 + seed)
        c = learned_rule_counts(m, h, prior=0.5)
        values.append(value(c, 2000, 2000))
        small += values[-1] <= 0.03
        uncertified += lower(c) <= 0
    assert small >= 18
    assert uncertified >= 19
    assert abs(statistics.mean(values)) <= 0.01


def test_each_pair_of_folds_is_related_one_way_only():
    """The round-robin split: every record is held out by exactly one cross-fitted rule, which
    did not learn on it, and of any two rules at most one learned on the other's held-out fold.
    That is what makes the fold terms uncorrelated under the null (module docstring); K-fold
    cross-fitting, where each rule learns on all other folds, relates every pair both ways."""
    n1, n2, r = 1000, 700, ROUND_ROBIN_FOLDS
    train, test = _splits(n1, n2, 4, torch.device("cpu"))
    assert torch.equal(test[:r].sum(dim=0), torch.ones(n1 + n2, dtype=torch.int64))
    assert not (train & test).any()
    saw = (train[:r].double() @ test[:r].double().T) > 0  # saw[k, l]: rule k learned on fold l
    assert not (saw & saw.T).any()
    assert saw.sum(dim=1).tolist() == [r // 2] * r
    fold = fold_of(torch.cat([torch.arange(n1), torch.arange(n2)]), 4)
    assert torch.equal(test[r], fold < 2) and torch.equal(train[r], fold >= 2)


def test_null_spread_is_within_that_of_a_rule_fixed_in_advance():
    """Identical draws, 200 + 200 at d = 32, 80 seeded runs: E[value²] ≤ B² = (1/n1 + 1/n2)/4,
    the binomial variance bound of a rule fixed in advance, because the round-robin fold terms
    have mean 0 and are uncorrelated. If value ~ N(0, σ² ≤ B²), 80·mean(value²)/B² is at most a
    χ²₈₀ variable: asserted below its 99 % quantile (mean ≤ 1.40·B²). Measured: 1.08·B² on these
    80 runs, 0.88·B² over 300 (ties lower it); K-fold cross-fitting, where the pairs of folds
    that learned on each other's records correlate, gave 1.74·B² on these 80 and 1.45·B² over
    the 300."""
    runs, n = 80, 200
    bound = (1 / n + 1 / n) / 4
    squares = []
    for seed in range(runs):
        m, h = draw(n, n, 32, seed)
        squares.append(value(learned_rule_counts(m, h, prior=0.5), n, n) ** 2)
    assert statistics.mean(squares) <= chi2.ppf(0.99, runs) / runs * bound


@pytest.mark.parametrize("d", [1, 2, 3, 8, 64])
def test_mean_value_under_the_null_is_zero_in_every_dimension(d):
    """200 + 200 identical draws, 30 seeds: a rule measured on the records it learned from
    reports far more (see the next test)."""
    values = []
    for seed in range(30):
        m, h = draw(200, 200, d, 1000 * d + seed)
        values.append(value(learned_rule_counts(m, h, prior=0.5), 200, 200))
    assert abs(statistics.mean(values)) <= 0.03


def test_in_sample_measurement_would_fail_the_null_test():
    """The null test above has teeth: the same classifier fitted on all 200 + 200 records at
    d = 8 and measured on them reports a clear advantage."""
    from privmon.estimators.learned import _features, _fit, _Scaling

    values = []
    for seed in range(10):
        m, h = draw(200, 200, 8, 1000 * 8 + seed)
        x = torch.cat([m, h]).unsqueeze(0)
        y = torch.cat([torch.ones(200), torch.zeros(200)]).to(torch.float64).unsqueeze(0)
        everyone = torch.ones(1, 400, dtype=torch.float64)
        z = _Scaling.fitted(x, everyone).fits(x)
        phi = _features(z, _Scaling.fitted(z**2, everyone).fits(z**2))
        theta = _fit(phi.transpose(1, 2).contiguous(), y, everyone, torch.zeros(1))
        said = (phi @ theta.unsqueeze(-1)).squeeze() > 0
        values.append(float(said[:200].double().mean() - said[200:].double().mean()))
    assert statistics.mean(values) > 0.05


def test_constant_and_collinear_columns_never_raise():
    """A hidden layer wider than the audit set (d = 300, 200 + 200) with 50 dead units and 10
    duplicated ones: finite counts and a small value under the null."""
    m, h = draw(200, 200, 300, 3)
    for x in (m, h):
        x[:, :50] = 0.0
        x[:, 50:60] = x[:, 60:70]
    c = learned_rule_counts(m, h, prior=0.5)
    assert all(math.isfinite(v) for v in (c.tp, c.fp, c.cert_tp, c.cert_fp))
    assert abs(value(c, 200, 200)) <= 0.15
    assert lower(c) <= 0


def test_constant_columns_do_not_change_the_rule():
    m, h = draw(400, 300, 5, 4, scale=1.3)
    base = learned_rule_counts(m, h, prior=0.5)
    pad = lambda x: torch.cat([x, torch.full((x.shape[0], 3), 2.5, dtype=x.dtype)], 1)  # noqa: E731
    assert learned_rule_counts(pad(m), pad(h), prior=0.5) == base


def test_invariant_to_affine_maps_of_each_coordinate():
    m, h = draw(400, 400, 5, 5, scale=1.3)
    a = torch.tensor([1e6, -3.0, 0.5, 1e-4, 7.0], dtype=torch.float64)
    b = torch.tensor([1e3, 2.0, -5.0, 0.0, 1e4], dtype=torch.float64)
    assert learned_rule_counts(m * a + b, h * a + b, prior=0.5) == learned_rule_counts(
        m, h, prior=0.5
    )


@pytest.mark.parametrize("prior", [0.3, 0.5, 0.7])
def test_no_information_is_the_prior_rule_with_ties(prior):
    """Every score equal: the rule is the prior's alone. At 1/2 every decision is a tie (1/2
    each for the cross-fitted rules, non-member for the certificate's); otherwise everyone is
    called the majority class. The value is then |2p − 1|."""
    n1, n2 = 50, 60
    c = learned_rule_counts(
        torch.ones(n1, 4, dtype=torch.float64), torch.ones(n2, 4, dtype=torch.float64), prior=prior
    )
    said = 0.5 if prior == 0.5 else float(prior > 0.5)
    assert (c.tp, c.fp) == (said * n1, said * n2)
    assert (c.cert_tp, c.cert_fp) == (
        float(prior > 0.5) * c.n1_cert,
        float(prior > 0.5) * c.n2_cert,
    )
    assert value(c, n1, n2, prior) == pytest.approx(abs(2 * prior - 1))


def test_certificate_folds_are_the_first_two():
    n1, n2 = 37, 53
    m, h = draw(n1, n2, 3, 6, shift=1.0)
    c = learned_rule_counts(m, h, prior=0.5, folds=5)
    assert c.n1_cert == int((fold_of(torch.arange(n1), 5) < 2).sum())
    assert c.n2_cert == int((fold_of(torch.arange(n2), 5) < 2).sum())
    assert 0 <= c.cert_tp <= c.n1_cert and 0 <= c.cert_fp <= c.n2_cert
    assert 0 <= c.tp <= n1 and 0 <= c.fp <= n2


def test_prior_moves_the_threshold():
    """A weak leak at prior 0.8: the rule calls more records members than at 1/2."""
    m, h = draw(1000, 1000, 8, 8, shift=0.1)
    even = learned_rule_counts(m, h, prior=0.5)
    high = learned_rule_counts(m, h, prior=0.8)
    assert high.tp > even.tp and high.fp > even.fp
    assert value(high, 1000, 1000, 0.8) >= 0.6 - 0.02


@pytest.mark.parametrize(("n1", "n2"), [(1, 1), (1, 5), (2, 3), (6, 1)])
def test_tiny_classes(n1, n2):
    """Folds whose training records lack a class learn nothing (the prior's rule), no error."""
    m, h = draw(n1, n2, 3, 9)
    c = learned_rule_counts(m, h, prior=0.5)
    assert 0 <= c.tp <= n1 and 0 <= c.fp <= n2


def test_deterministic():
    m, h = draw(300, 300, 6, 10, shift=0.2)
    assert learned_rule_counts(m, h, prior=0.5) == learned_rule_counts(m, h, prior=0.5)
