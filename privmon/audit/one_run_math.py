"""Count-level one-run audit bounds: (canaries, guesses, correct guesses) to a lower bound on ε.

Steinke et al.'s p-value of "(ε, δ)-DP" (:func:`steinke_p_value`, "Privacy Auditing with One (1)
Training Run") and Mahloujifar et al.'s Algorithm 3 with the Gaussian trade-off curve
(:func:`fdp_rejects`, "Auditing f-Differential Privacy in One Run"), μ-GDP then converted to ε
at δ (:func:`gdp_epsilon`; Dong, Roth, Su, "Gaussian Differential Privacy", Corollary 2.13). Each
bound is the first parameter value the test can no longer refute, searched on vectorized grids
and rounded down, so rounding never lifts a bound. The formulas: docs, Theory page, *One-run ε
lower bounds*.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

__all__ = [
    "fdp_mu",
    "fdp_rejects",
    "gdp_epsilon",
    "split_p_value",
    "steinke_epsilon",
    "steinke_p_value",
]

_GRID = 33  # parameter values per vectorised evaluation
_ROUNDS = 3  # refinements of the first bracket
_CAP = 64.0  # no bound above this (ε: q rounds to 1 long before; μ-GDP: ε in the thousands)
_TAIL_SD = 40.0  # the binomial mass more than 40 sd below its mean is < 1e-300


def steinke_p_value(
    n_canaries: int, n_guesses: int, n_correct: int, epsilon: np.ndarray, delta: float
) -> np.ndarray:
    """p-values of "(ε, δ)-DP" given ``n_correct`` of ``n_guesses`` guesses right, for an array
    of ε (Steinke et al., "Privacy Auditing with One (1) Training Run": β + α·δ·2m, at most 1).

    α is computed from the binomial probabilities from ``n_correct - 1`` down to 40 standard
    deviations below the mode; the mass below that (< 1e-300) is added to the last window term,
    so the value returned is never below the formula's.
    """
    eps = np.atleast_1d(np.asarray(epsilon, dtype=np.float64))
    m, r, v = n_canaries, n_guesses, n_correct
    if v == 0:
        return np.ones_like(eps)
    q = special.expit(eps)
    beta = special.bdtrc(v - 1, r, q)
    if delta == 0.0:
        return np.minimum(1.0, beta)
    q_low = float(q.min())  # the widest window any ε of the call needs
    mode_low = r * q_low - _TAIL_SD * math.sqrt(r * q_low * (1.0 - q_low)) - 1.0
    lo = int(min(v - 1, max(0.0, math.floor(mode_low))))
    k = np.arange(v - 1, lo - 1, -1, dtype=np.float64)  # v-1, v-2, ..., lo: i = 1..W
    log_choose = special.gammaln(r + 1.0) - special.gammaln(k + 1.0) - special.gammaln(r - k + 1.0)
    log_pmf = (
        log_choose[None, :]
        + k[None, :] * special.log_expit(eps)[:, None]
        + (r - k)[None, :] * special.log_expit(-eps)[:, None]
    )
    mass = np.cumsum(np.exp(log_pmf), axis=1)  # P[v - i <= B < v], i = 1..W
    width = k.size
    alpha = np.max(mass / np.arange(1.0, width + 1.0)[None, :], axis=1)
    if lo > 0:  # i > W: P[v - i <= B < v] <= mass[W] + P[B < lo]
        below = special.bdtr(lo - 1, r, q)
        alpha = np.maximum(alpha, (mass[:, -1] + below) / (width + 1.0))
    return np.minimum(1.0, beta + alpha * delta * 2.0 * m)


def fdp_rejects(
    n_canaries: int, n_guesses: int, n_correct: int, mu: np.ndarray, significance: float
) -> np.ndarray:
    """Whether Algorithm 3 of Mahloujifar et al., "Auditing f-Differential Privacy in One Run",
    refutes μ-GDP at level ``significance``, for an array of μ.

    r[c] = τc/m, h[c] = τ(c' - c)/m; for i = c - 1 down to 0: h[i] = max(h[i+1],
    f̄⁻¹(r[i+1])), r[i] = r[i+1] + i/(c' - i)·(h[i] - h[i+1]); refuted when
    r[0] + h[0] > c'/m (the least probability mass that c correct guesses with probability τ
    need exceeds 1). Once h stops growing for a μ it never grows again, so the recursion stops
    when it has stopped for every μ; r is capped at 1 (Φ⁻¹ is undefined above it, and a capped
    r already refutes).
    """
    mus = np.atleast_1d(np.asarray(mu, dtype=np.float64))
    m, cp, c, tau = n_canaries, n_guesses, n_correct, significance
    r = np.full(mus.shape, tau * c / m)
    h = np.full(mus.shape, tau * (cp - c) / m)
    for i in range(c - 1, -1, -1):
        h_next = np.maximum(h, special.ndtr(special.ndtri(r) - mus))
        grown = h_next - h
        if not grown.any():
            break
        r = np.minimum(r + (i / (cp - i)) * grown, 1.0)
        h = h_next
    return r + h > cp / m


def _first_failure(fails, floor: float) -> float:
    """The largest grid value below the first value at which ``fails`` (vectorised, monotone
    from False to True) holds, searched from ``floor`` (returned when it already fails)."""
    if fails(np.array([floor]))[0]:
        return floor
    lo, hi = floor, max(1.0, 2.0 * floor)
    while not fails(np.array([hi]))[0]:
        if hi >= _CAP:
            return _CAP
        lo, hi = hi, min(2.0 * hi, _CAP)
    for _ in range(_ROUNDS):
        grid = np.linspace(lo, hi, _GRID)
        first = int(np.argmax(fails(grid)))  # grid[0] never fails, grid[-1] does
        lo, hi = grid[first - 1], grid[first]
    return float(lo)


def steinke_epsilon(
    n_canaries: int,
    n_guesses: int,
    n_correct: int,
    delta: float,
    significance: float,
    *,
    floor: float = 0.0,
) -> float:
    """Steinke et al.'s ε lower bound: the first ε whose p-value reaches ``significance``
    (to 1/32768 of the first bracket, rounded down); ``floor`` is returned at once when its
    p-value already does (a candidate that cannot beat a bound in hand)."""

    def fails(eps: np.ndarray) -> np.ndarray:
        return steinke_p_value(n_canaries, n_guesses, n_correct, eps, delta) >= significance

    return _first_failure(fails, floor)


def fdp_mu(
    n_canaries: int, n_guesses: int, n_correct: int, significance: float, *, floor: float = 0.0
) -> float:
    """The largest μ whose μ-GDP Algorithm 3 refutes (Mahloujifar et al.), rounded down as
    :func:`steinke_epsilon`; ``floor`` is returned at once when it is not refuted."""

    def fails(mu: np.ndarray) -> np.ndarray:
        return ~fdp_rejects(n_canaries, n_guesses, n_correct, mu, significance)

    return _first_failure(fails, floor)


def _gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) (the second term in logs)."""
    first = special.ndtr(-epsilon / mu + mu / 2.0)
    return float(first - np.exp(epsilon + special.log_ndtr(-epsilon / mu - mu / 2.0)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε of μ-GDP at ``delta`` > 0 (Dong, Roth, Su, Corollary 2.13); 0 when μ-GDP is
    already (0, δ)-DP."""
    if mu <= 0.0 or _gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while _gdp_delta(hi, mu) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: _gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12))


def split_p_value(n_in: int, n_out: int) -> float:
    """The two-sided p-value of ``n_in`` canaries in and ``n_out`` out under independent fair
    coins: 2 · min(P[B <= n_in], P[B >= n_in]) for B ~ Binomial(n_in + n_out, 1/2), at most 1."""
    m = n_in + n_out
    low = special.bdtr(n_in, m, 0.5)
    high = special.bdtrc(n_in - 1, m, 0.5) if n_in > 0 else 1.0
    return float(min(1.0, 2.0 * min(low, high)))
