"""MACE Lemma 7: bounds on a generalized metric of the Bayes rule from per-record intervals on the
posterior η, combined over the evaluation records as in App. D (:func:`lemma7_bounds`)."""

from __future__ import annotations

import math

import numpy as np

from privmon.estimators.generalized_metric import GeneralizedMetric

__all__ = ["lemma7_bounds", "record_terms"]


def record_terms(metric: GeneralizedMetric, eta: np.ndarray, member: np.ndarray):
    """Lemma 7's numerator and denominator divided by x·p + y·(1−p): functions of η only.

    n(η) = a0 + I·(a11·η + a10·(1−η)) + (1−I)·(a01·η + a00·(1−η)), d likewise with b.
    """
    i = member.astype(np.float64)
    n = metric.a0 + i * (metric.a11 * eta + metric.a10 * (1 - eta))
    n = n + (1 - i) * (metric.a01 * eta + metric.a00 * (1 - eta))
    d = metric.b0 + i * (metric.b11 * eta + metric.b10 * (1 - eta))
    d = d + (1 - i) * (metric.b01 * eta + metric.b00 * (1 - eta))
    return n, d


def _lemma7_candidates(metric: GeneralizedMetric, t: float, eta_lo: np.ndarray, eta_hi: np.ndarray):
    """Per record (rows), the 4 points where Lemma 7's objective can reach its extremes.

    Lemma 7's objective is homogeneous of degree 0 in (x, y), so it depends on the box only through
    η = x·p/(x·p + y·(1−p)), which is increasing in x and decreasing in y: over the box η sweeps
    exactly [η(x_lo, y_hi), η(x_hi, y_lo)] = [(1 + f_lo)/2, (1 + f_hi)/2] (Lemma 5 / 6's corners).
    The indicator I = 1{x ≥ (1−p)t/((1−t)p)·y} is 1{η ≥ t}: the switching line is η = t. On each
    side of it n(η)/d(η) is a linear-fractional function of η, hence monotone, so its extremes
    are at the ends of the pieces: η_lo, η_hi and t approached from each side (t with I = 0 is a
    limit, a supremum / infimum, which is what a bound needs).
    """
    below = eta_lo < t  # the I = 0 piece [η_lo, min(η_hi, t))
    above = eta_hi >= t  # the I = 1 piece [max(η_lo, t), η_hi]
    eta = np.stack([eta_lo, np.minimum(eta_hi, t), np.maximum(eta_lo, t), eta_hi], axis=1)
    ind = np.broadcast_to(np.array([False, False, True, True]), eta.shape)
    valid = np.stack([below, below, above, above], axis=1)
    n, d = record_terms(metric, eta, ind)
    return n, d, valid


def _ratio_of_sums_max(n, d, valid, w) -> float:
    """max over per-record choices c_i of Σ w_i·n_ic / Σ w_i·d_ic, by Dinkelbach's iteration.

    F(λ) = max_choice Σ w·(n − λ·d) is separable over records (one vectorized argmax per step);
    from a feasible λ, λ ← N/D of the maximizing choice increases until F(λ) = 0, where λ is the
    maximal ratio (finite and superlinear: a handful of steps). Requires d >= 0, and n = 0 where
    d = 0 (such options drop out: PPV where the rule says non-member); NaN otherwise.
    """
    if (valid & ((d < 0) | ((d == 0) & (n != 0)))).any():
        return math.nan
    pos = valid & (d > 0)
    if not pos.any():
        return math.nan
    lam = float((n[pos] / d[pos]).min())  # the ratio of a feasible choice: a start below the max
    nv, dv = np.where(valid, n, -np.inf), np.where(valid, d, 0.0)
    rows = np.arange(n.shape[0])
    for _ in range(100):
        pick = np.argmax(nv - lam * dv, axis=1)
        num, den = float(w @ n[rows, pick]), float(w @ d[rows, pick])
        if den <= 0 or num - lam * den <= 0:
            break  # F(λ) <= 0: no choice beats λ
        lam = num / den
    return lam


def lemma7_bounds(metric: GeneralizedMetric, t: float, eta_lo, eta_hi, w) -> tuple[float, float]:
    """MACE Lemma 7 per record, combined over the evaluation records as in App. D.

    Linear metrics (population form, denominator the constant D): ℓ is the weighted average of
    the per-record risks, and the bounds are exactly App. D's average of the per-record Lemma-7
    bounds. Other metrics: ℓ = E[n]/E[d] (a ratio of averages, not an average of ratios), bounded
    over the same per-record intervals by :func:`_ratio_of_sums_max`; App. D's plain average of
    per-record ratios would bound a different quantity (and PPV's per-record risk is 0/0 wherever
    the rule says non-member).
    """
    n, d, valid = _lemma7_candidates(metric, t, eta_lo, eta_hi)
    if metric.b11 == metric.b10 == metric.b01 == metric.b00 == 0.0:
        lo = float(w @ np.where(valid, n, np.inf).min(axis=1)) / metric.b0
        hi = float(w @ np.where(valid, n, -np.inf).max(axis=1)) / metric.b0
        return (lo, hi) if metric.b0 > 0 else (hi, lo)
    hi = _ratio_of_sums_max(n, d, valid, w)
    lo = -_ratio_of_sums_max(-n, d, valid, w)
    return lo, hi
