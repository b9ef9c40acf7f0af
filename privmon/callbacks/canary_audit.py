"""The one-run canary audit at a check: the canaries' ε lower bounds beside the accountant's ε.

The monitor calls :func:`canary_figures` once per check with the canaries' scores (from their
``scores()``: :class:`~privmon.audit.GradientCanaries`, :class:`~privmon.audit.InputCanaries`
bound to a query, or any object whose ``scores()`` returns ``(in_scores, out_scores)``, higher =
included). Each method of :data:`CANARY_METHODS` gives an ε lower bound
(:func:`privmon.audit.one_run_epsilon`, Steinke et al. "Privacy Auditing with One (1) Training
Run"; Mahloujifar et al. "Auditing f-Differential Privacy in One Run") at the significance the
check allots it, so that, like every certified figure of the monitor, all of them at every check
hold together over the run. An audited ε above the accountant's ε is a DP violation: the
implementation or its accounting is broken (noise dropped or applied in the wrong place, a
sampling rate the accountant was not told). Unlike the advantage-vs-ceiling comparison it needs
no assumption on the audit sets: the canaries' inclusion is randomised by design.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from privmon.audit.one_run import one_run_epsilon
from privmon.report import tags
from privmon.report.build import CanaryFigures

__all__ = ["CANARY_METHODS", "canary_figures", "check_canaries"]

CANARY_METHODS: tuple[Literal["fdp", "steinke"], ...] = ("fdp", "steinke")
"""The one-run bounds a check reports: f-DP (μ-GDP, then ε at δ) and Steinke et al.'s."""

# an audited ε above the accountant's by less than this is rounding, not a violation
_TOLERANCE = 1e-9


def check_canaries(canaries: Any) -> Any:
    """Return ``canaries`` after checking it has a ``scores()`` method (the monitor calls it
    without arguments; bind :class:`~privmon.audit.InputCanaries` to a query first)."""
    if not callable(getattr(canaries, "scores", None)):
        raise ValueError(
            "canaries must have a scores() method returning (in_scores, out_scores): a "
            "privmon.audit.GradientCanaries, or privmon.audit.InputCanaries(records, query=...), "
            f"got {type(canaries).__name__}"
        )
    return canaries


def canary_figures(
    in_scores: Any,
    out_scores: Any,
    *,
    delta: float,
    significance: float,
    epsilon: float | None,
    step: int,
) -> CanaryFigures:
    """Each :data:`CANARY_METHODS` bound of the canaries' scores at ``significance`` (the share
    of the run's confidence budget this check gives each method), compared with the
    accountant's ``epsilon`` (None without an accountant) at ``delta``."""
    scalars: dict[str, float] = {}
    messages: list[str] = []
    violation = False
    for method in CANARY_METHODS:
        audit = one_run_epsilon(
            in_scores, out_scores, delta=delta, significance=significance, method=method
        )
        scalars[tags.canary_epsilon(method)] = audit.epsilon
        scalars[tags.CANARY_COUNT] = float(audit.n_canaries + audit.n_selection)
        if epsilon is not None and not math.isnan(epsilon):
            if audit.epsilon > epsilon + _TOLERANCE:
                violation = True
                messages.append(
                    f"privmon: DP violation at step {step}: the one-run canary audit ({method}) "
                    f"certifies ε ≥ {audit.epsilon:.3g} at δ = {delta:g}, above the accountant's "
                    f"ε = {epsilon:.3g}: the DP implementation or its accounting is broken (noise "
                    "dropped or applied in the wrong place, a sampling rate the accountant was not "
                    "told, …)"
                )
    return CanaryFigures(scalars, violation, tuple(messages))
