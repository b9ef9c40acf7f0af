"""What the framework adapters share: spotting a new report, and writing to a framework's logger
without letting a logger's failure stop training."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from privmon.report import Report
from privmon.sinks.base import finite_scalars

__all__ = ["new_report", "publish"]

logger = logging.getLogger("privmon")


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
