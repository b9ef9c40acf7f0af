"""Tests for privmon.estimators.learned: the cross-fitted logistic Bayes rule above 2-D.

Checked against analytic truth (members N(0.1·1, I) vs N(0, I): 2Φ(‖μ‖/2) − 1; members
N(0, 1.25²·I) vs N(0, I): a difference of χ² CDFs at the radius where the densities cross), by
seeded repetition under the null, and by exact counts on degenerate inputs.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from scipy.special import softmax as scipy_softmax
from scipy.stats import chi2, chi2_contingency, ks_2samp, kstwobign, norm
from scipy.stats import entropy as scipy_entropy
from sklearn.linear_model import LinearRegression

from privmon import analyse, optimal_advantage
from privmon.estimators.certificate import certified_advantage
from privmon.estimators.estimates import accuracy_advantage
from privmon.estimators.folds import HIGH_DIM_CERTIFY_FOLDS, fold_of
from privmon.estimators.learned import (
    SELECTION_LEVEL,
    RuleCounts,
    _block_p_values,
    _choice,
    _chosen_features,
    _score_tests,
    _splits,
    _summaries,
    _threshold_rules,
    learned_rule_counts,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draw(n1: int, n2: int, d: int, seed: int, *, shift: float = 0.0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    m = scale * torch.randn(n1, d, generator=gen, dtype=torch.float64) + shift
    h = torch.randn(n2, d, generator=gen, dtype=torch.float64)
    return m, h


def value(c: RuleCounts, n1: int, n2: int, prior: float = 0.5) -> float:
    return accuracy_advantage(c.tp / n1, c.fp / n2, prior)


def lower(c: RuleCounts, prior: float = 0.5) -> float:
    """The larger of the certificates, each at δ/2 = 0.025 (what ``optimal_advantage`` reports)."""
    bounds = [
        certified_advantage(tp, n1, fp, n2, prior=prior, delta=0.05 / len(c.cert_tp))
        for tp, n1, fp, n2 in zip(c.cert_tp, c.n1_cert, c.cert_fp, c.n2_cert, strict=True)
    ]
    return float(max(bounds))


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


# d, shift, scale, truth
TRAIN = 2000 * 3 / 4  # records per class a cross-fitted rule learns on (K = 4 folds)
CASES = {
    "shift 16": (16, 0.1, 1.0, 2 * norm.cdf(0.1 * 4 / 2) - 1),
    "shift 64": (64, 0.1, 1.0, 2 * norm.cdf(0.1 * 8 / 2) - 1),
    "scale 16": (16, 0.0, 1.25, scale_truth(16, 1.25)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recovers_the_truth_at_2000_per_class(case):
    """Eight seeds; one run's value spreads by ~0.015 (standard deviation over seeds, measured)
    at this size, so a single run gets 0.08 from the truth. The mean value is held to the
    truth within 0.03 (the issue's bar) and, for the mean shifts, to
    :func:`learnable_shift_advantage` at 1,500 + 1,500 training records within 0.02: no rule
    learned from the 3/4 of the records a cross-fitted rule sees gets much closer to the truth
    (0.150 and 0.293 against 0.159 and 0.311). Measured means over 20 seeds: 0.146, 0.297 and
    0.467 (truth 0.467)."""
    d, shift, scale, truth = CASES[case]
    values = []
    for seed in range(8):
        m, h = draw(2000, 2000, d, seed, shift=shift, scale=scale)
        c = learned_rule_counts(m, h, prior=0.5)
        values.append(value(c, 2000, 2000))
        assert abs(values[-1] - truth) <= 0.08
        assert 0 < lower(c) <= truth + 0.03
    assert abs(statistics.mean(values) - truth) <= 0.03
    if shift:
        assert abs(statistics.mean(values) - learnable_shift_advantage(d, shift, TRAIN)) <= 0.02
    assert statistics.mean(values) <= truth + 0.01


def test_nothing_leaking_at_d64_is_neither_reported_nor_certified():
    """Identical N(0, I) at d = 64, 2,000 + 2,000, 20 seeded runs. Most rules keep no block
    (their score tests do not reject), so the value is mostly exactly 0: measured standard
    deviation 0.009 and no run above 0.03 in 240 (benchmarks/learned.py). Asserted: value ≤ 0.03
    in ≥ 19 runs, the certificate (δ = 0.05) ≤ 0 in ≥ 19."""
    small, uncertified, values = 0, 0, []
    for seed in range(20):
        m, h = draw(2000, 2000, 64, 100 + seed)
        c = learned_rule_counts(m, h, prior=0.5)
        values.append(value(c, 2000, 2000))
        small += values[-1] <= 0.03
        uncertified += lower(c) <= 0
    assert small >= 19
    assert uncertified >= 19
    assert abs(statistics.mean(values)) <= 0.01


def test_each_record_is_held_out_once_by_a_rule_that_did_not_learn_on_it():
    """K-fold cross-fitting on the caller's folds, and the certificates' rules: one learned on
    folds 2..K−1 and applied to folds 0-1, one learned on fold 3..K−1 and applied to 0-2."""
    n1, n2, k = 1000, 700, 4
    train, test = _splits(n1, n2, k, torch.device("cpu"))
    fold = fold_of(torch.cat([torch.arange(n1), torch.arange(n2)]), k)
    assert torch.equal(test[:k].sum(dim=0), torch.ones(n1 + n2, dtype=torch.int64))
    assert not (train & test).any()
    for rule in range(k):
        assert torch.equal(test[rule], fold == rule)
    assert HIGH_DIM_CERTIFY_FOLDS == ((0, 1), (0, 1, 2))
    assert torch.equal(test[k], fold < 2) and torch.equal(train[k], fold >= 2)
    assert torch.equal(test[k + 1], fold < 3) and torch.equal(train[k + 1], fold >= 3)


def _training_features(x: torch.Tensor, y: torch.Tensor):
    """One fit over all rows of x (T, d): its [1, z, z²] features (1, F, T), labels, weights
    and Gram matrix, as learned_rule_counts builds them for each fit."""
    from privmon.estimators.learned import _features, _Scaling

    x = x.unsqueeze(0)
    everyone = torch.ones(1, x.shape[1], dtype=torch.float64)
    z = _Scaling.fitted(x, everyone).fits(x)
    phi = _features(z, _Scaling.fitted(z**2, everyone).fits(z**2)).transpose(1, 2).contiguous()
    y = y.to(torch.float64).unsqueeze(0)
    return phi, y, everyone, torch.bmm(phi, phi.mT)


def _chosen_blocks(phi, y, weight, gram):
    """The logistic features a cross-fitted rule keeps when the block sets are its only
    candidates: the one whose score test has the smallest p-value, if below the level."""
    choice = _choice(_block_p_values(phi, y, weight, gram), gated=torch.ones(1, dtype=torch.bool))
    return _chosen_features(choice, phi.shape[1], dtype=phi.dtype, device=phi.device)


def test_score_test_of_one_binary_column_is_pearsons_chi_square():
    """For one binary column the score test against the intercept alone is Pearson's χ² of the
    2 × 2 table (scipy, no continuity correction); its square is collinear with it, so the
    quadratic block and both blocks have the same statistic with 1 degree of freedom (the
    three columns are the same feature repeated)."""
    gen = torch.Generator().manual_seed(3)
    y = (torch.rand(300, generator=gen) < 0.4).to(torch.int64)
    column = (torch.rand(300, generator=gen) < 0.3 + 0.2 * y).to(torch.float64)
    x = torch.stack([column, column, column], dim=1)  # d = 3, all columns equal
    statistic, dof = _score_tests(*_training_features(x, y))
    table = [[int(((column == a) & (y == b)).sum()) for b in (0, 1)] for a in (0, 1)]
    pearson = chi2_contingency(table, correction=False)[0]
    assert dof.tolist() == [[1.0, 1.0, 1.0]]
    assert statistic[0].tolist() == pytest.approx([pearson] * 3, rel=1e-9)


def test_score_test_is_n_times_r_squared():
    """At the intercept-only fit Rao's statistic is n·R² of the least-squares regression of the
    0/1 labels on the block's columns (scikit-learn): the scores, the squares of the centred
    scores, or both; the block's rank is the degrees of freedom: constant columns drop out."""
    gen = torch.Generator().manual_seed(4)
    n, d = 400, 6
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    x[:, 5] = 3.0  # a dead unit
    y = (torch.rand(n, generator=gen) < torch.sigmoid(x[:, 0] + x[:, 1] ** 2 - 1)).to(torch.int64)
    statistic, dof = _score_tests(*_training_features(x, y))
    live = x[:, :5].numpy()
    squares = (live - live.mean(axis=0)) ** 2
    for j, columns in enumerate([live, squares, np.hstack([live, squares])]):
        r2 = LinearRegression().fit(columns, y.numpy()).score(columns, y.numpy())
        assert float(statistic[0, j]) == pytest.approx(n * r2, rel=1e-8)
    assert dof.tolist() == [[5.0, 5.0, 10.0]]


@pytest.mark.parametrize(
    ("shift", "scale", "chosen"),
    [(0.3, 1.0, "linear"), (0.0, 1.5, "quadratic"), (0.5, 1.5, "both")],
)
def test_the_block_that_carries_the_leak_is_chosen(shift, scale, chosen):
    """800 + 800 at d = 8: a mean shift chooses z, a scale change z², both together both; the
    columns of the unchosen block are 0 in every fit."""
    m, h = draw(800, 800, 8, 11, shift=shift, scale=scale)
    y = torch.cat([torch.ones(800), torch.zeros(800)]).to(torch.int64)
    features = _chosen_blocks(*_training_features(torch.cat([m, h]), y))[0]
    expected = {"linear": [1] * 8 + [0] * 8, "quadratic": [0] * 8 + [1] * 8, "both": [1] * 16}
    assert features.tolist() == [1.0] + [float(f) for f in expected[chosen]]


def test_blocks_are_chosen_at_the_selection_level_under_the_null():
    """Identical draws (300 + 300, d = 6, 400 seeds): each of the three score tests rejects
    with probability ≈ SELECTION_LEVEL, so some block is chosen in at most 3·5 % of fits and
    at least 5 %; a binomial 99.9 % band around what was measured (12 %) would be too tight
    to be a property, so the assertion is the union bound and the single test's level."""
    chosen = 0
    y = torch.cat([torch.ones(300), torch.zeros(300)]).to(torch.int64)
    for seed in range(400):
        m, h = draw(300, 300, 6, 5000 + seed)
        chosen += int(_chosen_blocks(*_training_features(torch.cat([m, h]), y))[0, 1:].any())
    assert 400 * SELECTION_LEVEL * 0.6 <= chosen <= 400 * 3 * SELECTION_LEVEL * 1.25


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
    from privmon.estimators.learned import _fit

    values = []
    labels = torch.cat([torch.ones(200), torch.zeros(200)]).to(torch.int64)
    for seed in range(10):
        m, h = draw(200, 200, 8, 1000 * 8 + seed)
        phi, y, everyone, gram = _training_features(torch.cat([m, h]), labels)
        theta = _fit(phi, y, everyone, torch.zeros(1), gram)
        said = (theta @ phi[0]).squeeze() > 0
        values.append(float(said[:200].double().mean() - said[200:].double().mean()))
    assert statistics.mean(values) > 0.05


def test_a_block_the_evidence_finds_unbounded_is_pruned_to_zero():
    """A mean shift at d = 3 fitted with both blocks: the evidence sends the noise block z²'s
    penalty to the range's upper end, and its coefficients are then exactly 0 (not merely
    small), while the linear block that carries the shift is kept."""
    from privmon.estimators.learned import _fit

    m, h = draw(2000, 2000, 3, 5, shift=0.5)
    labels = torch.cat([torch.ones(2000), torch.zeros(2000)])
    phi, y, everyone, gram = _training_features(torch.cat([m, h]), labels)
    theta = _fit(phi, y, everyone, torch.zeros(1), gram)[0]
    assert theta[4:].tolist() == [0.0, 0.0, 0.0]
    assert bool((theta[1:4] > 0.2).all())


def test_constant_and_collinear_columns_never_raise():
    """A hidden layer wider than the audit set (d = 300, 200 + 200) with 50 dead units and 10
    duplicated ones: finite counts and a small value under the null."""
    m, h = draw(200, 200, 300, 3)
    for x in (m, h):
        x[:, :50] = 0.0
        x[:, 50:60] = x[:, 60:70]
    c = learned_rule_counts(m, h, prior=0.5)
    assert all(math.isfinite(v) for v in (c.tp, c.fp, *c.cert_tp, *c.cert_fp))
    assert abs(value(c, 200, 200)) <= 0.15
    assert lower(c) <= 0


def test_constant_columns_do_not_change_the_rule():
    m, h = draw(400, 300, 5, 4, scale=1.3)
    base = learned_rule_counts(m, h, prior=0.5)
    pad = lambda x: torch.cat([x, torch.full((x.shape[0], 3), 2.5, dtype=x.dtype)], 1)  # noqa: E731
    assert learned_rule_counts(pad(m), pad(h), prior=0.5) == base


def test_the_logistic_candidates_are_invariant_to_affine_maps_of_each_coordinate():
    """The block sets read each coordinate through its standardisation: their score tests are
    the same after an affine map of each coordinate. The summaries read the scores in their own
    units (the entropy of logits depends on their scale), so the rule as a whole is the same
    only where, as here (a scale change, which z² carries), a logistic candidate wins."""
    m, h = draw(400, 400, 5, 5, scale=1.3)
    a = torch.tensor([1e6, -3.0, 0.5, 1e-4, 7.0], dtype=torch.float64)
    b = torch.tensor([1e3, 2.0, -5.0, 0.0, 1e4], dtype=torch.float64)
    y = torch.cat([torch.ones(400), torch.zeros(400)]).to(torch.int64)
    mapped = _block_p_values(*_training_features(torch.cat([m, h]) * a + b, y))
    assert mapped[0].tolist() == pytest.approx(
        _block_p_values(*_training_features(torch.cat([m, h]), y))[0].tolist(), rel=1e-6
    )
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
    side = float(prior > 0.5)
    assert c.cert_tp == tuple(side * n for n in c.n1_cert)
    assert c.cert_fp == tuple(side * n for n in c.n2_cert)
    assert value(c, n1, n2, prior) == pytest.approx(abs(2 * prior - 1))


def test_certificate_folds_are_the_first_two_and_three():
    n1, n2 = 37, 53
    m, h = draw(n1, n2, 3, 6, shift=1.0)
    c = learned_rule_counts(m, h, prior=0.5, folds=5)
    for j, last in enumerate((2, 3)):
        assert c.n1_cert[j] == int((fold_of(torch.arange(n1), 5) < last).sum())
        assert c.n2_cert[j] == int((fold_of(torch.arange(n2), 5) < last).sum())
        assert 0 <= c.cert_tp[j] <= c.n1_cert[j] and 0 <= c.cert_fp[j] <= c.n2_cert[j]
    assert 0 <= c.tp <= n1 and 0 <= c.fp <= n2


def test_prior_moves_the_threshold():
    """A weak leak at prior 0.8: the rule calls more records members than at 1/2."""
    m, h = draw(1000, 1000, 8, 8, shift=0.1)
    even = learned_rule_counts(m, h, prior=0.5)
    high = learned_rule_counts(m, h, prior=0.8)
    assert high.tp > even.tp and high.fp > even.fp
    assert value(high, 1000, 1000, 0.8) >= 0.6 - 0.02


@pytest.mark.parametrize(("n1", "n2"), [(1, 1), (1, 5), (2, 3), (6, 1), (3, 12)])
def test_tiny_classes(n1, n2):
    """Folds whose training records lack a class learn nothing (the prior's rule), no error:
    with so few records no cross-fitted rule's test rejects, so every held-out record is a tie
    (1/2). A certificate's rule takes its best candidate whatever its p-value (its certificate
    holds whatever the rule), so it may call a record a member, but nothing is certified."""
    m, h = draw(n1, n2, 3, 9)
    c = learned_rule_counts(m, h, prior=0.5)
    assert (c.tp, c.fp) == (n1 / 2, n2 / 2)
    for tp, fp, n1c, n2c in zip(c.cert_tp, c.cert_fp, c.n1_cert, c.n2_cert, strict=True):
        assert 0 <= tp <= n1c and 0 <= fp <= n2c
    assert lower(c) <= 0


def test_deterministic():
    m, h = draw(300, 300, 6, 10, shift=0.2)
    assert learned_rule_counts(m, h, prior=0.5) == learned_rule_counts(m, h, prior=0.5)


def test_unequal_class_sizes_keep_the_prior_threshold():
    """600 members against 1800 non-members (d = 4, mean shift 0.5 per coordinate): the fit's
    class balance log(n1/n2) is taken out of its logit, so the rule is the one at prior 1/2 and
    its value is near the truth 2Φ(‖δ‖/2) − 1 = 2Φ(1/2) − 1 = 0.383 (a rule keeping the 1:3
    balance calls too few members: 0.227 with it left in). Pinned: 0.384444."""
    m, h = draw(600, 1800, 4, 0, shift=0.5)
    got = optimal_advantage(m, h).value
    assert got == pytest.approx(0.3844444444444446, abs=1e-12)
    assert got == pytest.approx(2 * norm.cdf(0.5) - 1, abs=0.02)


# -- the summaries' threshold rules ----------------------------------------------------------


def _softmax_entropy(x: np.ndarray) -> np.ndarray:
    """The entropy of each row's softmax, by scipy."""
    return scipy_entropy(scipy_softmax(x, axis=1), axis=1)


def test_summaries_are_entropy_max_and_log_norm_without_overflow():
    gen = np.random.default_rng(0)
    x = gen.normal(0, 3, (50, 10))
    got = _summaries(torch.tensor(x)).numpy()
    assert got[:, 0] == pytest.approx(_softmax_entropy(x), abs=1e-12)
    assert got[:, 1].tolist() == x.max(axis=1).tolist()
    assert got[:, 2] == pytest.approx(np.log(np.linalg.norm(x, axis=1)), abs=1e-12)
    # 1e300 (its square overflows), a row of zeros, subnormals: finite where defined
    rows = [[1e300, -1e300, 0.0], [0.0, 0.0, 0.0], [5e-320, 0.0, 1e-320]]
    got = _summaries(torch.tensor(rows, dtype=torch.float64))
    assert got[0].tolist() == pytest.approx([0.0, 1e300, math.log(1e300) + 0.5 * math.log(2)])
    assert got[1].tolist() == pytest.approx([math.log(3), 0.0, -math.inf], rel=1e-15)
    assert got[2, 2].item() == pytest.approx(math.log(math.hypot(5e-320, 1e-320)), rel=1e-3)


def _one_fit(values: torch.Tensor, y: torch.Tensor, prior: float = 0.5):
    """The threshold rules of one fit over every record."""
    n = values.shape[0]
    return _threshold_rules(
        values, torch.arange(n).unsqueeze(0), torch.ones(1, n, dtype=torch.float64),
        y.to(torch.float64).unsqueeze(0), prior,
    )  # fmt: skip


@pytest.mark.parametrize("prior", [0.5, 0.3])
def test_threshold_rule_is_the_best_cut_and_kolmogorov_smirnov_selects_it(prior):
    """On one fit's records: the cut and side maximise the accuracy advantage over every cut
    between distinct values (brute force), the statistic is scipy's two-sample KS statistic
    and the p-value Kolmogorov's limiting distribution at D·sqrt(n1·n2/(n1 + n2)). The values
    are rounded so that they tie."""
    gen = np.random.default_rng(1)
    member = np.round(gen.normal(0.3, 1, 120), 1)
    other = np.round(gen.normal(0.0, 1.3, 90), 1)
    values = torch.tensor(np.concatenate([member, other])).unsqueeze(1)
    y = torch.cat([torch.ones(120), torch.zeros(90)])
    rules = _one_fit(values, y, prior)

    def advantage(called_member, on):
        return 2 * prior * called_member(on[:120]).mean() - 2 * (1 - prior) * called_member(
            on[120:]
        ).mean() + 1 - 2 * prior  # fmt: skip

    pooled = np.sort(np.unique(values.numpy()))
    cuts = np.concatenate([(pooled[:-1] + pooled[1:]) / 2, [np.inf]])
    best = max(
        max(advantage(lambda v, c=c: v <= c, values.numpy()[:, 0]),
            advantage(lambda v, c=c: v > c, values.numpy()[:, 0]))
        for c in cuts
    )  # fmt: skip
    cut, high = float(rules.cut[0, 0]), bool(rules.high[0, 0])
    got = advantage((lambda v: v > cut) if high else (lambda v: v <= cut), values.numpy()[:, 0])
    assert got == pytest.approx(best, abs=1e-12)
    assert cut in cuts.tolist()
    d = ks_2samp(member, other).statistic
    assert float(rules.p_value[0, 0]) == pytest.approx(
        kstwobign.sf(d * math.sqrt(120 * 90 / 210)), rel=1e-9
    )


def test_threshold_rules_reject_at_the_selection_level_under_the_null():
    """Identical draws (300 + 300, d = 10, 400 seeds): each summary's KS test rejects at 5 % in
    at most about 5 % of fits (the limiting distribution is a little conservative at this size:
    measured 20, 12 and 15 of 400), and not never."""
    rejected = np.zeros(3)
    y = torch.cat([torch.ones(300), torch.zeros(300)])
    for seed in range(400):
        m, h = draw(300, 300, 10, 7000 + seed)
        p = _one_fit(_summaries(torch.cat([m, h])), y).p_value[0].numpy()
        rejected += p < SELECTION_LEVEL
    assert (rejected >= 400 * SELECTION_LEVEL * 0.4).all()
    assert (rejected <= 400 * SELECTION_LEVEL * 1.5).all()


def planted_logits(n: int, seed: int, *, member: bool) -> torch.Tensor:
    """10-d logits of a model that memorised its members: one coordinate (the label, uniform)
    raised by 6 for members, by 6 or (a quarter of non-members) 1.5 for non-members. The leak
    is in the prediction's confidence; no coordinate's distribution tells the two apart."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=gen, dtype=torch.float64)
    label = torch.randint(0, 10, (n,), generator=gen)
    unsure = torch.rand(n, generator=gen) < 0.25
    raised = torch.where(unsure & (not member), 1.5, 6.0).to(torch.float64)
    x[torch.arange(n), label] += raised
    return x


def test_a_leak_one_summary_shows_is_read_at_least_as_well_as_that_summary_alone():
    """The planted logits at 200 + 200 over 8 seeds: the 10-d value and certified bound are at
    least those of the 1-D entropy of the same records (δ = 0.05, split over two certificates
    in either case, so the 10-d figure spends no more of it). Measured means: value 0.239
    against 0.225, lower 0.112 against 0.091; without the summaries' rules the 10-d rule read
    0.127 and 0.029."""
    high_dim, entropy = [], []
    for seed in range(8):
        m, h = (
            planted_logits(200, 2 * seed, member=True),
            planted_logits(200, 2 * seed + 1, member=False),
        )
        high_dim.append(optimal_advantage(m, h, delta=0.05))
        summary = _softmax_entropy(torch.cat([m, h]).numpy())
        entropy.append(optimal_advantage(summary[:200], summary[200:], delta=0.05))
    for figure in ("value", "lower"):
        ours = statistics.mean(getattr(e, figure) for e in high_dim)
        alone = statistics.mean(getattr(e, figure) for e in entropy)
        assert ours >= alone - 0.01, figure
    assert statistics.mean(e.value for e in high_dim) > 0.2


def test_nothing_leaking_in_heavy_tailed_logits_is_certified_at_most_at_delta():
    """Members and non-members drawn alike, 10-d Student-t₂ logits scaled by 4 (heavy tails:
    some rows far out), 200 + 200, 100 seeds: the certified bound (δ = 0.05) is above 0 in at
    most 13 runs (the binomial's 99.9 % quantile at 5 %; measured 4), and the value is 0 on
    average."""
    certified, values = 0, []
    for seed in range(100):
        gen = torch.Generator().manual_seed(9000 + seed)
        # Student-t₂: a normal over the root of χ²₂ / 2, an exponential
        spread = -torch.rand(400, 1, generator=gen, dtype=torch.float64).log()
        x = 4 * torch.randn(400, 10, generator=gen, dtype=torch.float64) / spread.sqrt()
        c = learned_rule_counts(x[:200], x[200:], prior=0.5)
        certified += lower(c) > 0
        values.append(value(c, 200, 200))
    assert certified <= 13
    assert abs(statistics.mean(values)) <= 0.02


def test_the_summaries_read_the_callers_units():
    """``scale`` (the magnitude scaling of extreme columns) is divided out for the summaries:
    scores multiplied by powers of two and passed with them give the counts of the scores as
    they were."""
    m, h = planted_logits(200, 0, member=True), planted_logits(200, 1, member=False)
    scale = torch.tensor([2.0**-70] * 5 + [2.0**80] * 5, dtype=torch.float64)
    assert learned_rule_counts(m * scale, h * scale, prior=0.5, scale=scale) == (
        learned_rule_counts(m, h, prior=0.5)
    )


def test_one_and_two_dimensional_figures_do_not_change(monkeypatch):
    """The learned rule and its summaries serve above 2-D only: in 1-2 D no figure reads them
    (the learned rule is made to raise), and the figures are those pinned before they were
    added: bit for bit on the stack they were pinned on, to 1e-12 on others (numpy / scipy
    releases round the certificates' last digits differently)."""
    import privmon.estimators.in_memory as in_memory

    def refuse(*args, **kwargs):
        raise AssertionError("the learned rule ran on 1-2-D scores")

    monkeypatch.setattr(in_memory, "learned_rule_counts", refuse)
    gen = np.random.default_rng(40)
    m1, h1 = gen.normal(0.4, 1, 300), gen.normal(0, 1, 300)
    m2, h2 = gen.normal(0.5, 1, (300, 2)), gen.normal(0, 1, (300, 2))
    pinned = {
        "1d": (0.1433333333333333, 0.029372387240925946, 0.05869452545127318,
               0.1466666666666665, 0.020256032672360202, 0.04957907301183484),
        "2d": (0.18999999999999995, 0.009371062491965176, 0.04521605245788596,
               0.18666666666666676, 0.02983175384442438, 0.06568161741480871),
    }  # fmt: skip
    for name, (m, h) in {"1d": (m1, h1), "2d": (m2, h2)}.items():
        result = analyse(m, h, certify_delta=0.01)
        got = tuple(
            getattr(result.estimates[method], figure)
            for method in ("histogram", "kde")
            for figure in ("value", "lower", "lower_check")
        )
        np.testing.assert_allclose(got, pinned[name], rtol=1e-12, atol=0, err_msg=name)


def test_rows_of_zeros_are_told_apart_by_their_norm():
    """A dead layer on some records: 60 % of members' rows and 20 % of non-members' are all 0
    (log norm −inf), the rest N(0, I) alike, at d = 6. The norm's threshold rule puts the rows
    of zeros on one side: advantage 0.4 (measured 0.41 from 500 + 500), finite counts."""
    m, h = draw(500, 500, 6, 12)
    gen = torch.Generator().manual_seed(13)
    m[torch.rand(500, generator=gen) < 0.6] = 0.0
    h[torch.rand(500, generator=gen) < 0.2] = 0.0
    c = learned_rule_counts(m, h, prior=0.5)
    assert value(c, 500, 500) == pytest.approx(0.4, abs=0.06)
    assert lower(c) > 0.25
