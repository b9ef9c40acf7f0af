"""TensorBoard sink: privacy scalars, per-record risk histograms, a PR curve of the membership
classifier, the most exposed member records (a text table per query: index, posterior, times
among the most exposed), the most vulnerable records by LT-IQR (a text table per source of loss
traces), the run id of every check, the causes of a DP violation and early
stopping's decisions (texts), and the first charts a person opens TensorBoard to see.

TensorBoard draws every series of one run in one colour and names a series only by its run, so
the first charts draw each named series (:data:`~privmon.report.tags.SERIES`: the advantage
estimate, its certified lower bound, the (ε, δ)-DP ceiling, the stopping threshold, ε from the
accountant, the canaries and the black-box attacks) from a run of its own, a folder of that name
in the log directory: in its own colour, named in the runs list and in each card's table. Their
tags sort first in the *Time Series* and *Scalars* tabs (one card per query, then ε), and the
*Custom Scalars* layout puts the same charts first (then the DP mechanism checks, then every
figure of each query and method). No constant series pins a chart's range.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

import numpy as np

from privmon._validation import check_writable_dir
from privmon.report import Report, tags
from privmon.report.stopping import StoppingOutcome
from privmon.sinks.base import Backlog
from privmon.sinks.exposed import (
    COLUMNS,
    VULNERABLE_COLUMNS,
    ExposedRecords,
    ExposedRow,
    vulnerable_rows,
)

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
        self._series: dict[str, Any] = {}  # name -> the SummaryWriter of that named series
        self._last_step: int | None = None

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
        from tensorboard.plugins.custom_scalar import layout_pb2 as pb

        checks = _checks_category(pb, report.scalars)
        categories = [
            _glance_category(pb, report),
            *([checks] if checks.chart else []),
            _detail_category(pb, report.scalars),
        ]
        self._write_layout(pb.Layout(category=categories))
        self._layout_written = True

    def _write_layout(self, layout: Any) -> None:
        """The Custom Scalars layout (margin charts of several series, which the writer's own
        ``add_custom_scalars`` cannot say) into the event file, as that method writes one,
        through the writer's public ``file_writer`` (open: the run id is written first)."""
        from torch.utils.tensorboard.summary import custom_scalars

        summary = custom_scalars({})  # the layout summary's metadata, around our layout
        summary.value[0].tensor.string_val[0] = layout.SerializeToString()
        self.writer.file_writer.add_summary(summary)

    def _series_writer(self, name: str) -> Any:
        """The writer of the named series ``name``: a run of its own, the folder ``name`` in the
        log directory (None when the writer does not say where it writes: the main one)."""
        if name not in self._series:
            logdir = self.logdir
            if logdir is None:
                return self.writer
            from torch.utils.tensorboard import SummaryWriter

            self._series[name] = SummaryWriter(log_dir=os.path.join(logdir, name))
        return self._series[name]

    def _write_glance(self, report: Report) -> None:
        """The first charts' named series, each in its run, after the run id (as every event)."""
        s, step, stopping = report.scalars, report.step, report.stopping
        values: dict[str, dict[str, float]] = {}
        for query, method in _glance_pairs(report):
            tag = tags.glance_advantage(query, method)
            figures = {
                tags.SERIES_ESTIMATE: s.get(tags.value(query, method), math.nan),
                tags.SERIES_LOWER: s.get(tags.lower(query, method), math.nan),
                tags.SERIES_CEILING: s.get(tags.CEILING_EPS_DELTA, math.nan),
            }
            if stopping is not None and _watched(stopping.tag) == (query, method):
                figures[tags.SERIES_THRESHOLD] = stopping.threshold
            low, high = tags.band_edges(query, method)
            for name, v in figures.items():
                if math.isfinite(v):  # a line: its band is the line itself
                    values.setdefault(name, {}).update({tag: v, low: v, high: v})
            top = figures[tags.SERIES_CEILING]
            if tags.SERIES_ESTIMATE in values and math.isfinite(figures[tags.SERIES_LOWER]):
                # the estimate's band: the advantages not ruled out, from its certified lower
                # bound up to the (ε, δ)-DP ceiling, or to 1 without one
                band = {low: figures[tags.SERIES_LOWER], high: top if math.isfinite(top) else 1.0}
                values[tags.SERIES_ESTIMATE].update(band)
        for name, v in _glance_epsilon(s).items():
            values.setdefault(name, {})[tags.GLANCE_EPSILON] = v
        for name in tags.SERIES:  # in one order, so each run's colour is the same every time
            if name in values:
                w = self._series_writer(name)
                if w is not self.writer:
                    w.add_text(tags.RUN_ID_TEXT_TAG, report.run_id, step)
                for tag, v in values[name].items():
                    w.add_scalar(tag, v, step)
                if w is not self.writer:
                    w.flush()

    def _reopen(self) -> None:
        """A new SummaryWriter in the failed one's log directory (closed without flushing the
        dead writer's queue: its error is already known), and new ones for the named series."""
        if self._logdir is None:
            self._logdir = self._writer.get_logdir()
        for w in [*self._series.values(), *([self._writer] if self._owned else [])]:
            try:
                w.close()
            except Exception:  # the dead writer raises its stored error again
                logger.debug("privmon: closing the failed SummaryWriter raised", exc_info=True)
        self._writer, self._owned, self._failed, self._series = None, True, False, {}

    def write(self, report: Report) -> None:
        """Write the report's run id (a text summary, :data:`~privmon.report.tags.RUN_ID_TEXT_TAG`)
        and scalars at its step, its DP violation's causes when it found one (a text summary,
        :data:`~privmon.report.tags.DP_CAUSES_TEXT_TAG`, a cause a line), early stopping's
        decision (a text summary, :data:`~privmon.report.tags.STOPPING_TEXT_TAG`), each query's
        member risks as a histogram and its posteriors as a membership PR curve, its most exposed
        member records as a text table (:func:`~privmon.report.tags.most_exposed`: rank, member
        index, membership posterior, and how many of the checks this sink wrote listed that
        record), each source's most vulnerable records by LT-IQR as a text table
        (:func:`~privmon.report.tags.most_vulnerable`: rank, record index, LT-IQR), and the
        first charts' named series, each in its own run; the first report also
        writes the Custom Scalars layout. Reports a write fault kept back are written first, into
        a new event file."""
        if self._failed:
            self._reopen()
        try:
            self._backlog.write(report, self._write_one)
        except Exception:
            self._failed = True
            raise

    def _write_one(self, report: Report) -> None:
        w, step = self.writer, report.step
        # first the run id: every figure after it in this file belongs to that run
        # (privmon.report.read_checks separates runs by it)
        w.add_text(tags.RUN_ID_TEXT_TAG, report.run_id, step)
        if not self._layout_written:
            self._layout(report)
        for tag, value in report.scalars.items():
            w.add_scalar(tag, value, step)
        if report.dp_causes:  # why the check found a DP violation, one cause a line
            w.add_text(tags.DP_CAUSES_TEXT_TAG, "\n".join(report.dp_causes), step)
        if report.stopping is not None:  # the decision and why, beside the figures
            w.add_text(tags.STOPPING_TEXT_TAG, report.stopping.text(step), step)
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
        for source, found in vulnerable_rows(report).items():
            lines = ["| " + " | ".join(VULNERABLE_COLUMNS) + " |", "|---:|---:|---:|"]
            lines += [f"| {r} | {i} | {v:.6g} |" for r, i, v in found]
            w.add_text(tags.most_vulnerable(source), "\n".join(lines), step)
        self._write_glance(report)
        w.flush()
        self._last_step = step

    def write_outcome(self, outcome: StoppingOutcome) -> None:
        """Early stopping's outcome over the run (the stop, or none and the highest figure; a
        restore): a text summary :data:`~privmon.report.tags.STOPPING_TEXT_TAG` at the last step
        written (nothing before any)."""
        if self._last_step is None:
            return
        self.writer.add_text(tags.STOPPING_TEXT_TAG, outcome.sentence(), self._last_step)
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer when this sink created it, and the named series' writers."""
        for w in self._series.values():
            w.close()
        self._series = {}
        if self._writer is None:
            return
        if self._owned:
            self._writer.close()
        else:
            self._writer.flush()


