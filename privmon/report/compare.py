"""Runs side by side: ``privmon report LOGDIR --compare`` (or several log directories) writes one
page with every run found (:func:`~privmon.report.read_runs`; runs are compared, never merged):
one table with each run's verdict, its largest certified advantage and its ε, and for each query
and method one chart with a line per run (estimate and certified lower bound), and ε per run."""

from __future__ import annotations

import datetime as _dt
import html
import os
from collections.abc import Sequence
from typing import Any

from privmon.report import tags
from privmon.report.blocks import explain, glossary_html, head, img, save_page, table
from privmon.report.figures import comparison_figure, epsilon_comparison_figure, png
from privmon.report.formatting import fmt
from privmon.report.runs import Checks, read_runs
from privmon.report.verdict import certificates, verdict

__all__ = [
    "COMPARISON_NAME",
    "render_comparison",
    "run_summary",
    "write_comparison",
    "write_comparison_page",
]

COMPARISON_NAME = "privacy_comparison.html"
"""The comparison page's file name when no output path is given: in the log directory, or in
the folder that holds all the log directories compared."""


def run_summary(checks: Checks) -> dict[str, Any]:
    """What the comparison's table says of one run: its verdict (``level``, ``headline``), its
    largest certified advantage (``lower``, with its ``step``, ``query``, ``method`` and
    ``epsilon_lower_bound``; None when nothing was certified) and the accountant's ε at its
    last check (``epsilon``, None without one).

    Examples:
        >>> from privmon import epsilon_lower_bound
        >>> from privmon.report import Report, checks_from_reports
        >>> from privmon.report.compare import run_summary
        >>> figures = {"privacy/loss/histogram/lower": 0.2,
        ...            "privacy/loss/histogram/epsilon_lower_bound": epsilon_lower_bound(0.2)}
        >>> summary = run_summary(checks_from_reports([Report(100, figures, run_id="a")]))
        >>> summary["level"], summary["lower"], summary["step"], summary["epsilon"]
        ('leakage', 0.2, 100, None)
    """
    v = verdict(checks)
    hits = certificates(checks)
    best = max(hits, key=lambda h: (h[3], -h[0])) if hits else None
    eps = [r["epsilon"] for r in checks.records if r["epsilon"] is not None]
    out: dict[str, Any] = {
        "level": v.level,
        "headline": v.headline,
        "lower": None,
        "epsilon": eps[-1] if eps else None,
    }
    if best is not None:
        step, q, m, lower, elb = best
        out.update(lower=lower, step=step, query=q, method=m, epsilon_lower_bound=elb)
    return out


def _table(runs: Sequence[Checks], used: set[str]) -> str:
    rows = []
    for checks in runs:
        s = run_summary(checks)
        steps = f"{checks.steps[0]}–{checks.steps[-1]}" if checks.records else "–"
        best = (
            f"{s['lower']:.3f} (step {s['step']}, {s['query']}/{s['method']})"
            if s["lower"] is not None
            else "none certified"
        )
        elb = fmt(s["epsilon_lower_bound"], 3) if s["lower"] is not None else "—"
        eps = fmt(s["epsilon"]) if s["epsilon"] is not None else "— (no accountant)"
        row = [checks.label, checks.run_id, f"{len(checks.records)} ({steps})"]
        rows.append([*row, s["headline"], best, elb, eps])
    header = ["run", "run id", "checks (steps)", "verdict", "largest certified advantage"]
    return table([*header, "ε lower bound", "ε"], rows, left=5, used=used)


