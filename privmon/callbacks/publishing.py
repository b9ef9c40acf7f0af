"""What the monitor tells its sinks and the console besides the figures: early stopping's decision,
taken on each report before any sink writes it (so every sink writes the decision beside the
figures), and the budget's outcome over the run (:class:`~privmon.report.stopping.
StoppingOutcome`) at ``close()`` and when an adapter restored earlier weights; a sink's or
early stopping's failure is logged, never raised into training (``strict`` re-raises)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from privmon._process_group import rank_and_world
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.traps import Traps
from privmon.report import Report
from privmon.report.stopping import StoppingOutcome
from privmon.sinks.base import Sink

__all__ = ["call_or_log", "decided", "publish", "say_outcome", "stopped"]

logger = logging.getLogger("privmon")


def call_or_log(
    fn: Callable[..., Any], *args: Any, what: str, strict: bool, step: int | None = None
) -> Any:
    """``fn(*args)``; a failure is logged (re-raised when ``strict``) and gives None.

    Examples:
        >>> from privmon.callbacks.publishing import call_or_log
        >>> call_or_log(int, "12", what="parsing", strict=False), call_or_log(
        ...     int, "x", what="parsing", strict=False)  # the second is logged
        (12, None)
    """
    try:
        return fn(*args)
    except Exception:
        if strict:
            raise
        logger.exception("privmon: %s failed at step %s", what, step)
        return None


def decided(
    report: Report, stopping: PrivacyEarlyStopping | None, traps: Traps, *, strict: bool
) -> tuple[Report, bool]:
    """(``report`` with early stopping's decision on it, whether training stops): the decision
    on ``report.stopping``, its numbers among the scalars (``stopping.update``, then its
    ``decision``). Without early stopping, when the check has the canaries' figures alone, or
    when deciding failed (logged; ``strict``: raised), the report stays as it is. Under
    torch.distributed rank 0 decides, and every rank takes its decision.

    Examples:
        >>> from privmon.callbacks.publishing import decided
        >>> from privmon.callbacks.traps import Traps
        >>> from privmon.report import Report
        >>> report = Report(step=100, scalars={"privacy/loss/histogram/lower": 0.3}, run_id="a")
        >>> decided(report, None, Traps(), strict=False) == (report, False)
        True
    """
    if stopping is None or not report.queries:  # the canaries' figures alone: no decision
        return report, False
    if not traps.stopping_checked:
        traps.check_stopping_figure(stopping, report.scalars, strict=strict)
    stop = call_or_log(
        stopping.update, report.step, report.scalars, what="early stopping", strict=strict,
        step=report.step,
    )  # fmt: skip
    decision = getattr(stopping, "decision", None) if stop is not None else None
    if decision is None:
        return report, bool(stop)
    scalars = {**report.scalars, **decision.scalars()}
    return dataclasses.replace(report, scalars=scalars, stopping=decision), bool(stop)


def publish(report: Report, sinks: Sequence[Sink], *, other_runs: Any, strict: bool) -> None:
    """Every sink writes ``report``, on rank 0 only (it alone has the report when the sinks
    write); another run in a sink's folder is said first (``other_runs.say_once``)."""
    if rank_and_world()[0] != 0:
        return
    other_runs.say_once(report.run_id)
    for sink in sinks:
        call_or_log(sink.write, report, what=f"sink {sink!r}", strict=strict, step=report.step)


def stopped(stop: bool, before: bool, stopping: PrivacyEarlyStopping | None, step: int) -> bool:
    """Whether training stops from this check on (all ranks stop together, on rank 0's
    decision): the stop is said on the console once, when it comes."""
    if stop and not before:
        reason = getattr(stopping, "reason", None) or "rank 0 said stop"
        logger.warning("privmon: early stopping at step %s — %s", step, reason)
    return before or stop


def say_outcome(
    outcome: StoppingOutcome | None, sinks: Sequence[Sink], *, strict: bool, step: int | None
) -> None:
    """The budget's outcome on the console (the ``privmon`` logger) and to every sink that
    writes one (``write_outcome(outcome)``: all of privmon's; a sink without it is skipped), on
    rank 0; nothing without early stopping (None) or before its first decision."""
    if outcome is None or not outcome.checks or rank_and_world()[0] != 0:
        return
    logger.warning("privmon: %s", outcome.sentence())
    for sink in sinks:
        write = getattr(sink, "write_outcome", None)
        if callable(write):
            call_or_log(write, outcome, what=f"sink {sink!r}", strict=strict, step=step)
