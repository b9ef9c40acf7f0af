"""The p-values of the DP mechanism checks (:class:`~privmon.audit.MechanismChecks`), from the
run's sufficient statistics: the noise actually added against N(0, σ²C²), and the rows per step
against Binomial(N, q) for every N the optimizer's expected batch size allows; and the rounding
that a correct clipping path may add to the clipping probe. Derivations: docs, Theory page,
*Mechanism checks*."""

from __future__ import annotations

import math

import numpy as np
from scipy import special

__all__ = [
    "CLIP_TOLERANCE",
    "RowCounts",
    "binomial_population",
    "clip_tolerance",
    "dispersion_p_value",
    "mean_p_value",
    "noise_p_value",
    "resolved_sum",
]

GRID = 33  # points of the population interval at which the dispersion p-value is evaluated
CLIP_TOLERANCE = 1e-4  # the least excess over C that the clipping probe reads as a fault
# The operations of a flat clipping path that round a probe's value once each, besides the levels
# of its two sums: each tensor's norm (squares, root, its result in the dtype), their norm
# (likewise), the sum with 1e-6, C divided by it, the clipped entries.
CLIP_ROUNDINGS = 9


def clip_tolerance(eps: float, tiny: float, bound: float, largest: int, tensors: int) -> float:
    """The relative excess over C that rounding allows the clipping probe's contribution through
    a correct clipping path, in a precision of machine epsilon ``eps`` and smallest normal
    ``tiny``, for the probe's row over ``tensors`` tensors of at most ``largest`` entries at
    bound C = ``bound``: Higham's γ_m = m u / (1 − m u), u = eps / 2, for m = CLIP_ROUNDINGS
    roundings plus one per level of the two pairwise sums of squares (⌈log₂ largest⌉ and
    ⌈log₂ tensors⌉); the clipped entries, about C / √(tensors · largest), carry u · tiny /
    entry where that is below ``tiny`` (subnormal). At least CLIP_TOLERANCE; inf when the
    precision cannot resolve the entries (m u ≥ 1).

    Examples:
        >>> from privmon.audit.mechanism_math import clip_tolerance
        >>> round(clip_tolerance(2**-7, 1.2e-38, 1.0, 96, 4), 4)  # bfloat16, a 2-layer MLP
        0.0756
        >>> clip_tolerance(2**-23, 1.2e-38, 1.0, 96, 4)  # float32: the floor
        0.0001
    """
    u = eps / 2
    levels = math.ceil(math.log2(max(largest, 1))) + math.ceil(math.log2(max(tensors, 1)))
    entry = bound / math.sqrt(max(tensors, 1) * max(largest, 1))
    subnormal = tiny / entry if entry > 0 else 1.0
    total = u * (CLIP_ROUNDINGS - 1 + levels + max(1.0, subnormal))
    if total >= 1:
        return math.inf
    return max(CLIP_TOLERANCE, total / (1 - total))


def noise_p_value(scaled_squares: float, values: int) -> float:
    """P(χ²_values ≤ S) for S = Σ z² / (σ C)² over ``values`` noise values z: small when the
    noise added is smaller than the accountant's N(0, σ² C²) (one-sided: more noise than
    accounted is no privacy fault). 1 without values.

    Examples:
        >>> from privmon.audit.mechanism_math import noise_p_value
        >>> round(noise_p_value(1000.0, 1000), 2)  # as much noise as accounted
        0.51
        >>> noise_p_value(250.0, 1000) < 1e-100  # half the standard deviation
        True
    """
    if math.isnan(scaled_squares):
        raise ValueError("scaled_squares must be a number, got NaN (leave non-finite noise out)")
    if values <= 0:
        return 1.0
    return float(special.chdtr(values, max(scaled_squares, 0.0)))


def resolved_sum(scale: float, eps: float, tiny: float) -> float:
    """The largest |s| of a summed-gradient entry at which a precision of machine epsilon
    ``eps`` and smallest normal ``tiny`` resolves noise N(0, scale²) added to s: its spacing,
    at most eps · max(|x|, tiny) at x, stays within scale / 4 over s ± 10 scale, so rounding
    s + noise adds about spacing² / 12 to the noise's variance and removes none. −1 (no entry)
    when the precision's spacing near 0 is coarser.

    Examples:
        >>> from privmon.audit.mechanism_math import resolved_sum
        >>> resolved_sum(1.0, 2**-7, 1.2e-38)  # bfloat16 resolves σ C = 1 up to |s| = 22
        22.0
    """
    if eps * tiny > scale / 4:
        return -1.0
    return scale * (1 / (4 * eps) - 10)


def binomial_population(expected_batch_size: float, sample_rate: float) -> tuple[float, float]:
    """The interval of dataset sizes N that Opacus' ``expected_batch_size`` E allows at
    sampling rate q: ``make_private`` sets E = int(N q), so N q ∈ [E, E + 1), i.e. N ∈
    [E / q, (E + 1) / q], widened by 1e-9 relative at both ends for the rounding of N q (with
    q = 1/N, N q may be computed as 0.99999999 and E as 0).

    Examples:
        >>> from privmon.audit.mechanism_math import binomial_population
        >>> [round(n, 6) for n in binomial_population(60, 0.1)]
        [600.0, 610.0]
    """
    return (
        expected_batch_size / sample_rate * (1 - 1e-9),
        (expected_batch_size + 1) / sample_rate * (1 + 1e-9),
    )


