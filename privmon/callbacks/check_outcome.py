"""What one check concluded, as one value every rank applies (:class:`Outcome`): under
torch.distributed rank 0 alone analyses the check, builds its report, decides on early stopping
and writes to the sinks, then sends the outcome to the other ranks in one broadcast — the report
or why the check failed, the stop, the budget's spent checks and audit sizes, early stopping's
state — so that every rank keeps the same history, records and state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from privmon._failure import Failure
from privmon.callbacks.budget import CertificationBudget
from privmon.callbacks.check_analysis import CheckAnalysis
from privmon.callbacks.distributed import StageFailure
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.traps import Traps
from privmon.report import Report
from privmon.report.build import build_report
from privmon.report.stopping import StoppingDecision

__all__ = [
    "Outcome",
    "StoppingState",
    "failed_on_rank_0",
    "report_of",
    "stopping_state",
    "take_stopping",
]

StoppingState = tuple[dict[str, Any], StoppingDecision | None]
"""Early stopping's counters (``state_dict()``) and its last decision."""


@dataclass(frozen=True)
class Outcome:
    """One check's outcome, as rank 0 concluded it."""

    report: Report | None
    """The check's report; None when the check failed (``failure`` says where)."""
    stop: bool
    """Whether early stopping said stop."""
    spent: int
    """The run's certified checks after this one."""
    audit_sizes: dict[str, tuple[int, int, int]]
    """Per query analysed: its members, non-members and dimensions."""
    stopping: StoppingState | None
    """Early stopping's state after deciding (None without early stopping)."""
    failure: StageFailure | None = None
    """The stage that failed: the check itself (no report), or, with ``strict``, early stopping
    or a sink after the report (every rank keeps the report, then raises)."""


def failed_on_rank_0(stage: str, error: BaseException) -> StageFailure:
    """``stage`` failed on rank 0 with ``error``, as the outcome tells every rank."""
    return StageFailure(stage, 0, Failure.of(error))


def stopping_state(stopping: PrivacyEarlyStopping | None) -> StoppingState | None:
    """What the other ranks take of rank 0's early stopping."""
    return None if stopping is None else (stopping.state_dict(), stopping.decision)


def take_stopping(stopping: PrivacyEarlyStopping | None, state: StoppingState | None) -> None:
    """Early stopping as rank 0 left it (its budget is the same on every rank: the ranks
    compared it before the check)."""
    if stopping is None or state is None:
        return
    counters, decision = state
    stopping.load_state_dict(counters)
    stopping.decision = decision


def report_of(
    step: int,
    analysis: CheckAnalysis,
    scores: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    budget: CertificationBudget,
    traps: Traps,
    queries: Sequence[Any],
    prior: float,
    delta: float,
    run_id: str,
    seconds: float,
    query_seconds: float,
) -> Report:
    """The report of the check at ``step`` (:func:`~privmon.report.build.build_report`), the
    budget's audit sizes of its queries kept, and the traps it shows said (swapped sets, every
    query failed)."""
    detectable = budget.audited(analysis.results, scores, analysis.certify_delta)
    traps.check_directions(step, queries, analysis.results, scores)
    report = build_report(
        step=step,
        results=analysis.results,
        detectable=detectable,
        epsilon=analysis.epsilon,
        canaries=analysis.canaries,
        prior=prior,
        delta=delta,
        certify_delta=analysis.certify_delta,
        run_id=run_id,
        seconds=seconds,
        query_seconds=query_seconds,
    )
    if not report.queries:
        traps.queries_failed(step, report.failures)
    return report
