"""Individual privacy risk |f_p(z)| (MACE eq. 8, §4.1) with confidence intervals.

f_p(q) = (p·P(q) − (1−p)·Q(q)) / (p·P(q) + (1−p)·Q(q)), and the posterior P(member | q) =
(1 + f_p(q)) / 2 is Song & Mittal's privacy risk score: one estimator serves both. The
histogram method's interval is MACE Lemma 5 (Clopper–Pearson on the cell frequencies, exact);
the KDE method's is Lemma 6 with Lemma 11's normal approximation (approximate).

Derivation: Theory, *Individual privacy risk*.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import norm

from privmon._validation import as_scores, check_open_unit, to_numpy
from privmon.estimators.binned_scores import BinnedScores
from privmon.estimators.density import GaussianKDE, bandwidth_factor
from privmon.estimators.estimates import check_bins
from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper
from privmon.estimators.methods import Method, estimator_method
from privmon.estimators.record_binning import BinnedRecords
from privmon.estimators.rules import RuleDensities

__all__ = [
    "QUANTILES",
    "RISK_LEVELS",
    "IndividualRisk",
    "histogram_individual_risk",
    "individual_risk",
    "kde_individual_risk",
    "most_exposed",
    "record_signed_risk",
    "risk_from_probabilities",
    "risk_summary",
    "tied_beyond",
]

QUANTILES = (0.5, 0.9, 0.99)  # of the members' risks, reported per check
RISK_LEVELS = (0.5, 0.8, 0.9)  # members above each risk level, reported per check


@dataclass(frozen=True)
class IndividualRisk:
    """Per-query individual privacy risk. Arrays have one entry per query row, in order.

    ``value`` = |f_p| (point estimate), ``lower`` / ``upper`` its interval (level 1 − delta),
    ``signed`` = f_p, ``posterior`` = (1 + f_p)/2 = P(member | query output) (Song & Mittal's
    privacy risk score). Queries with NaN / inf scores get NaN and are counted in ``n_dropped``.
    ``signed_lower`` / ``signed_upper`` bound f_p itself (the posterior interval is
    (1 + signed_lower)/2 .. (1 + signed_upper)/2; MACE Lemma 7 needs it).

    Examples:
        >>> import torch
        >>> from privmon import individual_risk
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(2000, generator=gen) + 1.0
        >>> nonmembers = torch.randn(2000, generator=gen)
        >>> risk = individual_risk(torch.tensor([0.0, 3.0]), members, nonmembers, bins=20)
        >>> risk.value.round(3).tolist(), risk.posterior.round(3).tolist()
        ([0.337, 0.821], [0.332, 0.911])
        >>> bool((risk.lower <= risk.value).all() and (risk.value <= risk.upper).all())
        True
    """

    value: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    signed: np.ndarray
    posterior: np.ndarray
    prior: float
    method: str
    delta: float
    n_dropped: int
    signed_lower: np.ndarray | None = None
    signed_upper: np.ndarray | None = None


def _f(p_mass, q_mass, prior, none):
    """f_p from P and Q; ``none`` where both are zero (no evidence either way)."""
    num = prior * p_mass - (1 - prior) * q_mass
    den = prior * p_mass + (1 - prior) * q_mass
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), none)


def risk_from_probabilities(
    p,
    p_lo,
    p_hi,
    q,
    q_lo,
    q_hi,
    *,
    prior: float,
    method: str,
    delta: float,
    n_dropped: int = 0,
    signed=None,
) -> IndividualRisk:
    """Lemma 5 / 6: the f_p point and interval from P, Q point values and their bounds.

    Without evidence (P = Q = 0) the point is the prior's f = 2p − 1 and the interval is [−1, 1].
    ``signed`` overrides the point estimate (the KDE path computes it from log densities).
    """
    if signed is None:
        signed = _f(p, q, prior, 2 * prior - 1)
    f_lo = _f(p_lo, q_hi, prior, -1.0)
    f_hi = _f(p_hi, q_lo, prior, 1.0)
    a_lo, a_hi = np.abs(f_lo), np.abs(f_hi)
    straddles = (f_lo <= 0) & (f_hi >= 0)
    lower = np.where(straddles, 0.0, np.minimum(a_lo, a_hi))
    upper = np.maximum(a_lo, a_hi)
    return IndividualRisk(
        value=np.abs(signed),
        lower=lower,
        upper=upper,
        signed=signed,
        posterior=(1 + signed) / 2,
        prior=prior,
        method=method,
        delta=delta,
        n_dropped=n_dropped,
        signed_lower=f_lo,
        signed_upper=f_hi,
    )


_CP_TABLES: OrderedDict[tuple[int, float], np.ndarray] = OrderedDict()
_CP_TABLES_MAX = 8  # tables of at most 2 × 100,001 floats: <= 13 MB in all
_CP_TABLE_MAX_N = 100_000


def _cp_interval(k, n, delta):
    """Two-sided Clopper–Pearson interval at level 1 − δ/2 for counts k out of n.

    A monitor asks for the same n at every check and mostly for the same counts, so for n up to
    100,000 the bounds are memoised per (n, δ) in a table over k = 0..n, filled as counts come
    (each beta quantile costs about a microsecond); otherwise they are computed once per
    distinct count."""
    k = np.asarray(k, dtype=np.float64)
    ki = k.astype(np.int64)
    if n != int(n) or n > _CP_TABLE_MAX_N or not np.array_equal(ki, k):
        uniq, inv = np.unique(k, return_inverse=True)
        lo = clopper_pearson_lower(uniq, n, delta / 4)
        hi = clopper_pearson_upper(uniq, n, delta / 4)
        return lo[inv].reshape(k.shape), hi[inv].reshape(k.shape)
    key = (int(n), float(delta))
    table = _CP_TABLES.pop(key, None)
    if table is None:
        table = np.full((2, int(n) + 1), np.nan)
    _CP_TABLES[key] = table  # most recently used last
    while len(_CP_TABLES) > _CP_TABLES_MAX:
        _CP_TABLES.popitem(last=False)
    lower = table[0, ki]
    unseen = np.isnan(lower)
    if unseen.any():
        missing = np.unique(ki[unseen])
        table[0, missing] = clopper_pearson_lower(missing, n, delta / 4)
        table[1, missing] = clopper_pearson_upper(missing, n, delta / 4)
        lower = table[0, ki]
    return lower, table[1, ki]


def _lemma5(k1, k2, n1, n2, *, prior, delta, n_dropped, method) -> IndividualRisk:
    """Lemma 5 per cell from the cells' member / non-member counts ``k1``, ``k2`` (numpy)."""
    p_lo, p_hi = _cp_interval(k1, n1, delta)
    q_lo, q_hi = _cp_interval(k2, n2, delta)
    return risk_from_probabilities(
        k1 / n1,
        p_lo,
        p_hi,
        k2 / n2,
        q_lo,
        q_hi,
        prior=prior,
        method=method,
        delta=delta,
        n_dropped=n_dropped,
    )


