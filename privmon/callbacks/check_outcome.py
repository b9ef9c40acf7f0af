"""What one check concluded, as one value every rank applies (:class:`Outcome`): under
torch.distributed rank 0 alone analyses the check, builds its report, decides on early stopping
and writes to the sinks, then sends the outcome to the other ranks in one broadcast — the report
or why the check failed, the stop, the budget's spent checks and audit sizes, early stopping's
state — so that every rank keeps the same history, records and state."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from privmon._failure import Failure
from privmon.callbacks.budget import CertificationBudget
from privmon.callbacks.canary_audit import CanaryAudits
from privmon.callbacks.check_analysis import CheckAnalysis, analyse_check
from privmon.callbacks.collection import Scores
from privmon.callbacks.distributed import Agreement, StageFailure
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.loss_tracking import LossTracing
from privmon.callbacks.publishing import decided, publish
from privmon.callbacks.traps import Traps
from privmon.report import Report
from privmon.report.build import TraceFigures, build_report
from privmon.report.stopping import StoppingDecision
from privmon.sinks.base import Sink

__all__ = ["CheckParts", "Outcome", "StoppingState", "conclude", "report_of", "take_stopping"]

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


@dataclass(frozen=True)
class CheckParts:
    """What rank 0's conclusion of a check reads of its monitor (as it is at that check)."""

    queries: Sequence[Any]
    methods: Sequence[str]
    prior: float
    interval_delta: float
    top_k: int
    accountant: Any
    delta: float
    audits: CanaryAudits
    budget: CertificationBudget
    traps: Traps
    early_stopping: PrivacyEarlyStopping | None
    sinks: Sequence[Sink]
    other_runs: Any
    run_id: str
    strict: bool
    say: Callable[[Report], None]
    """Says a report's DP violations (a warnings filter that makes them errors fails it)."""
    traces: LossTracing | None = None
    """The monitor's loss traces (None: none)."""


def conclude(
    step: int,
    agreed: Agreement,
    scores: Scores,
    *,
    parts: CheckParts,
    first: bool,
    t0: float,
    world: int,
) -> tuple[Outcome, Exception | None]:
    """Rank 0's part of the check at ``step``, with no collective: the analysis, the report,
    early stopping's decision and the sinks' writes (``first``: the run's first report); the
    outcome every rank applies, and the error of the stage that failed (rank 0 raises it).
    Never raises: under torch.distributed (``world`` ranks) the others wait for the outcome."""
    budget = parts.budget
    budget.spent = agreed.spent
    stage, report, stop, error = "gathering the scores", None, False, None
    try:
        if agreed.gathered is not None:
            raise agreed.gathered
        stage = "reading ε or the analysis"
        analysis = _analysed(step, agreed, scores, parts=parts)
        budget.spent += 1
        stage = "building the report"
        built = report_of(
            step, analysis, scores, budget=budget, traps=parts.traps, queries=parts.queries,
            prior=parts.prior, delta=parts.delta, run_id=parts.run_id,
            seconds=time.perf_counter() - t0, query_seconds=agreed.forward,
            traces=_traced(agreed, scores, parts),
        )  # fmt: skip
        parts.say(built)
        report, stage = built, "early stopping"
        report, stop = decided(report, parts.early_stopping, parts.traps, strict=parts.strict)
        budget.say_what_can_be_certified(budget.spent, first=first, stopping=parts.early_stopping)
        stage = "writing the report"
        publish(report, parts.sinks, other_runs=parts.other_runs, strict=parts.strict)
    except Exception as err:
        error = err
    try:  # the broadcast pickles on rank 0 before sending: a failure there is this outcome's
        stopping = parts.early_stopping
        outcome = Outcome(
            report=report,
            stop=stop,
            spent=budget.spent,
            audit_sizes=dict(budget.audit_sizes),
            stopping=None if stopping is None else (stopping.state_dict(), stopping.decision),
            failure=None if error is None else StageFailure(stage, 0, Failure.of(error)),
        )
        if world > 1:
            pickle.dumps(outcome)
    except Exception as err:
        failure = StageFailure("sending the outcome", 0, Failure.of(err))
        outcome = Outcome(None, False, budget.spent, dict(budget.audit_sizes), None, failure)
        error = err
    return outcome, error


def _analysed(step: int, agreed: Agreement, scores: Scores, *, parts: CheckParts) -> CheckAnalysis:
    return analyse_check(
        step,
        queries=parts.queries,
        scores=scores,
        failed=agreed.left_out,
        certify_delta=parts.budget.certify_delta(parts.budget.spent + 1),
        alarm_delta=parts.budget.alarm_level(parts.budget.spent + 1),
        methods=parts.methods,
        prior=parts.prior,
        interval_delta=parts.interval_delta,
        top_k=parts.top_k,
        accountant=parts.accountant,
        delta=parts.delta,
        canaries=parts.audits,
        findings=agreed.findings,
        strict=parts.strict,
    )


def _traced(agreed: Agreement, scores: Scores, parts: CheckParts) -> TraceFigures | None:
    """The loss traces' figures of the check (None without loss traces)."""
    if parts.traces is None:
        return None
    return parts.traces.figures(
        scores, parts.queries, sent=agreed.traces, data=agreed.traces_data, strict=parts.strict
    )


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
    scores: Scores,
    *,
    budget: CertificationBudget,
    traps: Traps,
    queries: Sequence[Any],
    prior: float,
    delta: float,
    run_id: str,
    seconds: float,
    query_seconds: float,
    traces: TraceFigures | None = None,
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
        traces=traces,
    )
    if not report.queries:
        traps.queries_failed(step, report.failures)
    return report
