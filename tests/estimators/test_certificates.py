"""Certified means certified: the certificate of a rule fixed in advance holds at its level
(exactly, by enumerating every outcome, and over seeded null runs), what it can detect is what
it detects; over a run, the monitor equals privmon.analyse at its check's share of δ, the
shares sum to at most δ, null runs certify leakage (or raise a DP alarm) in at most a δ
fraction of runs, and a failing query or method leaves the others' figures in place."""

import logging
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import RDPAccountant
from scipy.stats import beta, binom, norm

import privmon
from privmon.estimators import spending
from privmon.estimators.certificate import (
    audit_records_needed,
    certificates_of,
    certified_advantage,
    certified_records,
    detectable_advantage,
    poisson_binomial_lower,
    pooled_share,
    pools,
)
from privmon.estimators.folds import fold_of
from privmon.estimators.spending import check_delta
from privmon.queries import CallableQuery

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the certificate of one rule ----------------------------------------------------------------


def poisson_binomial_pmf(rates) -> np.ndarray:
    """P(S = s), s = 0..n, for S the successes of independent Bernoulli trials with ``rates``."""
    pmf = np.ones(1)
    for rate in rates:
        pmf = np.convolve(pmf, [1 - rate, rate])
    return pmf


rate_lists = st.one_of(
    st.lists(st.floats(0, 1), min_size=1, max_size=40),
    # two groups of trials, as a rule's calls on members and on non-members
    st.tuples(st.integers(1, 30), st.floats(0, 1), st.integers(1, 30), st.floats(0, 1)).map(
        lambda g: [g[1]] * g[0] + [g[3]] * g[2]
    ),
)


@settings(max_examples=200, deadline=None)
@given(rates=rate_lists)
def test_a_poisson_binomial_tail_is_below_the_binomials_beyond_its_mean_plus_one(rates):
    # Hoeffding (1956), Theorem 4: P(S ≥ c) ≤ P(Bin(n, p̄) ≥ c) for c ≥ n·p̄ + 1
    n, mean = len(rates), float(np.mean(rates))
    tail = np.cumsum(poisson_binomial_pmf(rates)[::-1])[::-1]  # P(S ≥ c), c = 0..n
    c = np.arange(n + 1)
    beyond = c >= n * mean + 1
    assert np.all(tail[beyond] <= binom.sf(c[beyond] - 1, n, mean) + 1e-12)


def test_a_binomial_exceeds_its_mean_with_probability_above_a_quarter():
    # Greenberg and Mohri (2014) for q > 1/n; q = 1/n and q = 1 by hand: P(B ≥ nq) > 1/4
    for n in range(1, 300):
        q = np.concatenate([np.linspace(1 / n, 1, 400), [1 / n]])
        assert np.all(binom.sf(np.ceil(n * q - 1e-9) - 1, n, q) > 0.25), n


@settings(max_examples=300, deadline=None)
@given(rates=rate_lists, alpha=st.floats(1e-4, 0.9))
def test_the_poisson_binomial_bound_holds_at_its_level_exactly(rates, alpha):
    # P(L'(S) > p̄) summed over every outcome of S: at most α, whatever the rates
    n, mean = len(rates), float(np.mean(rates))
    lower = poisson_binomial_lower(np.arange(n + 1), n, alpha)
    assert np.all(np.diff(lower) >= 0)
    missed = poisson_binomial_pmf(rates)[lower > mean].sum()
    assert missed <= alpha + 1e-12