def _per_query(per_cell: IndividualRisk, cell: np.ndarray, finite: np.ndarray | None):
    """Each query takes the figures of its cell ``cell`` (numpy indices): Lemma 5 is computed
    once per cell, not once per query (many share a cell). ``finite`` marks the queries that
    are finite (None: all)."""
    fields = {k: getattr(per_cell, k)[cell] for k in _ARRAY_FIELDS}
    out = IndividualRisk(
        **fields,
        prior=per_cell.prior,
        method=per_cell.method,
        delta=per_cell.delta,
        n_dropped=per_cell.n_dropped,
    )
    return _mask(out, finite)


def _cell_counts(state: BinnedScores) -> np.ndarray:
    """Member / non-member counts per cell of the state's grid, then one more, empty cell for
    queries outside the grid (no evidence): (2, cells + 1)."""
    total = to_numpy(state.class_counts())
    return np.concatenate([total, np.zeros((2, 1))], axis=1)


PSEUDO_RECORDS = 10.0  # per class, spread uniformly over the grid (see record_signed_risk)


def record_signed_risk(
    binned: BinnedRecords, densities: RuleDensities, *, prior: float
) -> np.ndarray:
    """f_p of each binned record (MACE eq. 8), out of sample.

    Record i of fold k (its fold by position within its class, as the cross-fitting assigns it)
    reads P and Q off the cross-fitted rule's smoothed densities learned without fold k, in its
    histogram cell — the densities that ``value`` measures, so one estimator serves the advantage,
    the risk and the posterior. In-sample risks of sparse cells saturate at ±1 (a cell with one
    member and no non-member reads 1); out of sample they do not need to, but sparse regions are
    still noisy. So each class's density gets ``PSEUDO_RECORDS`` = 10 records' worth of mass
    spread uniformly over the grid (the same for both classes): where the records are dense this
    changes nothing, where they are sparse the risk shrinks towards the prior's 2p − 1 instead
    of ±1. Measured (benchmarks/risk.py): with nothing leaking, 200 + 400 records, no member
    above risk 0.8 in 1-D and 0.05 % in 2-D; on Gaussian scores at 1,000 + 1,000 the posterior's
    RMSE against the true posterior is 0.03-0.04."""
    mass, n_train = densities.mass, densities.n_train  # (2, K, cells), (2, K)
    uniform = PSEUDO_RECORDS / mass.shape[2]
    n = n_train[:, :, None]
    p, q = (n * mass + uniform) / (n + PSEUDO_RECORDS)  # per fold and cell: (K, cells) each
    signed = (prior * p - (1 - prior) * q) / (prior * p + (1 - prior) * q)
    return to_numpy(signed[binned.fold, binned.cell])


