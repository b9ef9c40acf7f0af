"""Spending a run's confidence budget over its checks.

A bound that holds with probability 1 − δ at each check says nothing about the maximum over
checks, so check k certifies at δ_k with Σ_k δ_k ≤ δ (:func:`check_delta`): by the union bound
every certified figure of the run then holds together with probability ≥ 1 − δ, however many
checks there are. Runs of unknown length spend δ_k = δ / (S·(k+1)·ln²(k+1)), which decays
barely faster than 1/k; a planned run spends (1 − η)·δ evenly over its planned checks and the
unknown-length sequence on η·δ = 0.1·δ after them.

The sequences and their constants: Theory, *Spending the run's confidence budget*.
"""

from __future__ import annotations

import math

from privmon._validation import check_int, check_open_unit

__all__ = ["OVERFLOW_SHARE", "check_delta"]

_SERIES_SUM = 2.1097428015  # an upper bound on Σ_{j≥2} 1/(j·ln² j): the shares sum to ≤ 1
OVERFLOW_SHARE = 0.1  # η: the part of δ kept for checks beyond a planned number


def _unplanned(k: int) -> float:
    """The k-th share (k ≥ 1) of a budget of 1, for a run of unknown length."""
    j = k + 1
    return 1.0 / (_SERIES_SUM * j * math.log(j) ** 2)


def check_delta(k: int, *, delta: float, planned_checks: int | None = None) -> float:
    """δ_k: the part of a run-level ``delta`` that check ``k`` (1, 2, …) may spend, Σ_k δ_k ≤ δ.

    Args:
        k: the check's number in the run, from 1.
        delta: the run-level budget, in (0, 1).
        planned_checks: the number of checks the run is planned to have, or None (unknown).
            A plan spends (1 − η)·δ evenly over its checks and η·δ (η = 0.1) over any beyond it.

    Examples:
        >>> from privmon.estimators.spending import check_delta
        >>> round(check_delta(1, delta=0.05), 5), round(check_delta(10, delta=0.05), 5)
        (0.02466, 0.00037)
        >>> round(check_delta(10, delta=0.05, planned_checks=10), 5)
        0.0045
    """
    check_int(k, name="k", minimum=1)
    delta = check_open_unit(delta, name="delta")
    if planned_checks is None:
        return delta * _unplanned(k)
    check_int(planned_checks, name="planned_checks", minimum=1)
    if k <= planned_checks:
        return delta * (1 - OVERFLOW_SHARE) / planned_checks
    return delta * OVERFLOW_SHARE * _unplanned(k - planned_checks)
