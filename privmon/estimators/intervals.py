"""Exact binomial confidence bounds (Clopper–Pearson), shared by the advantage certificate,
the individual-risk intervals (MACE Lemma 5) and the epsilon audit."""

from __future__ import annotations

import numpy as np
from scipy.special import betaincinv

__all__ = ["clopper_pearson_lower", "clopper_pearson_upper"]


def clopper_pearson_lower(successes, trials, alpha: float | np.ndarray) -> np.ndarray:
    """One-sided exact lower bound on a binomial proportion at level 1 - alpha.

    P(true p < bound) <= alpha. Vectorized over ``successes`` / ``trials`` / ``alpha``; 0 where
    successes == 0.
    """
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        # beta.ppf(alpha, k, n - k + 1), without scipy.stats' per-call argument handling
        out = betaincinv(k, n - k + 1, alpha)
    return np.where((k <= 0) | np.isnan(out), 0.0, out)


def clopper_pearson_upper(successes, trials, alpha: float | np.ndarray) -> np.ndarray:
    """One-sided exact upper bound on a binomial proportion at level 1 - alpha.

    P(true p > bound) <= alpha. Vectorized; 1 where successes == trials.
    """
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = betaincinv(k + 1, n - k, 1.0 - alpha)
    return np.where((k >= n) | np.isnan(out), 1.0, out)
