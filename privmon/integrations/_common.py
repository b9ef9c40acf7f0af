"""What the framework adapters share: planning the checks from the trainer's length, spotting a
new report, and writing to a framework's logger (each check's figures, early stopping's decision
among them; at the end of training, the budget's outcome) without letting a logger's failure
stop training."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from privmon.report import Report
from privmon.sinks.base import finite_scalars

__all__ = ["new_report", "plan_checks", "publish", "publish_outcome"]

logger = logging.getLogger("privmon")


def plan_checks(monitor: Any, total_steps: Any, *, source: str) -> None:
    """Plan the monitor's checks from the trainer's length (``PrivacyMonitor.plan``) when that
    is a known, finite number of steps (``source`` names where it came from, for the log);
    an unknown length leaves the sequence for runs of unknown length. A failure is logged,
    not raised (``strict=True`` re-raises): planning only tightens the certificates."""
    plan = getattr(monitor, "plan", None)
    if not callable(plan):
        return
    try:
        known = isinstance(total_steps, int | float) and math.isfinite(total_steps)
        if not known or total_steps < 1:
            logger.info(
                "privmon: the checks are left unplanned (%s: %r): they certify under the "
                "sequence for runs of unknown length; pass planned_checks for tighter bounds",
                source,
                total_steps,
            )
            return
        plan(total_steps=int(total_steps))
    except Exception:
        if getattr(monitor, "strict", False):
            raise
        logger.exception("privmon: planning the checks from %s failed", source)


def new_report(monitor: Any, before: Report | None) -> Report | None:
    """The monitor's last report when a check ran since ``before`` was read, else None."""
    report: Report | None = monitor.last_report
    return report if report is not None and report is not before else None


def publish(monitor: Any, report: Report, write: Callable[[dict[str, float]], Any], *, what: str):
    """Call ``write`` with the report's finite scalars; a failure is logged, not raised (the
    monitor's ``strict=True`` re-raises), like a failing sink."""
    try:
        write(finite_scalars(report))
    except Exception:
        if getattr(monitor, "strict", False):
            raise
        logger.exception("privmon: writing the step-%s figures to %s failed", report.step, what)


def publish_outcome(monitor: Any, write: Callable[[dict[str, float]], Any], *, what: str) -> None:
    """At the end of training, call ``write`` with the finite numbers of early stopping's outcome
    (``privacy/stopping/stopped``, ``…/stopped_step``, ``…/highest``, ``…/highest_step``,
    ``…/restored_step``); nothing without early stopping or before its first decision. A failure
    is logged, not raised (``strict=True`` re-raises)."""
    outcome = getattr(monitor, "stopping_outcome", None)
    if outcome is None or not outcome.checks:
        return
    try:
        write({k: v for k, v in outcome.scalars().items() if math.isfinite(v)})
    except Exception:
        if getattr(monitor, "strict", False):
            raise
        logger.exception("privmon: writing early stopping's outcome to %s failed", what)