@settings(max_examples=200, deadline=None)
@given(
    n1=st.integers(1, 45),
    n2=st.integers(1, 45),
    tpr=st.floats(0, 1),
    tnr=st.floats(0, 1),
    prior=st.floats(0.05, 0.95),
    delta=st.floats(1e-3, 0.6),
)
def test_the_certificate_holds_at_its_level_exactly(n1, n2, tpr, tnr, prior, delta):
    # A rule right on members with rate TPR and on non-members with rate TNR: tp ~ Bin(n1, TPR),
    # tn ~ Bin(n2, TNR). Summed over every (tp, tn), the certificate exceeds the rule's
    # advantage with probability at most δ, pooled or split.
    advantage = 2 * prior * tpr + 2 * (1 - prior) * tnr - 1
    tp, tn = np.arange(n1 + 1)[:, None], np.arange(n2 + 1)[None, :]
    cert = certified_advantage(tp, n1, n2 - tn, n2, prior=prior, delta=delta)
    weight = np.outer(poisson_binomial_pmf([tpr] * n1), poisson_binomial_pmf([tnr] * n2))
    assert weight[cert > advantage + 1e-12].sum() <= delta + 1e-12


def test_the_pooled_certificate_is_as_sharp_as_its_level_allows():
    # 100 + 100 records at p = 1/2: over rules right on every record with rate r, the largest
    # exact chance of certifying more than the rule's advantage 2r − 1 is δ to 0.1 %, so a
    # bound at a larger level (or a bound that splits δ) fails the test above or this one
    n, delta = 100, 0.05
    correct = np.arange(2 * n + 1)
    cert = certified_advantage(
        np.minimum(correct, n), n, n - (correct - np.minimum(correct, n)), n, prior=0.5, delta=delta
    )
    rates = np.linspace(0.5, 0.99, 981)[:, None]
    missed = np.where(cert > 2 * rates - 1 + 1e-12, binom.pmf(correct, 2 * n, rates), 0.0).sum(1)
    assert 0.999 * delta <= missed.max() <= delta + 1e-12


def test_certificate_values():
    # balanced records at p = 1/2 pool the correct calls: 2·Beta⁻¹(δ; C, N − C + 1) − 1
    assert pools(100, 100, 0.5, 0.05) and pooled_share(100, 100, 0.5) == 0.5
    got = certified_advantage(80, 100, 30, 100, prior=0.5, delta=0.05)
    assert float(got) == pytest.approx(2 * beta.ppf(0.05, 150, 51) - 1, abs=1e-12)
    # above δ = 1/4 the pooled bound is taken at 1/4
    got = certified_advantage(80, 100, 30, 100, prior=0.5, delta=0.4)
    assert float(got) == pytest.approx(2 * beta.ppf(0.25, 150, 51) - 1, abs=1e-12)
    # nearly balanced: the share s = min(n1 / (2p), n2 / (2(1−p))) / N
    assert pools(100, 110, 0.5, 0.05)
    got = certified_advantage(80, 100, 30, 110, prior=0.5, delta=0.05)
    expected = 1 - (1 - beta.ppf(0.05, 160, 51)) / (100 / 210)
    assert float(got) == pytest.approx(expected, abs=1e-12)
    # p = 0.3 with as many members as non-members splits δ: 2p·TPR_lo + 2(1−p)·TNR_lo − 1
    assert not pools(100, 100, 0.3, 0.05)
    got = certified_advantage(80, 100, 30, 100, prior=0.3, delta=0.05)
    expected = 0.6 * beta.ppf(0.025, 80, 21) + 1.4 * beta.ppf(0.025, 70, 31) - 1
    assert float(got) == pytest.approx(expected, abs=1e-12)
    # members a prior's share of the records pool again; unbalanced ones at p = 1/2 split
    assert pools(300, 700, 0.3, 0.05) and pooled_share(300, 700, 0.3) == pytest.approx(0.5)
    assert not pools(200, 300, 0.5, 0.05)
    # no held-out record of a class: nothing is certified
    assert float(certified_advantage(5, 5, 0, 0, prior=0.5, delta=0.05)) <= 0