def render_comparison(runs: Sequence[Checks], title: str | None = None) -> str:
    """The page that puts ``runs`` side by side, as one HTML string.

    Examples:
        >>> from privmon.report import Report, checks_from_reports
        >>> from privmon.report.compare import render_comparison
        >>> runs = [checks_from_reports([Report(step=100, scalars={}, run_id=run)])
        ...         for run in ("dp", "no-dp")]
        >>> page = render_comparison(runs, title="DP or not")
        >>> page.count("No measurable membership leakage")
        2
    """
    if not runs:
        raise ValueError("runs must hold at least one run to compare")
    title = title or "Membership privacy: runs compared"
    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    esc, used = html.escape, set[str]()
    sources = sorted({c.source for c in runs})
    out = [
        head(title),
        f'<p class="meta">{len(runs)} runs from '
        + ", ".join(f"<code>{esc(s)}</code>" for s in sources)
        + f" · generated {generated} by privmon</p>",
        "<h2>The runs</h2>",
        _table(runs, used),
        '<p class="caption">'
        + explain(
            "Each run's verdict, from its own certified lower bounds only (runs are compared, "
            "never merged); its largest certified advantage over its checks, queries and "
            "methods, with the ε lower bound it implies; and the accountant's ε at its last "
            "check. privmon report LOGDIR --run ID writes one run's full page.",
            used,
        )
        + "</p>",
    ]
    pairs = list(dict.fromkeys((q, m) for c in runs for q in c.queries() for m in c.methods(q)))
    if pairs:
        out.append("<h2>Advantage over training</h2>")
        for q, m in pairs:
            out.append(img(png(comparison_figure(runs, q, m)), f"{q} ({m}): runs compared"))
    if any(c.has(tags.EPSILON) or c.canary_methods() for c in runs):
        out.append("<h2>ε over training</h2>")
        out.append(img(png(epsilon_comparison_figure(runs)), "epsilon: runs compared"))
    notes = [n for c in runs for n in c.notes if "never merged into it" not in n]
    out += [f'<p class="note">{explain(n, used)}</p>' for n in dict.fromkeys(notes)]
    out += [glossary_html(used), "</body></html>"]
    return "\n".join(out)


def write_comparison(
    logdirs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
) -> str:
    """Write the page that compares every run under ``logdirs`` (one log directory or
    several, or JSON-lines files); returns the path written. ``out`` defaults to
    :data:`COMPARISON_NAME` in the folder that holds them all.

    Examples:
        >>> import os, tempfile
        >>> from privmon.report import Report
        >>> from privmon.report.compare import write_comparison
        >>> from privmon.sinks import JsonlSink
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     sink = JsonlSink(os.path.join(logdir, "checks.jsonl"))
        ...     for run in ("dp", "no-dp"):
        ...         sink.write(Report(step=100, scalars={}, run_id=run))
        ...     sink.close()
        ...     os.path.basename(write_comparison(logdir))
        'privacy_comparison.html'
    """
    return write_comparison_page(read_runs(logdirs), logdirs, out, title)


def write_comparison_page(
    runs: Sequence[Checks],
    logdirs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str] | None,
    title: str | None,
) -> str:
    """Write the comparison page of ``runs`` (read from ``logdirs``) to ``out`` (default:
    :data:`COMPARISON_NAME` in the folder that holds every log directory), atomically; returns
    the path written. :func:`write_comparison` reads the runs itself; this serves a caller that
    holds them already (``privmon report --compare`` prints their verdicts too).

    Examples:
        >>> import os, tempfile
        >>> from privmon.report import Report, read_runs
        >>> from privmon.report.compare import write_comparison_page
        >>> from privmon.sinks import JsonlSink
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     sink = JsonlSink(os.path.join(logdir, "checks.jsonl"))
        ...     for run in ("dp", "no-dp"):
        ...         sink.write(Report(step=100, scalars={}, run_id=run))
        ...     sink.close()
        ...     runs = read_runs(logdir)
        ...     len(runs), os.path.basename(write_comparison_page(runs, logdir, None, None))
        (2, 'privacy_comparison.html')
    """
    given = [logdirs] if isinstance(logdirs, str | os.PathLike) else list(logdirs)
    paths = [os.fspath(p) for p in given]
    folders = [os.path.dirname(os.path.abspath(p)) if os.path.isfile(p) else p for p in paths]
    folders = [os.path.abspath(p) for p in folders]
    if out is None:
        out = os.path.join(os.path.commonpath(folders), COMPARISON_NAME)
    inputs = [path for checks in runs for path in checks.files]
    return save_page(out, lambda: render_comparison(runs, title=title), inputs=inputs)
