"""TensorBoard sink: privacy scalars, per-record risk histograms, a PR curve of the membership
classifier, the most exposed member records (a text table per query: index, risk, times among
the most exposed), the run id of every check, the causes of a DP violation (a text), and a *Custom
Scalars* layout that puts the advantage, its certified lower bound and (with an accountant) the
DP ceilings on one chart per query and method (and the DP mechanism checks on two charts).

The layout format has no colour and no y-range field, and the server matches each chart's regular
expressions at the start of a tag: the layout anchors every tag (``…/lower`` would match
``…/lower_check`` too) and pins each advantage chart to [0, 1] with two constant series
(:data:`~privmon.report.tags.AXIS_TAGS`), which the dashboard's 5–95 % outlier clipping keeps.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import numpy as np

from privmon._validation import check_writable_dir
from privmon.report import Report, tags
from privmon.sinks.base import Backlog
from privmon.sinks.exposed import COLUMNS, ExposedRecords, ExposedRow

__all__ = ["TensorBoardSink"]

logger = logging.getLogger("privmon")


class TensorBoardSink:
    """Write reports to TensorBoard event files.

    A SummaryWriter whose write fails (a full disk) is dead for good: its writer thread keeps
    the error. The sink then starts a new event file in the same log directory (TensorBoard reads
    every event file of a run) and writes the reports it could not write, before the next one
    (:class:`~privmon.sinks.base.Backlog`); a figure written just before the fault may then
    appear twice at its step, with the same value.

    Args:
        writer: a ``SummaryWriter`` (flushed, not closed, by :meth:`close`) or a log directory
            path (its writer is opened at the first report: ranks that never write leave no
            file).

    Examples:
        >>> import os
        >>> import tempfile
        >>> from privmon.report import Report
        >>> from privmon.sinks import TensorBoardSink
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     sink = TensorBoardSink(tmp)
        ...     sink.write(Report(step=100, scalars={"privacy/loss/auc": 0.61}, run_id="demo"))
        ...     sink.close()
        ...     [name.startswith("events.out.tfevents.") for name in os.listdir(tmp)]
        [True]
    """

    def __init__(self, writer: Any) -> None:
        if isinstance(writer, (str, os.PathLike)):
            self._logdir: str | None = check_writable_dir(os.fspath(writer), name="writer")
            writer = None  # opened at the first report: ranks that never write leave no file
        elif callable(getattr(writer, "add_scalar", None)):
            self._logdir = None
        else:
            raise ValueError("writer must be a SummaryWriter or a log directory path")
        self._owned = self._logdir is not None
        self._writer = writer
        self._layout_written = False
        self._backlog = Backlog()
        self._failed = False
        self._exposed = ExposedRecords()

    @property
    def logdir(self) -> str | None:
        """The folder its event files go to (the path given, or the SummaryWriter's
        ``get_logdir()``); None for a writer that does not say."""
        if self._logdir is not None:
            return self._logdir
        get_logdir = getattr(self._writer, "get_logdir", None)
        return str(get_logdir()) if callable(get_logdir) else None

    @property
    def writer(self) -> Any:
        """The SummaryWriter (created on first use when a log directory was given)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self._logdir)
        return self._writer

    def _layout(self, report: Report) -> None:
        charts: dict[str, list[Any]] = {}
        ceilings = [t for t in tags.CEILINGS if t in report.scalars]
        # the title says what is drawn: ceilings only when an accountant gave them
        against = f" vs DP ceiling{'s' if len(ceilings) > 1 else ''}" if ceilings else ""
        for qname, q in report.queries.items():
            for method in q.estimates:
                # figures whose meaning holds: the estimate, the run-level certified bound and
                # the ceilings (the plug-in figures are biased up and bound nothing)
                shown = [
                    tags.value(qname, method),
                    tags.lower(qname, method),
                    *ceilings,
                    *tags.AXIS_TAGS,
                ]
                title = f"{qname} {method}: advantage estimate and certified lower bound{against}"
                charts[title] = ["Multiline", [_exactly(t) for t in shown]]
        if tags.EPSILON in report.scalars:
            charts["epsilon: accountant vs measured lower bounds"] = [
                "Multiline",
                [_exactly(tags.EPSILON)]
                + [_exactly(t) for t in report.scalars if tags.is_epsilon_lower_bound(t)],
            ]
        canaries = [t for t in report.scalars if tags.parse_canary(t) is not None]
        if canaries:
            accountant = tags.EPSILON in report.scalars
            title = (
                "epsilon: accountant vs one-run canary audit"
                if accountant
                else ("epsilon: one-run canary audit")
            )
            charts[title] = [
                "Multiline",
                ([_exactly(tags.EPSILON)] if accountant else []) + [_exactly(t) for t in canaries],
            ]
        fired = [t for t in report.scalars if (parsed := tags.parse_dp_check(t)) and not parsed[1]]
        if fired:
            charts["DP mechanism checks: fired (1) or not (0)"] = [
                "Multiline",
                [_exactly(t) for t in fired],
            ]
        p_values = [t for t in report.scalars if (parsed := tags.parse_dp_check(t)) and parsed[1]]
        if p_values:
            charts["DP mechanism checks: p-values (an alarm below the certified δ)"] = [
                "Multiline",
                [_exactly(t) for t in [*p_values, tags.CERTIFY_DELTA]],
            ]
        self.writer.add_custom_scalars({tags.LAYOUT_CATEGORY: charts})
        self._layout_written = True

    def _reopen(self) -> None:
        """A new SummaryWriter in the failed one's log directory (closed without flushing the
        dead writer's queue: its error is already known)."""
        if self._logdir is None:
            self._logdir = self._writer.get_logdir()
        if self._owned:
            try:
                self._writer.close()
            except Exception:  # the dead writer raises its stored error again
                logger.debug("privmon: closing the failed SummaryWriter raised", exc_info=True)
        self._writer, self._owned, self._failed = None, True, False

    def write(self, report: Report) -> None:
        """Write the report's run id (a text summary, :data:`~privmon.report.tags.RUN_ID_TEXT_TAG`)
        and scalars at its step, its DP violation's causes when it found one (a text summary,
        :data:`~privmon.report.tags.DP_CAUSES_TEXT_TAG`, a cause a line), each query's member
        risks as a histogram and its posteriors as a membership PR curve, its most exposed member
        records as a text table (:func:`~privmon.report.tags.most_exposed`: rank, member index,
        risk, and how many of the checks this sink wrote listed that record); the first report also
        writes the Custom Scalars layout (each advantage with its lower bound, and the DP
        ceilings when there are, on one chart; the mechanism checks' flags and p-values).
        Reports a write fault kept back are written first, into a new event file."""
        if self._failed:
            self._reopen()
        try:
            self._backlog.write(report, self._write_one)
        except Exception:
            self._failed = True
            raise

    def _write_one(self, report: Report) -> None:
        if not self._layout_written:
            self._layout(report)
        w, step = self.writer, report.step
        # first the run id: every figure after it in this file belongs to that run
        # (privmon.report.read_checks separates runs by it)
        w.add_text(tags.RUN_ID_TEXT_TAG, report.run_id, step)
        for tag, value in report.scalars.items():
            w.add_scalar(tag, value, step)
        if report.dp_causes:  # why the check found a DP violation, one cause a line
            w.add_text(tags.DP_CAUSES_TEXT_TAG, "\n".join(report.dp_causes), step)
        if any(q.estimates for q in report.queries.values()):
            for tag, value in tags.AXIS_TAGS.items():
                w.add_scalar(tag, value, step)
        for qname, q in report.queries.items():
            if q.member_risk is not None and np.isfinite(q.member_risk).any():
                risk = q.member_risk[np.isfinite(q.member_risk)]
                w.add_histogram(tags.member_risk(qname), risk, step)
            if q.member_posterior is not None and q.nonmember_posterior is not None:
                post = np.concatenate([q.member_posterior, q.nonmember_posterior])
                labels = np.concatenate(
                    [np.ones(len(q.member_posterior)), np.zeros(len(q.nonmember_posterior))]
                )
                keep = np.isfinite(post)
                w.add_pr_curve(tags.membership_pr(qname), labels[keep], post[keep], step)
        for qname, rows in self._exposed.rows(report).items():
            tied = report.queries[qname].top_tied
            w.add_text(tags.most_exposed(qname), _markdown(rows, tied), step)
        w.flush()

    def close(self) -> None:
        """Flush; close the writer when this sink created it."""
        if self._writer is None:
            return
        if self._owned:
            self._writer.close()
        else:
            self._writer.flush()


def _exactly(tag: str) -> str:
    """A layout regular expression that matches ``tag`` and nothing else (TensorBoard matches
    a chart's expressions at the start of each tag)."""
    return re.escape(tag) + "$"


def _markdown(rows: list[ExposedRow], tied: int) -> str:
    """The most exposed records as a Markdown table (TensorBoard's text dashboard draws it), and
    a note when more records share the last one's risk."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---:|" * len(COLUMNS),
        *(f"| {r.rank} | {r.index} | {r.risk:.6g} | {r.times} of {r.checks} |" for r in rows),
    ]
    if tied:
        lines += [
            "",
            f"{tied} more member(s) share the last listed risk: records with equal risks are "
            "listed by index, which is not a ranking.",
        ]
    return "\n".join(lines)