def test_lower_of_a_perfect_split_equals_the_formula_on_its_folds():
    # Members at 1, non-members at 0: each certificate's rule is right on every record it is
    # applied to; the one learned on fold 3 certifies folds 0-2 and, on more records, is the
    # larger. At n1c ≠ n2c the classes pool (share min(n1c, n2c) / N at p = 1/2), each
    # certificate at δ/2, and Beta⁻¹(δ/2; N, 1) = (δ/2)^(1/N).
    n1, n2, delta = 123, 117, 0.02
    est = privmon.optimal_advantage(np.ones(n1), np.zeros(n2), delta=delta)
    n1c, n2c = (int((fold_of(torch.arange(n), 4) < 3).sum()) for n in (n1, n2))
    assert (n1c, n2c) == certified_records(n1, n2) and pools(n1c, n2c, 0.5, delta / 2)
    total = n1c + n2c
    expected = 1 - (1 - (delta / 2) ** (1 / total)) * total / min(n1c, n2c)
    assert est.lower == pytest.approx(expected, abs=1e-12)
    assert est.lower_check == est.lower
    # above 2-D the learned rule's first certificate reads folds 0-1 (its rule learns on two
    # folds), the second folds 0-2, each at δ/2
    assert certified_records(n1, n2, dim=3) == tuple(
        int((fold_of(torch.arange(n), 4) < 2).sum()) for n in (n1, n2)
    )
    assert certificates_of(3) == 2 and certificates_of(2) == 2


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("which", [0, 1])
def test_the_certificates_rule_reads_its_own_records_alone(d, which):
    # The premise of the certificate's proof: given the records its rule learns on, the rule
    # and the cell of every record are fixed. Move the records a certificate holds out (the
    # first: folds 0-2, the second: folds 0-1) anywhere, even past every training record: its
    # rule's densities and its training records' cells stay bit for bit, and each held-out
    # record's cell follows its own score.
    from privmon.estimators.folds import CERTIFY_FOLDS
    from privmon.estimators.methods import estimator_method
    from privmon.estimators.record_binning import bin_records
    from privmon.estimators.selections import record_selections
    from privmon.estimators.smoothing import smooth_selections

    rng = np.random.default_rng(3)
    n1, n2 = 300, 260
    x = torch.from_numpy(np.concatenate([rng.normal(0.5, 1, (n1, d)), rng.normal(0, 1, (n2, d))]))
    position = torch.cat([torch.arange(n1), torch.arange(n2)])
    held_out = torch.isin(fold_of(position, 4), torch.tensor(CERTIFY_FOLDS[which]))
    moved = x.clone()
    moved[held_out] = torch.from_numpy(rng.standard_cauchy((int(held_out.sum()), d)) * 5)
    densities, cells = [], []
    methods = {"histogram": 100, "kde": 2000} if d == 1 else {"histogram": 100}
    for scores in (x, moved):
        binned = bin_records(scores, n1, bins=100, fine_bins=2000 if d == 1 else None)
        densities.append(
            {m: smooth_selections(
                g, estimator_method(m), bandwidth="scott", extended=False
            )[1][:, 4 + which]
             for m, g in record_selections(binned, methods).items()}
        )  # fmt: skip
        coordinates = _certificate_coordinates(scores, ~held_out)
        cells.append(binned.certified[which].cell_index(coordinates)[0])
    for method, before in densities[0].items():
        assert torch.equal(before, densities[1][method]), method
    assert torch.equal(cells[0][~held_out], cells[1][~held_out])
    assert not torch.equal(cells[0][held_out], cells[1][held_out])


def _certificate_coordinates(scores, learns):
    """Where bin_records puts each record for a certificate whose rule learns on the records
    ``learns``: its mid-rank among them in 1-D, its score in 2-D."""
    if scores.shape[1] == 2:
        return scores
    train = np.sort(scores[learns, 0].numpy())
    values = scores[:, 0].numpy()
    below = np.searchsorted(train, values, side="left")
    tied = np.searchsorted(train, values, side="right") - below
    return torch.from_numpy((2 * below + tied) / (2 * train.size))[:, None]