def risk_summary(risk: np.ndarray) -> dict[str, float]:
    """Quantiles (``q50``, ``q90``, ``q99``; linear interpolation, as ``torch.quantile``),
    ``max`` and the number above each of :data:`RISK_LEVELS` (``n_above_0.5`` …) of the finite
    member risks; empty when none is."""
    finite = risk[np.isfinite(risk)]
    if finite.size == 0:
        return {}
    values = np.quantile(finite, QUANTILES).tolist()
    out = {f"q{round(q * 100)}": v for q, v in zip(QUANTILES, values, strict=True)}
    out["max"] = float(finite.max())
    for level in RISK_LEVELS:
        out[f"n_above_{level}"] = float((finite > level).sum())
    return out


def tied_beyond(risk: np.ndarray, top: tuple[int, ...]) -> int:
    """How many records outside ``top`` share the risk of its last record: when positive, which
    of the tied records made the list was decided by index, not by risk."""
    if not top:
        return 0
    return int(np.count_nonzero(risk == risk[top[-1]])) - sum(
        1 for i in top if risk[i] == risk[top[-1]]
    )


def most_exposed(risk: np.ndarray, k: int) -> tuple[int, ...]:
    """Indices of the k highest risks (NaN last), ties by index: the first k of a stable sort,
    without sorting every record."""
    if k == 0:
        return ()
    key = -(risk if np.isfinite(risk).all() else np.nan_to_num(risk, nan=-1.0))
    candidates = np.arange(key.size)
    if k < key.size:  # the records at or above the k-th highest, in index order
        candidates = np.flatnonzero(key <= np.partition(key, k - 1)[k - 1])
    order = candidates[np.argsort(key[candidates], kind="stable")]
    return tuple(order[:k].tolist())


