"""One immutable report per privacy check."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from privmon.estimators.analysis import QueryResult
from privmon.report.stopping import StoppingDecision

__all__ = ["QueryResult", "Report", "Vulnerable"]


@dataclass(frozen=True)
class Vulnerable:
    """A check's most vulnerable records by LT-IQR (Pollock et al., "Free Record-Level Privacy
    Risk Evaluation Through Artifact-Based Methods") from one source of loss traces: their
    indices (into the training set for the loop's traces, the member set for a query's),
    highest score first, their scores, how many records had one and over how many steps (the
    loop's) or checks (a query's) the traces run.

    Examples:
        >>> from privmon.report import Vulnerable
        >>> Vulnerable(records=(7, 2), scores=(1.5, 0.4), n_scored=100, steps=800).to_json()
        {'records': [7, 2], 'scores': [1.5, 0.4], 'n_scored': 100, 'steps': 800}
    """

    records: tuple[int, ...]
    scores: tuple[float, ...]
    n_scored: int
    steps: int

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: lists and integers."""
        return {
            "records": list(self.records),
            "scores": list(self.scores),
            "n_scored": self.n_scored,
            "steps": self.steps,
        }


@dataclass(frozen=True)
class Report:
    """The result of one check.

    ``scalars`` is a flat dict of tag -> float (the TensorBoard tags, all under ``privacy/``).
    Every ``…/lower`` figure (and the ε lower bound derived from it) is certified over the whole
    run: all of them, at every check, hold together with probability ≥ 1 − ``interval_delta``;
    ``…/lower_check`` is the same bound at ``interval_delta`` for this one check alone.
    ``dp_violation`` is True when the check found a DP violation: a certified lower bound above
    the (ε, δ) ceiling, or what the DP audit beside the accountant found, whose causes
    ``dp_causes`` names, one sentence each (what fired, its evidence): a DP mechanism check that
    fired (``"clipping: a row of norm 100 contributed 100.0, above C = 1.0"``), a canary audit's
    ε lower bound above the accountant's. ``messages`` holds the warnings raised for them all
    (a bound above the ceiling may also mean audit sets that are not exchangeable: a message,
    not a cause).
    ``failures``: what this check could not compute ("query" or "query/method") -> the error;
    every other figure is still reported. ``run_id``: the run the check belongs to (one per
    :class:`~privmon.PrivacyMonitor`, kept across a resume through its ``state_dict``), so that
    two runs written to one place are never read as one. ``stopping``: early stopping's decision
    at this check (:class:`~privmon.report.stopping.StoppingDecision`; None without early
    stopping), taken before any sink writes the report; its numbers are among the ``scalars``
    (``privacy/stopping/…``), which is all a monitor's ``history`` keeps of it for a check
    before the last (as of the per-query results). ``vulnerable``: with loss traces
    (:class:`~privmon.callbacks.LossTracing`), per source (the training loop, or a query whose
    scores are per-record losses) its most vulnerable records by LT-IQR. Only indices and scores
    are held, never raw records.

    Examples:
        >>> from privmon.report import Report
        >>> report = Report(step=100, scalars={"privacy/loss/histogram/lower": 0.12}, run_id="3f2a")
        >>> report.dp_violation, report.to_json()["scalars"]  # e.g. a monitor's ``last_report``
        (False, {'privacy/loss/histogram/lower': 0.12})
    """

    step: int
    scalars: dict[str, float]
    queries: dict[str, QueryResult] = field(default_factory=dict)
    epsilon: float | None = None
    dp_violation: bool = False
    messages: tuple[str, ...] = ()
    failures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # the whole check
    query_seconds: float = 0.0  # of which inside the queries (the forward passes)
    run_id: str = ""
    dp_causes: tuple[str, ...] = ()
    stopping: StoppingDecision | None = None
    vulnerable: dict[str, Vulnerable] = field(default_factory=dict)

    def without_arrays(self) -> Report:
        """A copy whose query results hold no per-record arrays
        (:meth:`QueryResult.without_arrays`)."""
        return dataclasses.replace(
            self, queries={k: q.without_arrays() for k, q in self.queries.items()}
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready summary: scalars, flags and the most exposed record indices; ``dp_causes``
        only when the check found a DP violation, ``stopping`` only with early stopping,
        ``lt_iqr`` (the most vulnerable records per source) only with loss traces."""
        out = {
            "run_id": self.run_id,
            "step": self.step,
            "epsilon": self.epsilon,
            "dp_violation": self.dp_violation,
            "seconds": self.seconds,
            "query_seconds": self.query_seconds,
            "scalars": self.scalars,
            "top_records": {k: list(q.top_records) for k, q in self.queries.items()},
            "top_risks": {k: list(q.top_risks) for k, q in self.queries.items()},
            "top_tied": {k: q.top_tied for k, q in self.queries.items()},
            "messages": list(self.messages),
            "failures": self.failures,
        }
        if self.dp_causes:
            out["dp_causes"] = list(self.dp_causes)
        if self.stopping is not None:
            out["stopping"] = self.stopping.to_json()
        if self.vulnerable:
            out["lt_iqr"] = {k: v.to_json() for k, v in self.vulnerable.items()}
        return out