def _detection_probability(n1, n2, rate, *, prior, delta, threshold):
    """P(certificate > threshold) for a rule right on each held-out record with probability
    ``rate``, by enumerating every (tp, tn)."""
    tp, tn = np.arange(n1 + 1)[:, None], np.arange(n2 + 1)[None, :]
    cert = certified_advantage(tp, n1, n2 - tn, n2, prior=prior, delta=delta)
    return float((binom.pmf(tp, n1, rate) * binom.pmf(tn, n2, rate))[cert > threshold].sum())


@pytest.mark.parametrize(
    ("n1", "n2", "prior", "delta", "threshold", "power"),
    [
        (80, 80, 0.5, 0.05, None, 0.5),  # pooled: the rate in closed form
        (90, 70, 0.5, 0.01, 0.1, 0.8),
        (80, 80, 0.3, 0.05, None, 0.5),  # split: the rate by bisection
        (60, 150, 0.5, 0.2, 0.05, 0.9),
    ],
)
def test_detectable_advantage_is_detected_with_the_power_asked(
    n1, n2, prior, delta, threshold, power
):
    found = detectable_advantage(n1, n2, delta=delta, prior=prior, threshold=threshold, power=power)
    # the first certificate, at its δ/2 share: exactly the power asked for
    n1c, n2c = certified_records(n1, n2)
    share = delta / certificates_of(1)
    at = threshold if threshold is not None else abs(2 * prior - 1)
    rate = (1 + found) / 2
    hit = _detection_probability(n1c, n2c, rate, prior=prior, delta=share, threshold=at)
    # at the rate found the probability crosses power: it is reached there, not just below
    below = _detection_probability(n1c, n2c, rate - 1e-6, prior=prior, delta=share, threshold=at)
    assert below < power <= hit + 1e-9 and hit - power < 1e-4
    assert at < found < 1


def test_detectable_advantage_values_and_limits():
    # 500 + 500 records at a check's δ share of a planned 15-check run with two methods
    share = check_delta(15, delta=0.05, planned_checks=15) / 2
    assert share == pytest.approx(0.0015)
    assert detectable_advantage(500, 500, delta=share) == pytest.approx(0.11688, abs=1e-5)
    assert detectable_advantage(200, 200, delta=share) == pytest.approx(0.18560, abs=1e-5)
    # more records, a larger δ, a smaller power: smaller; a threshold: larger
    sizes = [detectable_advantage(n, n, delta=0.01) for n in (50, 100, 400, 1600)]
    assert sizes == sorted(sizes, reverse=True)
    assert detectable_advantage(400, 400, delta=0.1) < detectable_advantage(400, 400, delta=0.01)
    assert detectable_advantage(400, 400, delta=0.01, power=0.2) < sizes[2]
    assert detectable_advantage(400, 400, delta=0.01, threshold=0.1) > sizes[2] + 0.1
    # √n scaling of the margin: 4× the records, about half the detectable advantage
    assert sizes[3] / sizes[2] == pytest.approx(0.5, abs=0.03)
    # two records cannot certify anything at δ = 0.001
    assert detectable_advantage(2, 2, delta=0.001) == math.inf


def test_audit_records_needed_inverts_detectable_advantage():
    for advantage, kwargs in ((0.3, {}), (0.1, {"power": 0.8}), (0.55, {"prior": 0.3})):
        n = audit_records_needed(advantage, delta=0.0015, **kwargs)
        assert detectable_advantage(n, n, delta=0.0015, **kwargs) <= advantage
        assert detectable_advantage(n - 1, n - 1, delta=0.0015, **kwargs) > advantage
    assert audit_records_needed(0.3, delta=0.0015) == 80
    assert audit_records_needed(0.2, delta=0.0015, threshold=0.1) > audit_records_needed(
        0.2, delta=0.0015
    )


