"""The certificate of a rule fixed in advance, and what such a certificate can detect.

A rule learned on some folds of the records is applied to the others, which it has never seen:
its true-positive and true-negative counts there are independent binomials, and a lower
confidence bound on its accuracy advantage bounds the optimal advantage from below
(:func:`certified_advantage`: a *pooled* bound on all correct calls, valid by the lemma of
:func:`poisson_binomial_lower`, or a *split* one on each class at δ/2, as :func:`pools` chooses
before any count is read). :func:`certify` takes the larger of the certificates of rules
learned on different folds, each at its share of δ. :func:`detectable_advantage` and
:func:`audit_records_needed` give, exactly, the advantage a certificate detects at given audit
sizes and the audit size a given advantage needs.

Derivation, the lemma and its proof: Theory, *The certificate of a rule fixed in advance*.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from scipy.special import betaincinv, ndtri
from scipy.stats import binom

from privmon._validation import check_half_open_interval, check_int, check_open_unit
from privmon.estimators.folds import certify_folds, fold_of
from privmon.estimators.intervals import clopper_pearson_lower

__all__ = [
    "POOLED_MAX_ALPHA",
    "audit_records_needed",
    "certificates_of",
    "certified_advantage",
    "certified_records",
    "certify",
    "detectable_advantage",
    "poisson_binomial_lower",
    "pooled_share",
    "pools",
]

POOLED_MAX_ALPHA = 0.25  # the lemma's largest level α: a pooled bound at a larger δ uses 1/4
_RATE_STEPS = 60  # bisection steps on a rate in [0, 1]: to 1e-18, below float resolution
_TAIL_SDS = 40  # a binomial's mass beyond 40 standard deviations (+40) is below 1e-300
_MAX_RECORDS = 1 << 22  # audit_records_needed searches up to this many records per class


def poisson_binomial_lower(successes, trials: float, alpha) -> np.ndarray:
    """Lower bound at level 1 − ``alpha`` on the mean rate of ``trials`` independent Bernoulli
    trials with possibly different rates, from their ``successes``: the Clopper–Pearson bound
    at min(alpha, 1/4), 0 where that is at most 1/trials (a lemma proves it valid although the
    rates differ: Theory, *The certificate of a rule fixed in advance*). Vectorized."""
    level = np.minimum(np.asarray(alpha, dtype=np.float64), POOLED_MAX_ALPHA)
    lower = clopper_pearson_lower(successes, trials, level)
    return np.where(lower > 1.0 / trials, lower, 0.0)


def pooled_share(n1: float, n2: float, prior: float) -> float:
    """s = min(n1 / (2p), n2 / (2(1−p))) / (n1 + n2): the pooled bound is A ≥ 1 − (1 − c̄)/s
    (Theory, *The certificate of a rule fixed in advance*); 1/2 for balanced records at
    p = 1/2, 0 when a class has none."""
    return min(n1 / (2 * prior), n2 / (2 * (1 - prior))) / (n1 + n2)


def pools(n1: float, n2: float, prior: float, delta) -> np.ndarray:
    """Whether the certificate of ``n1`` + ``n2`` held-out records at level 1 − ``delta`` (a
    scalar or one per certificate) pools the classes' correct calls (else it splits δ between
    them): the bound with the higher figure for a rule right on half the records, in the normal
    approximation (Theory, *The certificate of a rule fixed in advance*). Reads no count."""
    delta = np.asarray(delta, dtype=np.float64)
    if n1 <= 0 or n2 <= 0:
        return np.zeros(delta.shape, dtype=bool)
    z_pooled = -ndtri(np.minimum(delta, POOLED_MAX_ALPHA))
    z_split = -ndtri(delta / 2)
    pooled = 1 - (0.5 + z_pooled / (2 * math.sqrt(n1 + n2))) / pooled_share(n1, n2, prior)
    split = -z_split * (prior / math.sqrt(n1) + (1 - prior) / math.sqrt(n2))
    return pooled >= split


def certified_advantage(tp, n1: float, fp, n2: float, *, prior: float, delta) -> np.ndarray:
    """Lower confidence bound, level 1 − ``delta``, on the accuracy advantage of a rule fixed
    before it called ``tp`` of ``n1`` held-out members and ``fp`` of ``n2`` held-out
    non-members members — hence on the optimal advantage: the pooled or the split bound (module
    docstring), as :func:`pools` chooses. ``tp`` / ``fp`` scalars or arrays (one per
    rule), ``delta`` a scalar or one per rule. Not floored: the caller clips it into
    [|2p − 1|, 1]."""
    delta = np.asarray(delta, dtype=np.float64)
    tp, fp = np.asarray(tp, dtype=np.float64), np.asarray(fp, dtype=np.float64)
    tn = n2 - fp
    tpr_lo = clopper_pearson_lower(tp, n1, delta / 2) if n1 > 0 else np.zeros_like(tp)
    tnr_lo = clopper_pearson_lower(tn, n2, delta / 2) if n2 > 0 else np.zeros_like(tn)
    split = 2 * prior * tpr_lo + 2 * (1 - prior) * tnr_lo - 1
    if n1 <= 0 or n2 <= 0:
        return split
    share = pooled_share(n1, n2, prior)
    pooled = 1 - (1 - poisson_binomial_lower(tp + tn, n1 + n2, delta)) / share
    return np.where(pools(n1, n2, prior, delta), pooled, split)


def certify(tp, n1, fp, n2, prior: float, deltas: tuple[float, float]):
    """Rules each certified C ways, by C rules learned on different folds: each certificate
    (:func:`certified_advantage`) at δ / C, and the larger — which holds at level 1 − δ by the
    union bound. ``tp`` / ``fp`` (rules, C) the held-out positives of each rule's C
    certificates, ``n1`` / ``n2`` (C,) their held-out members and non-members. Returns (lower,
    lower_check), one entry per rule, at the run's δ share and at the call's δ."""
    tp, fp = np.atleast_2d(tp), np.atleast_2d(fp)
    n1, n2 = np.atleast_1d(n1), np.atleast_1d(n2)
    rules, c = tp.shape
    best = np.full((2, rules), -np.inf)
    for j in range(c):
        both = certified_advantage(
            np.concatenate([tp[:, j], tp[:, j]]),
            float(n1[j]),
            np.concatenate([fp[:, j], fp[:, j]]),
            float(n2[j]),
            prior=prior,
            delta=np.repeat(np.asarray(deltas, dtype=np.float64) / c, rules),
        )
        best = np.maximum(best, both.reshape(2, rules))
    return best[0], best[1]


def certificates_of(dim: int) -> int:
    """How many certificates an estimate of ``dim``-dimensional scores takes the larger of,
    each at δ / that number (:func:`~privmon.estimators.folds.certify_folds`)."""
    return len(certify_folds(dim))


@functools.lru_cache(maxsize=64)
def _records_on_folds(n: int, folds: tuple[int, ...]) -> int:
    """How many of records 0..n−1 of a class fall on ``folds`` of the 4-fold split."""
    fold = fold_of(torch.arange(n, dtype=torch.int64), 4)
    return int(torch.isin(fold, torch.tensor(folds)).sum())


def certified_records(n_members: int, n_nonmembers: int, *, dim: int = 1) -> tuple[int, int]:
    """The members and non-members the first certificate reads, of ``n_members`` +
    ``n_nonmembers`` audit records with scores of ``dim`` dimensions, under the default 4
    folds: those of folds 0-2 in 1-2 dimensions (its rule learns on fold 3), of folds 0-1
    above (the learned rule learns on folds 2-3)."""
    folds = certify_folds(dim)[0]
    return _records_on_folds(n_members, folds), _records_on_folds(n_nonmembers, folds)


def _smallest_certifying_count(n1: int, n2: int, *, prior, delta, threshold) -> int | None:
    """The fewest correct calls C = tp + tn whose pooled certificate exceeds ``threshold``
    (None when none does): the pooled certificate grows with C."""

    def above(c: int) -> bool:
        tp = min(c, n1)
        cert = certified_advantage(tp, n1, n2 - (c - tp), n2, prior=prior, delta=delta)
        return bool(cert > threshold)

    if not above(n1 + n2):
        return None
    low, high = -1, n1 + n2  # above(low) is False (or low = −1), above(high) is True
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if above(mid) else (mid, high)
    return high


def _split_boundary(n1: int, n2: int, *, prior, delta, threshold) -> np.ndarray:
    """For each tp = 0..n1, the fewest correct non-member calls tn whose split certificate
    exceeds ``threshold`` (n2 + 1 where none does)."""
    tpr_lo = clopper_pearson_lower(np.arange(n1 + 1), n1, delta / 2)
    tnr_lo = clopper_pearson_lower(np.arange(n2 + 1), n2, delta / 2)
    need = (threshold + 1 - 2 * prior * tpr_lo) / (2 * (1 - prior))
    return np.searchsorted(tnr_lo, need, side="right")


def _detection(n1: int, n2: int, *, prior, delta, threshold):
    """The probability that the certificate of ``n1`` + ``n2`` held-out records exceeds
    ``threshold``, as a function of the rate r of a rule right on each record with probability
    r; and, where it pools, the rate reaching a probability in closed form."""
    if bool(pools(n1, n2, prior, delta)):
        count = _smallest_certifying_count(n1, n2, prior=prior, delta=delta, threshold=threshold)
        if count is None:
            return (lambda rate: 0.0), (lambda power: math.inf)
        total = n1 + n2
        return (
            lambda rate: float(binom.sf(count - 1, total, rate)),
            lambda power: float(betaincinv(count, total - count + 1, power)),
        )
    boundary = _split_boundary(n1, n2, prior=prior, delta=delta, threshold=threshold)

    def probability(rate: float) -> float:
        # tp beyond _TAIL_SDS standard deviations (plus a Poisson margin near 0 and 1) carries
        # no mass a float can hold: summing only the rest keeps a large audit's call cheap
        spread = _TAIL_SDS * (math.sqrt(n1 * rate * (1 - rate)) + 1)
        low = max(0, math.floor(n1 * rate - spread))
        high = min(n1, math.ceil(n1 * rate + spread))
        tps = np.arange(low, high + 1)
        return float(np.sum(binom.pmf(tps, n1, rate) * binom.sf(boundary[tps] - 1, n2, rate)))

    def rate_for(power: float) -> float:
        if probability(1.0) < power:
            return math.inf
        low, high = 0.0, 1.0  # probability(low) < power <= probability(high)
        for _ in range(_RATE_STEPS):
            mid = (low + high) / 2
            low, high = (low, mid) if probability(mid) >= power else (mid, high)
        return high

    return probability, rate_for


def _check_power_arguments(prior, delta, threshold, power, dim):
    """The arguments :func:`detectable_advantage` and :func:`audit_records_needed` share,
    checked; ``threshold`` None becomes the floor |2p − 1|."""
    prior = check_open_unit(prior, name="prior")
    floor = abs(2 * prior - 1)
    if threshold is not None:
        floor = check_half_open_interval(threshold, name="threshold", low=floor, high=1.0)
    delta = check_open_unit(delta, name="delta")
    power = check_open_unit(power, name="power")
    if power <= delta:  # a true advantage at the threshold is certified above it that often
        raise ValueError(
            f"power must be in (delta, 1) = ({delta:g}, 1), got {power!r}: a certified lower "
            "bound exceeds the true advantage with probability at most delta"
        )
    return prior, delta, floor, power, check_int(dim, name="dim", minimum=1)


def detectable_advantage(
    n_members: int,
    n_nonmembers: int,
    *,
    delta: float,
    prior: float = 0.5,
    threshold: float | None = None,
    power: float = 0.5,
    dim: int = 1,
) -> float:
    """The smallest advantage whose certified lower bound exceeds ``threshold`` with
    probability ``power``, for these audit sizes and this δ.

    The advantage is that of a rule right on members and non-members alike with probability
    r = (1 + A)/2, as good as the optimal rule (a learned rule reaches a little less). The
    probability is that of the first certificate alone (:func:`certified_records`, at its
    δ / :func:`certificates_of` share), exactly (Theory, *The certificate of a rule fixed in
    advance*): ``lower`` is the larger of
    the certificates, so it exceeds the threshold at least as often, and the advantage
    returned is at least the smallest one detected with that probability. In a monitor, pass
    the δ a check certifies each figure at:
    ``check_delta(k, delta=interval_delta, planned_checks=n) / figures_per_check``
    (:func:`privmon.estimators.spending.check_delta`).

    Args:
        n_members, n_nonmembers: audit records of each class (>= 1).
        delta: the certificate's δ, in (0, 1).
        prior: P(member), in (0, 1).
        threshold: the figure the bound must exceed, in [|2p − 1|, 1); default the floor
            |2p − 1| (any certified leakage).
        power: the probability of exceeding it, in (delta, 1); 0.5: in half the runs.
        dim: dimensions of the query's scores (the certificate's folds differ above 2-D).

    Returns:
        The advantage, in (threshold, 1]; ``math.inf`` when no advantage reaches it at these
        sizes.

    Examples:
        >>> from privmon import detectable_advantage
        >>> round(detectable_advantage(1000, 1000, delta=0.05), 3)
        0.051
        >>> round(detectable_advantage(1000, 1000, delta=0.05, power=0.9), 3)
        0.084
    """
    n1 = check_int(n_members, name="n_members", minimum=1)
    n2 = check_int(n_nonmembers, name="n_nonmembers", minimum=1)
    prior, delta, threshold, power, dim = _check_power_arguments(
        prior, delta, threshold, power, dim
    )
    n1c, n2c = certified_records(n1, n2, dim=dim)
    share = delta / certificates_of(dim)
    _, rate_for = _detection(n1c, n2c, prior=prior, delta=share, threshold=threshold)
    rate = rate_for(power)
    return math.inf if math.isinf(rate) else 2 * rate - 1


def audit_records_needed(
    advantage: float,
    *,
    delta: float,
    prior: float = 0.5,
    threshold: float | None = None,
    power: float = 0.5,
    dim: int = 1,
) -> int:
    """The fewest audit records per class (as many members as non-members) at which a true
    ``advantage`` gets a certified lower bound above ``threshold`` with probability ``power``:
    the inverse of :func:`detectable_advantage` in the audit size, same model and arguments.

    Args:
        advantage: the true advantage to detect, in (threshold, 1].
        delta, prior, threshold, power, dim: as for :func:`detectable_advantage`.

    Returns:
        Records per class, found by bisection (the binomial's discreteness can make a size a
        few records larger fall just short).

    Examples:
        >>> from privmon import audit_records_needed
        >>> audit_records_needed(0.1, delta=0.05)
        278
        >>> audit_records_needed(0.1, delta=0.05, power=0.9)
        714
    """
    prior, delta, threshold, power, dim = _check_power_arguments(
        prior, delta, threshold, power, dim
    )
    advantage = float(advantage)
    if not threshold < advantage <= 1.0:
        raise ValueError(
            f"advantage must be in (threshold, 1] = ({threshold}, 1], got {advantage!r}: a "
            "certified lower bound exceeds the true advantage with probability at most delta"
        )
    rate = (1 + advantage) / 2

    def reaches(n: int) -> bool:
        n1c, n2c = certified_records(n, n, dim=dim)
        share = delta / certificates_of(dim)
        probability, _ = _detection(n1c, n2c, prior=prior, delta=share, threshold=threshold)
        return probability(rate) >= power

    high = 1
    while not reaches(high):
        if high >= _MAX_RECORDS:
            raise ValueError(f"more than {_MAX_RECORDS} records per class would be needed")
        high *= 2
    low = high // 2  # reaches(low) is False (or low = 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if reaches(mid) else (mid, high)
    return high
