"""Spending a run's confidence budget over its checks.

A monitor certifies figures at every check and its users read the run: the largest certified
advantage, any DP-violation alarm, early stopping on a certified bound. A bound that holds with
probability 1 − δ at each check says nothing about the maximum over checks (with nothing leaking,
40 checks of two queries × two methods at δ = 0.05 each certified leakage in 98.5 % of runs,
benchmarks/certificates.py).
So check k certifies at δ_k with Σ_k δ_k ≤ δ, split evenly over its figures: by the union bound
every certified figure of the run then holds simultaneously with probability ≥ 1 − δ, however
the checks depend on one another and however many there are.

The sequences:

* unplanned (the default): δ_k = δ / (S·(k+1)·ln²(k+1)), S = Σ_{j≥2} 1/(j·ln² j) ≤ 2.1097428015
  (the partial sum to 10⁷ plus the integral bound 1/ln 10⁷ on its tail). It decays barely faster
  than 1/k, so late checks — where leakage is usually largest — keep more of the budget than
  under the common 6δ/(π²k²): at k = 10 the share is 1.2× larger, at k = 100 3.6×.
* planned (``planned_checks = n``): (1 − η)·δ/n for each of the first n checks and the unplanned
  sequence on η·δ after them (η = 0.1), so checks beyond the plan are still covered. At n = 10
  a check certifies at δ/11 instead of δ/133 (unplanned, k = 10).
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
    """
    check_int(k, name="k", minimum=1)
    delta = check_open_unit(delta, name="delta")
    if planned_checks is None:
        return delta * _unplanned(k)
    check_int(planned_checks, name="planned_checks", minimum=1)
    if k <= planned_checks:
        return delta * (1 - OVERFLOW_SHARE) / planned_checks
    return delta * OVERFLOW_SHARE * _unplanned(k - planned_checks)