def test_power_functions_check_their_arguments():
    for bad, match in (
        ({"threshold": 0.3, "prior": 0.3}, r"threshold must be in \[0.4, 1.0\)"),
        ({"threshold": 1.0}, "threshold"),
        ({"power": 1.0}, "power"),
        ({"power": 0.05}, r"power must be in \(delta, 1\) = \(0.05, 1\)"),  # returned < 0
        ({"delta": 0.0}, "delta"),
        ({"dim": 0}, "dim"),
    ):
        with pytest.raises(ValueError, match=match):
            detectable_advantage(10, 10, **{"delta": 0.05, **bad})
    with pytest.raises(ValueError, match="n_members must be an integer >= 1"):
        detectable_advantage(0, 10, delta=0.05)
    with pytest.raises(ValueError, match=r"advantage must be in \(threshold, 1\]"):
        audit_records_needed(0.1, delta=0.05, threshold=0.1)


def test_null_runs_certify_leakage_in_at_most_a_delta_fraction_of_calls():
    # Nothing leaks; each call certifies at δ = 0.2: the rule-and-certificate paths (1-D grid,
    # histogram and KDE; 2-D grid; the learned rule above 2-D) may exceed 0 in at most a δ
    # fraction of seeded calls: fail only above the binomial's 0.999 quantile.
    runs, delta = 160, 0.2
    hits = dict.fromkeys(("1-D histogram", "1-D kde", "2-D histogram", "3-D learned"), 0)
    for seed in range(runs):
        rng = np.random.default_rng(50_000 + seed)
        one = rng.normal(size=150), rng.normal(size=150)
        res = privmon.analyse(*one, delta=delta, top_k=0)
        hits["1-D histogram"] += res.estimates["histogram"].lower > 0
        hits["1-D kde"] += res.estimates["kde"].lower > 0
        two = rng.normal(size=(120, 2)), rng.normal(size=(120, 2))
        hits["2-D histogram"] += privmon.optimal_advantage(*two, delta=delta).lower > 0
        if seed % 2 == 0:
            three = rng.normal(size=(120, 3)), rng.normal(size=(120, 3))
            hits["3-D learned"] += privmon.optimal_advantage(*three, delta=delta).lower > 0
    for path, count in hits.items():
        n = runs // 2 if path == "3-D learned" else runs
        assert count <= binom.ppf(0.999, n, delta), (path, count)


def test_power_at_the_issue_sizes():
    # Gaussian scores of true advantage 0.3 (2Φ(μ/2) − 1 = 0.3), a planned run of 15 checks
    # certifying two methods: at 500 + 500 the run-level bound exceeds 0.1 in ≥ 80 % of
    # seeded runs; at 200 + 200 its mean is above the 0.093 that one call at δ = 0.05 gave
    # before (a rule on half the records, δ split between its two rates).
    mu = 2 * norm.ppf(0.65)
    share = check_delta(15, delta=0.05, planned_checks=15) / 2
    for n, check in ((500, lambda v: np.mean(v > 0.1) >= 0.8), (200, lambda v: v.mean() > 0.093)):
        lowers = []
        for seed in range(20):
            rng = np.random.default_rng(seed)
            m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
            lowers.append(privmon.optimal_advantage(m, h, delta=share).lower)
        assert check(np.asarray(lowers)), (n, np.mean(lowers))


# --- the spending sequence ----------------------------------------------------------------------


def test_series_constant_bounds_the_series():
    # Σ_{j≥2} 1/(j ln² j) ≤ partial sum to N + ∫_N^∞ dx/(x ln² x) = partial + 1/ln N
    j = np.arange(2, 10**7 + 1, dtype=np.float64)
    upper = float(np.sum(1.0 / (j * np.log(j) ** 2))) + 1.0 / math.log(10**7)
    assert upper <= spending._SERIES_SUM + 1e-9
    # and it is not loose: the sum to 10⁷ plus the smaller tail integral from 10⁷ + 1
    assert float(np.sum(1.0 / (j * np.log(j) ** 2))) + 1.0 / math.log(10**7 + 1) > (
        spending._SERIES_SUM - 1e-6
    )