class RowCounts:
    """Rows per logical step k_t and the rate q_t the accountant used, kept as the sums the
    sampling tests need (O(1) memory): steps with q_t = 1 carry no test and are left out.

    Examples:
        >>> from privmon.audit.mechanism_math import RowCounts, mean_p_value
        >>> counts = RowCounts()
        >>> for k in (60, 55, 64, 58):
        ...     counts.add(k, 0.1)
        >>> counts.steps, counts.rows
        (4, 237.0)
        >>> round(mean_p_value(counts, 600.0, 610.0), 2)  # 237 rows ≈ 4 × 60: nothing to see
        0.86
    """

    FIELDS = ("steps", "rows", "k_sq", "q_sum", "q_var", "k2", "kq", "qq", "inv", "k_min", "k_max")

    def __init__(self) -> None:
        self.steps = 0
        self.rows = 0.0  # Σ k
        self.k_sq = 0.0  # Σ k²
        self.q_sum = 0.0  # Σ q
        self.q_var = 0.0  # Σ q (1 - q)
        self.k2 = 0.0  # Σ k² / (q (1 - q))
        self.kq = 0.0  # Σ k / (1 - q)
        self.qq = 0.0  # Σ q / (1 - q)
        self.inv = 0.0  # Σ 1 / (q (1 - q))
        self.k_min = math.inf
        self.k_max = -math.inf

    def add(self, rows: int, rate: float) -> None:
        """Count one logical step of ``rows`` rows at the accountant's rate ``rate``."""
        if not 0 < rate < 1:
            return
        var = rate * (1 - rate)
        self.steps += 1
        self.rows += rows
        self.k_sq += rows * rows
        self.q_sum += rate
        self.q_var += var
        self.k2 += rows * rows / var
        self.kq += rows / (1 - rate)
        self.qq += rate / (1 - rate)
        self.inv += 1 / var
        self.k_min = min(self.k_min, rows)
        self.k_max = max(self.k_max, rows)

    def state(self) -> dict[str, float]:
        """The sums, as plain numbers."""
        return {name: float(getattr(self, name)) for name in self.FIELDS}

    def load(self, state: dict[str, float]) -> None:
        """Restore :meth:`state`."""
        for name in self.FIELDS:
            setattr(self, name, float(state[name]))
        self.steps = int(self.steps)

    def dispersion(self, population: float) -> float:
        """D(N) = Σ (k_t − N q_t)² / (N q_t (1 − q_t))."""
        return self.k2 / population - 2 * self.kq + population * self.qq

    def dispersion_variance(self, population: float) -> float:
        """Var D(N) under Binomial(N, q_t) rows: Σ 2 + (1 − 6 q_t (1 − q_t)) / (N q_t (1 − q_t))."""
        return 2 * self.steps + (self.inv - 6 * self.steps) / population


def _two_sided_normal(distance: float, sd: float) -> float:
    if sd <= 0:
        return 1.0 if distance <= 0 else 0.0
    return float(min(1.0, 2 * special.ndtr(-max(distance, 0.0) / sd)))


def mean_p_value(counts: RowCounts, n_low: float, n_high: float) -> float:
    """Two-sided p-value of the total rows Σ k_t against Σ Binomial(N, q_t) (normal approximation
    with a continuity correction), the largest over N ∈ [n_low, n_high]: 1 when the total lies
    between the means at both ends, else the p-value at the nearer end (where it is largest)."""
    if counts.steps == 0:
        return 1.0
    low, high = n_low * counts.q_sum, n_high * counts.q_sum
    if low <= counts.rows <= high:
        return 1.0
    population, mean = (n_high, high) if counts.rows > high else (n_low, low)
    return _two_sided_normal(abs(counts.rows - mean) - 0.5, math.sqrt(population * counts.q_var))


def _dispersion_p(counts: RowCounts, population: float) -> float:
    """Two-sided p-value of D(N) against c·χ²(ν) with the mean T and the variance of D (the
    binomial's kurtosis included)."""
    t = counts.steps
    variance = max(counts.dispersion_variance(population), 1e-12)
    scale, dof = variance / (2 * t), 2 * t * t / variance
    x = max(counts.dispersion(population), 0.0) / scale
    lower = float(special.chdtr(dof, x))
    upper = float(special.chdtrc(dof, x))
    return min(1.0, 2 * min(lower, upper))


def dispersion_p_value(counts: RowCounts, n_low: float, n_high: float) -> float:
    """Two-sided p-value of the dispersion of rows per step, D = Σ (k_t − N q_t)² / (N q_t (1 −
    q_t)), against its law under Binomial(N, q_t) rows (about χ²(T)): small when batches vary
    less than Poisson sampling makes them (fixed batches: D ≈ 0) or more. The largest over N ∈
    [n_low, n_high] (a grid and the minimiser of D).

    Examples:
        >>> from privmon.audit.mechanism_math import RowCounts, dispersion_p_value
        >>> fixed = RowCounts()
        >>> for _ in range(400):
        ...     fixed.add(60, 0.1)  # 60 rows every step: no Poisson sampling
        >>> dispersion_p_value(fixed, 600.0, 610.0) < 1e-100
        True
    """
    if counts.steps == 0:
        return 1.0
    grid = list(np.linspace(n_low, n_high, GRID))
    if counts.qq > 0:
        grid.append(min(max(math.sqrt(counts.k2 / counts.qq), n_low), n_high))
    return max(_dispersion_p(counts, float(n)) for n in grid)
