"""Certified means certified over the run: the monitor equals privmon.analyse at its check's share
of δ, the shares sum to at most δ, null runs certify leakage (or raise a DP alarm) in at most a
δ fraction of runs, and a failing query or method leaves the others' figures in place."""

import logging
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import RDPAccountant
from scipy.stats import binom

import privmon
from privmon.estimators import spending
from privmon.estimators.spending import check_delta
from privmon.queries import CallableQuery

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    assert per_check > limit, per_check  # 48 of 100


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