@settings(max_examples=60, deadline=None)
@given(
    delta=st.floats(1e-6, 0.5),
    planned=st.one_of(st.none(), st.integers(1, 3000)),
    horizon=st.integers(1, 6000),
)
def test_spending_sums_to_at_most_delta(delta, planned, horizon):
    shares = [check_delta(k, delta=delta, planned_checks=planned) for k in range(1, horizon + 1)]
    assert all(s > 0 for s in shares)
    assert math.fsum(shares) <= delta * (1 + 1e-12)
    if planned is not None and horizon <= planned:  # a plan spends evenly
        assert shares == pytest.approx([delta * 0.9 / planned] * horizon)


def test_spending_values():
    # unplanned: δ / (S (k+1) ln²(k+1)); planned: 0.9 δ / n, then 0.1 δ on the unplanned sequence
    s = spending._SERIES_SUM
    assert check_delta(1, delta=0.05) == pytest.approx(0.05 / (s * 2 * math.log(2) ** 2))
    assert check_delta(10, delta=0.05) == pytest.approx(0.05 / (s * 11 * math.log(11) ** 2))
    assert check_delta(3, delta=0.05, planned_checks=10) == pytest.approx(0.0045)
    assert check_delta(11, delta=0.05, planned_checks=10) == pytest.approx(
        0.005 * check_delta(1, delta=0.5) / 0.5
    )
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="k must be an integer >= 1"):
            check_delta(bad, delta=0.05)
    with pytest.raises(ValueError, match="planned_checks"):
        check_delta(1, delta=0.05, planned_checks=0)


# --- the monitor calls analyse -------------------------------------------------------------------


class Draws:
    """A query whose scores are fresh draws at every call: members ~ N(shift, 1) (their batch
    holds ones), non-members ~ N(0, 1) (zeros); ``skewed``: exp of those (loss-like, heavy
    right tail). Nothing leaks when shift is 0."""

    def __init__(self, seed: int, shift: float = 0.0, skewed: bool = False):
        self.rng = np.random.default_rng(seed)
        self.shift, self.skewed = shift, skewed

    def __call__(self, batch):
        scores = self.rng.normal(size=len(batch)) + self.shift * batch
        return torch.from_numpy(np.exp(2 * scores) if self.skewed else scores)


def _monitor(queries, n=300, **kwargs):
    return privmon.PrivacyMonitor(queries, [np.ones(n)], [np.zeros(n)], strict=True, **kwargs)


def test_monitor_equals_analyse_at_its_checks_share_of_delta():
    fixed = {}
    rng = np.random.default_rng(5)
    fixed["a"] = (rng.normal(0.6, 1.0, 400), rng.normal(0.0, 1.0, 400))
    fixed["b"] = (rng.exponential(0.5, 400), rng.exponential(1.0, 400))  # loss-like: low = member

    def scores(name):
        return lambda batch: torch.as_tensor(fixed[name][0] if batch[0] == 1 else fixed[name][1])

    queries = [
        CallableQuery(scores("a"), name="a", higher_is_member=True),
        CallableQuery(scores("b"), name="b", higher_is_member=False),
    ]
    mon = _monitor(queries, n=400, interval_delta=0.1, top_k=4)
    for k in (1, 2):
        rep = mon.check(k)
        share = check_delta(k, delta=0.1) / 4  # 2 queries × 2 methods
        assert rep.scalars["privacy/certify_delta"] == share
        for q in queries:
            res = privmon.analyse(
                *fixed[q.name],
                delta=0.1,
                certify_delta=share,
                higher_is_member=q.higher_is_member,
                top_k=4,
                name=q.name,
            )
            got = rep.queries[q.name]
            for method in ("histogram", "kde"):
                assert got.estimates[method] == res.estimates[method]
                assert (
                    rep.scalars[f"privacy/{q.name}/{method}/lower"] == res.estimates[method].lower
                )
                assert rep.scalars[f"privacy/{q.name}/{method}/lower_check"] == pytest.approx(
                    privmon.optimal_advantage(*fixed[q.name], method=method, delta=0.1).lower,
                    abs=1e-12,
                )
            assert got.roc == res.roc and got.risk == res.risk
            np.testing.assert_array_equal(got.member_posterior, res.member_posterior)
            np.testing.assert_array_equal(got.nonmember_posterior, res.nonmember_posterior)
            assert got.top_records == res.top_records
            for tag, value in res.scalars().items():
                assert rep.scalars[f"privacy/{q.name}/{tag}"] == value
    assert mon.n_certified_checks == 2
    # the spending index survives a checkpoint: a resumed run goes on at check 3
    resumed = _monitor(queries, n=400, interval_delta=0.1)
    resumed.load_state_dict(mon.state_dict())
    rep = resumed.check(3)
    assert rep.scalars["privacy/certify_delta"] == check_delta(3, delta=0.1) / 4


