"""The most exposed member records of each check (the likeliest members: the highest membership
posteriors) as table rows, with how often each record was among the most exposed over the checks
a sink has written: what the TensorBoard and W&B sinks show per check. Only indices and
posteriors, never records; memory is O(member records)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from privmon.report import Report

__all__ = ["ExposedRecords", "ExposedRow", "vulnerable_rows"]

COLUMNS = ("rank", "member index", "membership posterior", "times among the most exposed")
"""The columns of a most-exposed table, in :class:`ExposedRow`'s order."""
VULNERABLE_COLUMNS = ("rank", "record index", "LT-IQR")
"""The columns of a most-vulnerable table (:func:`vulnerable_rows`)."""


@dataclass(frozen=True)
class ExposedRow:
    """One of a check's most exposed member records: its rank (1: most exposed), its index in
    the order the member loader yields records, its membership posterior P(member | q) (the
    privacy risk score; ``risk``) and how many of the checks written so far (``checks``) listed
    it among the most exposed (``times``). The posterior is NaN where the report lists the
    record without one."""

    rank: int
    index: int
    risk: float
    times: int
    checks: int


class ExposedRecords:
    """Counts, per query, how often each member index was among a check's most exposed records.

    :meth:`rows` counts a report in once: a report written again (a sink retrying after a
    fault) is not counted twice. The counts start afresh with each instance (a resumed run's new
    sink counts from its first check).

    Examples:
        >>> from privmon.estimators.analysis import QueryResult
        >>> from privmon.report import Report
        >>> from privmon.sinks.exposed import ExposedRecords
        >>> def report(step, top):
        ...     q = QueryResult("loss", {}, 1, 0, top_records=top, top_risks=(0.9, 0.5))
        ...     return Report(step=step, scalars={}, queries={"loss": q}, run_id="demo")
        >>> exposed = ExposedRecords()
        >>> _ = exposed.rows(report(1, (7, 3)))
        >>> [(r.index, r.risk, r.times, r.checks) for r in exposed.rows(report(2, (3, 9)))["loss"]]
        [(3, 0.9, 2, 2), (9, 0.5, 1, 2)]
    """

    def __init__(self) -> None:
        self._times: dict[str, Counter[int]] = {}
        self._checks: Counter[str] = Counter()
        self._last: tuple[str, int] | None = None  # the report counted last: (run id, step)
        self._rows: dict[str, list[ExposedRow]] = {}

    def rows(self, report: Report) -> dict[str, list[ExposedRow]]:
        """Count ``report``'s most exposed records in, and return each query's rows (queries
        without a list of most exposed records are left out)."""
        key = (report.run_id, int(report.step))
        if key == self._last:
            return self._rows
        out: dict[str, list[ExposedRow]] = {}
        for name, q in report.queries.items():
            if not q.top_records:
                continue
            times = self._times.setdefault(name, Counter())
            times.update(int(i) for i in q.top_records)
            self._checks[name] += 1
            risks = [*q.top_risks, *[math.nan] * (len(q.top_records) - len(q.top_risks))]
            out[name] = [
                ExposedRow(rank, int(i), float(risk), times[int(i)], self._checks[name])
                for rank, (i, risk) in enumerate(zip(q.top_records, risks, strict=False), 1)
            ]
        self._last, self._rows = key, out
        return out


def vulnerable_rows(report: Report) -> dict[str, list[tuple[int, int, float]]]:
    """Per source of loss traces (the training loop: training-set indices; a query: member-set
    indices), the report's most vulnerable records by LT-IQR as (rank, index, score) rows.

    Examples:
        >>> from privmon.report import Report, Vulnerable
        >>> from privmon.sinks.exposed import vulnerable_rows
        >>> top = Vulnerable(records=(7, 2), scores=(1.5, 0.4), n_scored=9, steps=80)
        >>> vulnerable_rows(Report(step=1, scalars={}, vulnerable={"training_loop": top}))
        {'training_loop': [(1, 7, 1.5), (2, 2, 0.4)]}
    """
    return {
        source: [
            (rank, int(i), float(v))
            for rank, (i, v) in enumerate(zip(top.records, top.scores, strict=True), 1)
        ]
        for source, top in report.vulnerable.items()
    }