def _pairs(scalars: dict[str, float]) -> list[tuple[str, str]]:
    """(query, method) of every advantage estimate among ``scalars``, in their order."""
    found = (tags.parse_advantage(t) for t in scalars)
    return list(dict.fromkeys((p[0], p[1]) for p in found if p is not None and p[2] == "value"))


def _watched(tag: str) -> tuple[str, str] | None:
    """(query, method) of early stopping's figure when it is one of an advantage's, else None."""
    parsed = tags.parse_advantage(tag)
    return None if parsed is None else (parsed[0], parsed[1])


def _glance_pairs(report: Report) -> list[tuple[str, str]]:
    """Each query's first chart: the method early stopping watches for it, else its first."""
    watched = None if report.stopping is None else _watched(report.stopping.tag)
    first: dict[str, str] = {}
    for query, method in _pairs(report.scalars):
        first.setdefault(query, method)
    if watched is not None and watched[0] in first:
        first[watched[0]] = watched[1]
    return list(first.items())


def _glance_epsilon(scalars: dict[str, float]) -> dict[str, float]:
    """The first ε chart's series: the accountant's ε, and the largest finite ε lower bound of
    the canaries and of the black-box attacks (all hold together over the run: so does their
    largest)."""
    out = {}
    if math.isfinite(scalars.get(tags.EPSILON, math.nan)):
        out[tags.SERIES_ACCOUNTANT] = scalars[tags.EPSILON]
    for name, kept in (
        (tags.SERIES_CANARIES, lambda t: tags.parse_canary(t) is not None),
        (tags.SERIES_BLACK_BOX, lambda t: tags.parse_advantage(t) is not None),
    ):
        bounds = [
            v
            for t, v in scalars.items()
            if tags.is_epsilon_lower_bound(t) and kept(t) and math.isfinite(v)
        ]
        if bounds:
            out[name] = max(bounds)
    return out