def _null_run(seed, checks, delta):
    """One run with nothing leaking: two queries (Gaussian and skewed scores), histogram + KDE,
    fresh draws at every check (independent checks: the union bound's worst case). Returns (any
    run-level certificate, any DP alarm, any per-check certificate)."""
    acc = RDPAccountant()  # a real accountant with a tiny ε: ceiling ≈ 0.008
    acc.history = [(40.0, 0.01, 100)]
    mon = privmon.PrivacyMonitor(
        [
            CallableQuery(Draws(seed), name="one"),
            CallableQuery(Draws(seed + 10_000, skewed=True), name="two"),
        ],
        [np.ones(300)],
        [np.zeros(300)],
        strict=True,
        interval_delta=delta,
        accountant=acc,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", privmon.PrivacyViolationWarning)
        reports = [mon.check(k) for k in range(1, checks + 1)]
    lowers = [v for r in reports for t, v in r.scalars.items() if t.endswith("/lower")]
    per_check = [v for r in reports for t, v in r.scalars.items() if t.endswith("/lower_check")]
    alarm = any(r.dp_violation for r in reports)
    return max(lowers) > 1e-12, alarm, max(per_check) > 1e-12


def test_null_runs_certify_leakage_in_at_most_a_delta_fraction():
    # 100 runs × 8 checks × 2 queries × 2 methods at δ = 0.2 for the run. The run-level figures
    # must certify (or raise a DP alarm) in at most a δ fraction of runs: fail only above the
    # binomial's 0.999 quantile. The per-check figures of the same runs certify far more often
    # (the test has the power to catch a per-check bound passed off as a run-level one).
    runs, checks, delta = 100, 8, 0.2
    results = [_null_run(seed, checks, delta) for seed in range(runs)]
    certified = sum(r[0] for r in results)
    alarms = sum(r[1] for r in results)
    per_check = sum(r[2] for r in results)
    limit = binom.ppf(0.999, runs, delta)  # 33
    assert certified <= limit and alarms <= limit
    assert alarms <= certified  # the ceiling is above the floor: an alarm needs a certificate
    assert per_check > limit, per_check


def test_a_real_leak_is_still_certified_over_the_run():
    # true advantage 2Φ(0.4) − 1 = 0.311 at 300 + 300, 10 checks: certified at every check
    mon = _monitor([CallableQuery(Draws(0, shift=0.8), name="s")], planned_checks=10)
    lowers = [mon.check(k).scalars["privacy/s/kde/lower"] for k in range(1, 11)]
    assert sum(v > 0.0 for v in lowers) >= 8 and max(lowers) < 0.311 + 0.05


class FixedEpsilon:
    """An accountant stand-in that reports a fixed ε (the DP figures are computed by privmon)."""

    def __init__(self, epsilon: float):
        self.epsilon = epsilon

    def get_epsilon(self, delta: float) -> float:
        return self.epsilon


def test_dp_alarm_compares_with_the_eps_delta_ceiling():
    rng = np.random.default_rng(0)
    mem, non = rng.normal(3.0, 1.0, 500), rng.normal(0.0, 1.0, 500)
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s", higher_is_member=True)
    first = privmon.PrivacyMonitor(query, [mem], [non], strict=True).check(1)
    best = max(e.lower for e in first.queries["s"].estimates.values())
    assert best > 0.6
    # ε puts the ε-DP (tanh) ceiling just below the certified bound; a large DP δ lifts the
    # (ε, δ) ceiling above it: no violation of (ε, δ)-DP, and no alarm.
    eps = 2 * math.atanh(best - 0.05)
    mon = privmon.PrivacyMonitor(
        query, [mem], [non], strict=True, accountant=FixedEpsilon(eps), delta=0.3
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", privmon.PrivacyViolationWarning)
        rep = mon.check(1)
    s = rep.scalars
    assert s["privacy/ceiling/tanh"] < best < s["privacy/ceiling/eps_delta"]
    assert s["privacy/ceiling/eps_delta"] == pytest.approx(
        (math.exp(eps) - 1 + 0.6) / (math.exp(eps) + 1)
    )
    assert not rep.dp_violation and s["privacy/dp_violation"] == 0.0
    # at a small DP δ the (ε, δ) ceiling sits at the tanh one: the same bound is a violation
    strict_dp = privmon.PrivacyMonitor(
        query, [mem], [non], strict=True, accountant=FixedEpsilon(eps), delta=1e-6
    )
    with pytest.warns(privmon.PrivacyViolationWarning, match="exceeds the ceiling"):
        rep = strict_dp.check(1)
    assert rep.dp_violation and rep.scalars["privacy/dp_violation"] == 1.0


# --- failures stay inside their query or method ---------------------------------------------------


def test_a_failing_query_or_method_leaves_the_others_reported(caplog, monkeypatch):
    # Fault injection: one query raises; the KDE's density evaluation raises on 3-D scores (the
    # 1-D query's KDE runs on the grid and is untouched).
    from privmon.estimators import density

    def broken_density(self, x):
        raise ValueError("the data covariance is singular (injected)")

    monkeypatch.setattr(density.GaussianKDE, "log_density", broken_density)
    rng = np.random.default_rng(1)
    hidden_m, hidden_h = rng.normal(0.5, 1.0, (300, 3)), rng.normal(0.0, 1.0, (300, 3))
    side = {"m": hidden_m, "h": hidden_h}

    def broken(batch):
        raise RuntimeError("query exploded")

    mon = privmon.PrivacyMonitor(
        [
            CallableQuery(Draws(0, shift=0.5), name="fine"),
            CallableQuery(lambda b: torch.as_tensor(side["m" if b[0] == 1 else "h"]), name="dead"),
            CallableQuery(broken, name="bad"),
        ],
        [np.ones(300)],
        [np.zeros(300)],
    )
    with caplog.at_level(logging.ERROR, logger="privmon"):
        rep = mon.check(1)
    assert rep is not None and mon.n_failed == 0
    assert set(rep.queries) == {"fine", "dead"}
    assert tuple(rep.queries["fine"].estimates) == ("histogram", "kde")
    assert tuple(rep.queries["dead"].estimates) == ("histogram",)
    assert rep.failures["bad"] == "RuntimeError: query exploded"
    assert rep.failures["dead/kde"].startswith("ValueError: the data covariance is singular")
    assert "privacy/dead/histogram/lower" in rep.scalars
    assert "privacy/dead/kde/lower" not in rep.scalars
    assert "query exploded" in caplog.text and "singular" in caplog.text
    # strict: the first failure is raised
    strict = privmon.PrivacyMonitor(
        CallableQuery(broken, name="bad"), [np.ones(3)], [np.zeros(3)], strict=True
    )
    with pytest.raises(RuntimeError, match="query exploded"):
        strict.check(1)