def histogram_risk(
    state: BinnedScores,
    queries: torch.Tensor,
    *,
    prior: float,
    delta: float,
    n_dropped: int = 0,
    method: str = "histogram",
) -> IndividualRisk:
    """Lemma 5 from a state's cell counts; queries outside the grid (or NaN) carry no evidence."""
    if bool(torch.isfinite(queries).all()):
        cell, inside = state.cell_index(queries)
        finite = None
    else:
        cell, inside = state.cell_index(torch.nan_to_num(queries))
        finite = to_numpy(torch.isfinite(queries).all(dim=1))
    k1, k2 = _cell_counts(state)
    n1, n2 = float(k1.sum()), float(k2.sum())
    per_cell = _lemma5(k1, k2, n1, n2, prior=prior, delta=delta, n_dropped=n_dropped, method=method)
    index = np.where(to_numpy(inside), to_numpy(cell), state.allocated().counts.shape[2])
    return _per_query(per_cell, index, finite)


_ARRAY_FIELDS = ("value", "lower", "upper", "signed", "posterior", "signed_lower", "signed_upper")


def _mask(risk: IndividualRisk, finite: np.ndarray | None) -> IndividualRisk:
    """NaN for the queries that are not finite (``finite`` None: all are)."""
    if finite is None or finite.all():
        return risk
    fields = {
        k: np.where(finite, getattr(risk, k), np.nan)
        for k in _ARRAY_FIELDS
        if getattr(risk, k) is not None
    }
    return IndividualRisk(
        **fields, prior=risk.prior, method=risk.method, delta=risk.delta, n_dropped=risk.n_dropped
    )


def _kde_bounds(kde: GaussianKDE, x: torch.Tensor, delta: float):
    """log p̂(x) and Lemma 11's bounds on p(x)."""
    log_dens = kde.log_density(x)
    dens = to_numpy(log_dens.exp())
    log_det = float(torch.logdet(kde.covariance))
    mu_over_hd = math.exp(-0.5 * kde.d * math.log(4 * math.pi) - 0.5 * log_det)
    half = norm.ppf(1 - delta / 4) * np.sqrt(mu_over_hd * dens / kde.n)
    return log_dens, np.maximum(dens - half, 0.0), dens + half


def individual_risk(
    scores: Any,
    member_scores: Any,
    nonmember_scores: Any,
    *,
    prior: float = 0.5,
    method: Method = "histogram",
    delta: float = 0.05,
    bins: int | None = None,
    bandwidth: str | float = "scott",
) -> IndividualRisk:
    """Individual privacy risk |f_p| of each query (MACE eq. 8) with Lemma 5 / 6 intervals.

    Args:
        scores: query outputs of the records to assess, shape (n,) or (n, d); rows stay aligned
            with the output (non-finite rows give NaN).
        member_scores, nonmember_scores: the reference member / non-member query outputs that
            estimate P and Q (NaN / inf rows dropped and counted).
        prior: P(member), in (0, 1). method: "histogram" (Lemma 5) or "kde" (Lemma 6 / 11).
        delta: 1 − confidence level of the intervals, in (0, 1).
        bins: histogram cells per dimension (default 100, the same grid as W_N).
        bandwidth: KDE factor ("scott", "silverman" or a number), scipy convention.

    Scoring the reference records themselves counts each one in its own estimate (in-sample);
    the risk of a member that sits alone in its cell is then over-stated. Intervals and their
    lemmas: Theory, *Individual privacy risk*.

    Examples:
        >>> import torch
        >>> from privmon import individual_risk
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(2000, generator=gen) + 1.0
        >>> nonmembers = torch.randn(2000, generator=gen)
        >>> risk = individual_risk(torch.tensor([-1.0, 3.0]), members, nonmembers, method="kde")
        >>> risk.signed.round(2).tolist(), risk.posterior.round(2).tolist()
        ([-0.66, 0.81], [0.17, 0.91])
    """
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    estimator = estimator_method(method)
    check_bins(bins)
    bandwidth_factor(bandwidth, n=2, d=1)
    m, dm = as_scores(member_scores, name="member_scores")
    h, dh = as_scores(nonmember_scores, name="nonmember_scores", device=m.device)
    x, dx = as_scores(scores, name="scores", device=m.device, drop=False)
    d = m.shape[1]
    for t, name in ((h, "nonmember_scores"), (x, "scores")):
        if t.shape[1] != d:
            raise ValueError(f"{name} has {t.shape[1]} dimensions per score, member_scores {d}")
    return estimator.individual_risk(
        x, m, h, prior=prior, delta=delta, bins=bins, bandwidth=bandwidth, n_dropped=dm + dh + dx
    )