def _glance_category(pb: Any, report: Report) -> Any:
    """The at-a-glance category: one margin chart per query and method, and the ε chart."""
    s, stopping = report.scalars, report.stopping
    ceiling = [tags.SERIES_CEILING] if tags.CEILING_EPS_DELTA in s else []
    glance: list[tuple[str, list[Any]]] = []  # (title, margin series): one line a run
    for query, method in _glance_pairs(report):
        drawn = [tags.SERIES_ESTIMATE, tags.SERIES_LOWER, *ceiling]
        if stopping is not None and _watched(stopping.tag) == (query, method):
            drawn.append(tags.SERIES_THRESHOLD)
        tag, (low, high) = tags.glance_advantage(query, method), tags.band_edges(query, method)
        title = f"{query} ({method}): {_listed(drawn)}; shaded: advantages not ruled out"
        glance.append((title, [pb.MarginChartContent.Series(value=tag, lower=low, upper=high)]))
    epsilon = _glance_epsilon(s)
    if set(epsilon) - {tags.SERIES_BLACK_BOX}:  # an accountant or canaries: the ε chart
        e = tags.GLANCE_EPSILON
        series = [pb.MarginChartContent.Series(value=e, lower=e, upper=e)]
        glance.append((f"ε: {_listed(list(epsilon))}", series))
    # TensorBoard 2.x stamps a category's margin charts in the reverse of the layout's order
    # (its paginated view inserts each chart at an index that counts two templates per
    # chart) and after its multiline charts: one category of margin charts, written reversed
    first = pb.Category(title=tags.LAYOUT_CATEGORY)
    for title, series in reversed(glance):
        first.chart.add(title=title, margin=pb.MarginChartContent(series=series))
    return first


def _checks_category(pb: Any, s: dict[str, float]) -> Any:
    """The DP mechanism checks' category: their flags, and their p-values beside the δ."""
    checks = pb.Category(title=tags.DP_CHECKS_CATEGORY)
    fired = [t for t in s if (parsed := tags.parse_dp_check(t)) and not parsed[1]]
    if fired:
        _multiline(checks, "DP mechanism checks: fired (1) or not (0)", fired)
    p_values = [t for t in s if (parsed := tags.parse_dp_check(t)) and parsed[1]]
    if p_values:
        title = "DP mechanism checks: p-values, and the δ below which one fires"
        _multiline(checks, title, [*p_values, tags.CERTIFY_DELTA])
    return checks


def _detail_category(pb: Any, s: dict[str, float]) -> Any:
    """The detail category: each query and method against the ceilings, and the ε charts."""
    detail = pb.Category(title=tags.DETAIL_CATEGORY)
    ceilings = [t for t in tags.CEILINGS if t in s]
    against = f" vs DP ceiling{'s' if len(ceilings) > 1 else ''}" if ceilings else ""
    for query, method in _pairs(s):
        # figures whose meaning holds: the estimate, the run-level certified bound and the
        # ceilings (the plug-in figures are biased up and bound nothing)
        shown = [tags.value(query, method), tags.lower(query, method), *ceilings]
        title = f"{query} {method}: advantage estimate and certified lower bound{against}"
        _multiline(detail, title, shown)
    accountant = [tags.EPSILON] if tags.EPSILON in s else []
    bounds = [t for t in s if tags.is_epsilon_lower_bound(t) and tags.parse_canary(t) is None]
    if accountant or bounds:
        what = "accountant vs measured lower bounds" if accountant else "lower bounds"
        _multiline(detail, f"epsilon: {what}", accountant + bounds)
    canaries = [t for t in s if tags.parse_canary(t) is not None]
    if canaries:
        what = "accountant vs one-run canary audit" if accountant else "one-run canary audit"
        _multiline(detail, f"epsilon: {what}", accountant + canaries)
    return detail


def _multiline(category: Any, title: str, shown: list[str]) -> None:
    """A chart of ``category`` whose lines are the tags ``shown``, each matched exactly."""
    from tensorboard.plugins.custom_scalar import layout_pb2 as pb

    content = pb.MultilineChartContent(tag=[_exactly(t) for t in shown])
    category.chart.add(title=title, multiline=content)


def _listed(names: list[str]) -> str:
    """``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _exactly(tag: str) -> str:
    """A layout regular expression that matches ``tag`` and nothing else (TensorBoard matches
    a chart's expressions at the start of each tag)."""
    return re.escape(tag) + "$"


def _markdown(rows: list[ExposedRow], tied: int) -> str:
    """The most exposed records as a Markdown table (TensorBoard's text dashboard draws it), and
    a note when more records share the last one's posterior."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---:|" * len(COLUMNS),
        *(f"| {r.rank} | {r.index} | {r.risk:.6g} | {r.times} of {r.checks} |" for r in rows),
    ]
    if tied:
        lines += [
            "",
            f"{tied} more member(s) share the last listed posterior: records with equal "
            "posteriors are listed by index, which is not a ranking.",
        ]
    return "\n".join(lines)
