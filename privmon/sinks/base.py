"""The :class:`Sink` protocol: where a :class:`~privmon.report.Report` goes after each check.

A sink is any object with ``write(report)`` and ``close()``; nothing needs to inherit from
:class:`Sink`. :class:`~privmon.PrivacyMonitor` calls ``write`` once per successful check, on rank
0 only under ``torch.distributed``, and ``close`` from ``monitor.close()``. An exception raised by
``write`` is logged and skipped like any failure inside a check (``strict=True`` re-raises), so a
sink never stops training. :class:`Backlog` keeps the reports a sink could not write yet.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from privmon.report import Report

__all__ = ["Backlog", "Sink", "finite_scalars"]

logger = logging.getLogger("privmon")


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(report)`` and ``close()`` (structural: no inheritance needed).

    Pass sinks as ``PrivacyMonitor(..., sinks=[...])``. ``report.scalars`` is a flat
    ``{tag: float}`` dict (the TensorBoard tags, all under ``privacy/``).

    Examples:
        >>> from privmon.report import Report
        >>> from privmon.sinks import Sink
        >>> class PrintSink:
        ...     def write(self, report):
        ...         print(report.step, report.scalars["privacy/loss/auc"])
        ...     def close(self):
        ...         pass
        >>> isinstance(PrintSink(), Sink)
        True
        >>> PrintSink().write(Report(step=100, scalars={"privacy/loss/auc": 0.61}))
        100 0.61
    """

    def write(self, report: Report) -> None:
        """Record one check's report (called once per successful check, on rank 0)."""
        ...

    def close(self) -> None:
        """Flush and release what the sink owns (called by ``monitor.close()``)."""
        ...


def finite_scalars(report: Report) -> dict[str, float]:
    """The report's scalars without NaN / infinite values (e.g. an ε lower bound of ``inf``), for
    loggers that refuse them.

    Examples:
        >>> from privmon.report import Report
        >>> from privmon.sinks import finite_scalars
        >>> scalars = {
        ...     "privacy/loss/auc": 0.61,
        ...     "privacy/loss/histogram/epsilon_lower_bound": float("inf"),
        ... }
        >>> finite_scalars(Report(step=100, scalars=scalars))
        {'privacy/loss/auc': 0.61}
    """
    return {k: float(v) for k, v in report.scalars.items() if math.isfinite(v)}


class Backlog:
    """Reports a sink could not write yet, written first at its next write.

    A transient fault (a full disk, a lost mount) then delays figures instead of losing them: each
    report stays queued until written, oldest first. At most ``limit`` are kept (the oldest beyond
    are dropped, counted in ``n_dropped`` and logged); queued reports keep their per-record arrays
    only for the newest, so a long outage holds scalars, not records' risks.
    """

    def __init__(self, limit: int = 1000) -> None:
        self._queue: deque[Report] = deque()
        self.limit = limit
        self.n_dropped = 0

    def write(self, report: Report, write_one: Callable[[Report], None]) -> None:
        """Queue ``report``, then write every queued report with ``write_one`` in order; one that
        raises stays queued with those after it, and the error propagates."""
        if self._queue:
            self._queue[-1] = self._queue[-1].without_arrays()
        self._queue.append(report)
        while len(self._queue) > self.limit:
            dropped = self._queue.popleft()
            self.n_dropped += 1
            logger.error("privmon: a sink's backlog is full; step %s is lost", dropped.step)
        while self._queue:
            write_one(self._queue[0])
            self._queue.popleft()