def kde_individual_risk(x, m, h, *, prior, delta, bandwidth, n_dropped, method) -> IndividualRisk:
    """Lemma 6 with Lemma 11's normal approximation from the classes' Gaussian KDEs (the KDE
    method's :func:`individual_risk`)."""
    finite = torch.isfinite(x).all(dim=1)
    xs = torch.nan_to_num(x)
    lp, p_lo, p_hi = _kde_bounds(GaussianKDE(m, bandwidth=bandwidth), xs, delta)
    lq, q_lo, q_hi = _kde_bounds(GaussianKDE(h, bandwidth=bandwidth), xs, delta)
    # (x − 1)/(x + 1) = tanh(ln(x)/2) (MACE eq. 17): exact even where both densities underflow
    lam = math.log(prior / (1 - prior))
    signed = to_numpy(torch.tanh((lam + lp - lq) / 2))
    out = risk_from_probabilities(
        None,
        p_lo,
        p_hi,
        None,
        q_lo,
        q_hi,
        prior=prior,
        method=method,
        delta=delta,
        n_dropped=n_dropped,
        signed=signed,
    )
    return _mask(out, to_numpy(finite))


def histogram_individual_risk(x, m, h, *, prior, delta, bins, n_dropped, method) -> IndividualRisk:
    """Lemma 5 on ``bins`` cells per dimension (the histogram method's :func:`individual_risk`):
    a grid in 1-2 dimensions, the occupied cells above."""
    if m.shape[1] <= 2:
        state = BinnedScores(bins=bins, margin=0.0, device=m.device)
        state.update(m, h)
        return histogram_risk(
            state, x, prior=prior, delta=delta, n_dropped=n_dropped, method=method
        )
    return _sparse_histogram_risk(
        x, m, h, bins, prior=prior, delta=delta, n_dropped=n_dropped, method=method
    )


def _sparse_histogram_risk(x, m, h, bins, *, prior, delta, n_dropped, method) -> IndividualRisk:
    """Lemma 5 above 2 dimensions: occupied cells only (torch.unique), 100^d never allocated."""
    pooled = torch.cat([m, h])
    low, high = pooled.min(0).values, pooled.max(0).values
    span = torch.where(high > low, high - low, torch.ones_like(high))
    finite = torch.isfinite(x).all(dim=1)
    xs = torch.nan_to_num(x)
    raw = torch.floor((torch.cat([pooled, xs]) - low) / (span / bins)).to(torch.int64)
    inside = torch.cat(
        [
            torch.ones(len(pooled), dtype=torch.bool, device=x.device),
            ((xs >= low) & (xs <= high)).all(1),
        ]
    )
    _, inv = torch.unique(raw.clamp(0, bins - 1), dim=0, return_inverse=True)
    u = int(inv.max()) + 1
    n1, n2 = m.shape[0], h.shape[0]
    c1 = torch.bincount(inv[:n1], minlength=u).to(x.dtype)
    c2 = torch.bincount(inv[n1 : n1 + n2], minlength=u).to(x.dtype)
    zero = c1.new_zeros(1)  # an extra empty cell for queries outside the grid
    per_cell = _lemma5(
        to_numpy(torch.cat([c1, zero])),
        to_numpy(torch.cat([c2, zero])),
        n1,
        n2,
        prior=prior,
        delta=delta,
        n_dropped=n_dropped,
        method=method,
    )
    cell = to_numpy(torch.where(inside[n1 + n2 :], inv[n1 + n2 :], u))
    return _per_query(per_cell, cell, to_numpy(finite))
