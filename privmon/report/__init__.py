"""Reports: one immutable :class:`Report` per check, and the run's membership-privacy report —
one self-contained HTML page from a monitor's log directory.

:func:`read_checks` reads the checks of one run from ``LOGDIR/checks.jsonl`` (a
:class:`~privmon.sinks.JsonlSink`'s) or, failing that, from TensorBoard event files;
:func:`checks_from_reports` takes them from memory. Runs are never merged: a source holding
several raises :class:`SeveralRunsError` unless ``run=`` picks one; a line cut off by a crash is
skipped and said, any other damaged line is an error, and a file whose first line is no check is
no privmon log; an event file cut off or damaged is said (``Checks.lost_events``).
:func:`verdict` reads the certified lower bounds and the DP audit's outcomes only (*No
measurable membership leakage*, *Leakage detected*, *DP violation*, naming a DP mechanism check
that fired and its evidence), and
:func:`write_report` renders the verdict, the figures over the steps, the ROC and the most
exposed records (matplotlib: the ``privmon[report]`` extra) and writes the page atomically.
Early stopping's decision at each check (:class:`StoppingDecision`, on
:attr:`Report.stopping`) and the run's outcome (:class:`StoppingOutcome`) are in
:mod:`~privmon.report.stopping`.
Command line: ``privmon report LOGDIR [--out FILE] [--title TEXT] [--run ID]``;
``privmon report LOGDIR... --compare`` puts every run side by side
(:mod:`~privmon.report.compare`, :func:`read_runs`; :func:`version_dir` gives each run a
fresh folder). Usage: the
guide's *The HTML report*; the verdict's rules and the in-sample ROC: Theory, *The report's
verdict and its ROC*. Layout: :mod:`~privmon.report.tags` (every figure's name),
:mod:`~privmon.report.check`, :mod:`~privmon.report.runs`, :mod:`~privmon.report.verdict`,
:mod:`~privmon.report.figures`, :mod:`~privmon.report.page`.
"""

from privmon.report.blocks import REPORT_NAME
from privmon.report.check import QueryResult, Report, Vulnerable
from privmon.report.page import render_html, write_report
from privmon.report.runs import (
    JSONL_NAME,
    Checks,
    RunInfo,
    SeveralRunsError,
    checks_from_reports,
    read_checks,
    read_runs,
    runs_in,
    version_dir,
)
from privmon.report.stopping import StoppingDecision, StoppingOutcome
from privmon.report.verdict import Verdict, verdict

__all__ = [
    "JSONL_NAME",
    "REPORT_NAME",
    "Checks",
    "QueryResult",
    "Report",
    "RunInfo",
    "SeveralRunsError",
    "StoppingDecision",
    "StoppingOutcome",
    "Verdict",
    "Vulnerable",
    "checks_from_reports",
    "read_checks",
    "read_runs",
    "render_html",
    "runs_in",
    "verdict",
    "version_dir",
    "write_report",
]
