"""The HTML page: the verdict, the figures and the tables in one self-contained file, written
atomically beside its output path (see :mod:`privmon.report`)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import html
import math
import os
import secrets
import stat
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from privmon.report import tags
from privmon.report.figures import plot_advantage, plot_epsilon, plot_risk, plot_roc
from privmon.report.formatting import fmt
from privmon.report.runs import Checks, read_checks
from privmon.report.verdict import EXCHANGEABILITY, certificates, certified_floor, verdict

__all__ = ["REPORT_NAME", "render_html", "write_page", "write_report"]

REPORT_NAME = "privacy_report.html"
"""The report's file name in the log directory when no output path is given."""


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1000px;
margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
.meta{color:#666;font-size:.9em}
.verdict{border-radius:6px;padding:1em 1.2em;margin:1.2em 0;border-left:8px solid}
.verdict h2{border:none;margin:0 0 .4em 0;font-size:1.3em}
.v-none{background:#eef8ee;border-color:#2e7d32}
.v-leakage{background:#fff0e6;border-color:#e65100}.v-violation{background:#fdecea;border-color:#b71c1c}
.v-empty{background:#f4f4f4;border-color:#888}
table{border-collapse:collapse;font-size:.88em;margin:.6em 0}
th,td{border:1px solid #ddd;padding:.25em .55em;text-align:right}
th{background:#f6f6f6} td.l,th.l{text-align:left}
img{max-width:100%;height:auto;display:block;margin:.6em 0}
.caption{color:#555;font-size:.88em}
.note{background:#f4f6fb;border-left:4px solid #6b7fc4;padding:.5em .8em;font-size:.9em}
code{background:#f3f3f3;padding:0 .2em}
"""


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="l"' if i < left else ""
        text = v if isinstance(v, str) else fmt(v)
        return f"<{tag}{cls}>{html.escape(text)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary_table(checks: Checks) -> str:
    s = checks.records[-1]["scalars"]
    rows = []
    for q in checks.queries():
        for m in checks.methods(q):
            rows.append(
                [
                    q,
                    m,
                    s.get(tags.value(q, m)),
                    s.get(tags.lower(q, m)),
                    s.get(tags.plugin(q, m)),
                    s.get(tags.plugin_upper(q, m)),
                    s.get(tags.epsilon_lower_bound(q, m)),
                    s.get(tags.auc(q)),
                    s.get(tags.tpr_at_fpr(q, 0.01)),
                    s.get(tags.n_dropped(q)),
                    s.get(tags.detectable(q)),
                ]
            )
    return _table(
        [
            "query",
            "method",
            "value",
            "certified lower",
            "plug-in",
            "plug-in + McDiarmid",
            "ε lower bound",
            "AUC",
            "TPR@FPR=1%",
            "dropped",
            "detectable",
        ],
        rows,
        left=2,
    )


def _top_records_html(checks: Checks) -> str:
    last = checks.records[-1]
    if not any(r["top_records"] for r in checks.records):
        return (
            '<p class="note">The indices of the most exposed records are not in this source '
            "(they are written to the JSON lines by <code>JsonlSink</code>).</p>"
        )
    parts = [
        "<p>Indices into the audit member set, in the order its loader yields records; most "
        f"exposed first, at the last check (step {last['step']}), and how often each index was "
        f"among the most exposed over all {len(checks.records)} checks.</p>"
    ]
    for q in sorted({k for r in checks.records for k in r["top_records"]}):
        top = last["top_records"].get(q, [])
        risks = last.get("top_risks", {}).get(q, [])
        freq = Counter(i for r in checks.records for i in r["top_records"].get(q, []))
        n_lists = sum(1 for r in checks.records if q in r["top_records"])
        rows = [
            [str(rank), str(i), fmt(risks[rank - 1], 3) if rank <= len(risks) else "–",
             f"{freq[i]} / {n_lists}"]
            for rank, i in enumerate(top, 1)
        ]  # fmt: skip
        parts.append(f"<h3>{html.escape(q)}</h3>")
        tied = last.get("top_tied", {}).get(q, 0)
        if tied:
            parts.append(
                f'<p class="note">{tied} more member(s) share the risk of the last listed record: '
                "records with equal risks are listed by index, which is not a ranking.</p>"
            )
        parts.append(
            _table(["rank", "member index", "risk", "in the top list"], rows, left=0)
            if rows
            else "<p>(none at the last check)</p>"
        )
        persistent = [f"{i} ({c}×)" for i, c in freq.most_common(10)]
        if persistent:
            parts.append(
                "<p>Most often among the most exposed: "
                + html.escape(", ".join(persistent))
                + "</p>"
            )
    return "".join(parts)


def _dp_checks_html(checks: Checks) -> str:
    """The DP mechanism checks over the run: where each fired, its tests' p-values."""
    fired: dict[str, list[int]] = {}
    p_values: dict[str, dict[str, float]] = {}  # check -> test -> smallest p-value of the run
    for r in checks.records:
        for tag, v in r["scalars"].items():
            parsed = tags.parse_dp_check(tag)
            if parsed is None:
                continue
            check, test = parsed
            steps = fired.setdefault(check, [])
            if test is None and v >= 0.5:
                steps.append(r["step"])
            elif test is not None and not math.isnan(v):
                tests = p_values.setdefault(check, {})
                tests[test] = min(v, tests.get(test, math.inf))
    n = len(checks.records)
    rows = [
        [
            check,
            f"at {len(steps)} of {n} checks (first at step {steps[0]})" if steps else "never",
            ", ".join(f"{t}: {fmt(p, 3)}" for t, p in p_values.get(check, {}).items()) or "–",
        ]
        for check, steps in fired.items()
    ]
    return _table(["check", "fired", "smallest p-value of each test"], rows, left=3) + (
        "<p class='caption'>Each check tests one assumption of the accountant on the optimizer "
        "itself (clipping, noise, sampling, steps counted, no update but the private steps). A "
        "deterministic test never fires on a correct run; a statistical test fires when its "
        "p-value falls below the δ of each certified figure of its check (its share of the "
        "run's confidence budget), so that false alarms over the whole run stay below it.</p>"
    )


def _checks_table(checks: Checks, limit: int = 60) -> str:
    recs = checks.records
    shown = recs if len(recs) <= limit else recs[: limit // 2] + recs[-limit // 2 :]
    cols = [(q, m) for q in checks.queries() for m in checks.methods(q)]
    has_eps = any(r["epsilon"] is not None for r in recs)
    header = ["step"] + [f"{q}/{m} value / lower" for q, m in cols]
    if has_eps:
        header += ["ε", "(ε, δ) ceiling", "DP violation"]
    rows = []
    for r in shown:
        s = r["scalars"]
        row: list[Any] = [str(r["step"])]
        for q, m in cols:
            row.append(f"{fmt(s.get(tags.value(q, m)), 3)} / {fmt(s.get(tags.lower(q, m)), 3)}")
        if has_eps:
            row += [
                r["epsilon"],
                s.get(tags.CEILING_EPS_DELTA),
                "yes" if r["dp_violation"] else "no",
            ]
        rows.append(row)
    note = (
        f"<p class='caption'>{len(recs)} checks; the first and last {limit // 2} shown.</p>"
        if len(recs) > limit
        else ""
    )
    return _table(header, rows, left=1) + note


def render_html(checks: Checks, title: str | None = None) -> str:
    """The report page for ``checks`` as one HTML string.

    Examples:
        >>> from privmon.report import Report, checks_from_reports, render_html
        >>> checks = checks_from_reports([Report(step=100, scalars={}, run_id="3f2a9c")])
        >>> page = render_html(checks, title="exp1")
        >>> page.startswith("<!DOCTYPE html>"), "No measurable membership leakage" in page
        (True, True)
    """
    v = verdict(checks)
    title = title or "Membership privacy report"
    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    esc = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="meta">Source: <code>{esc(checks.source)}</code> ({esc(checks.kind)}) · '
        + (f"run <code>{esc(checks.run_id)}</code> · " if checks.run_id else "")
        + f"{len(checks.records)} checks"
        + (f", steps {checks.steps[0]}–{checks.steps[-1]}" if checks.records else "")
        + f" · generated {generated} by privmon</p>",
        f'<div class="verdict v-{v.level}"><h2>{esc(v.headline)}</h2>',
        *(f"<p>{esc(d)}</p>" for d in v.details),
        "</div>",
    ]
    for note in checks.notes:
        out.append(f'<p class="note">{esc(note)}</p>')
    if not checks.records:
        out.append("</body></html>")
        return "\n".join(out)
    floor = certified_floor(certificates(checks))
    last = checks.records[-1]
    out.append(f"<h2>At the last check (step {last['step']})</h2>")
    out.append(_summary_table(checks))
    if last["messages"]:
        out.extend(f'<p class="note">{esc(m)}</p>' for m in last["messages"])
    out.append(
        "<p class='caption'><b>value</b>: debiased estimate of the optimal membership advantage "
        "(2·P(the best attack is right) − 1; 0: nothing leaks, 1: membership certain). "
        "<b>certified lower</b>: every certified lower bound of the run, at every check, holds "
        "together with probability ≥ 1 − δ; leakage is certified when one exceeds the trivial "
        "floor |2p − 1| (0 at prior 0.5), i.e. when its ε lower bound is positive. "
        "<b>plug-in</b> and <b>plug-in + McDiarmid</b> are the MACE paper's W_N / U_N figures: "
        "biased up, they bound nothing and are shown only to reproduce the paper. "
        "<b>detectable</b>: the smallest advantage this check's certificate detects in half the "
        "runs at its audit sizes and δ; smaller leaks may go uncertified.</p>"
    )
    out.append("<h2>Advantage over training</h2>")
    for q in checks.queries():
        out.append(_img(*plot_advantage(checks, q, floor)))
    if checks.has(tags.EPSILON) or checks.canary_methods():
        out.append(_img(plot_epsilon(checks), "epsilon: accountant vs audited lower bounds"))
        if checks.canary_methods():
            out.append(
                "<p class='caption'>The one-run canary audit's ε lower bounds (Steinke et al.; "
                "f-DP, Mahloujifar et al.) hold together over the run at the monitor's "
                "confidence; the canaries' inclusion is randomised, so an audited ε above the "
                "accountant's proves the DP implementation or its accounting wrong, whatever "
                "the audit sets.</p>"
            )
        out.append(f"<p class='caption'>{esc(EXCHANGEABILITY)}</p>")
    if any(tags.parse_dp_check(t) for r in checks.records for t in r["scalars"]):
        out.append("<h2>DP mechanism checks</h2>")
        out.append(_dp_checks_html(checks))
    out.append(f"<h2>ROC at the last check (step {last['step']})</h2>")
    for q in checks.queries():
        img, caption = plot_roc(checks, q)
        out.append(_img(img, f"{q}: ROC"))
        out.append(f"<p class='caption'>{esc(caption)}</p>")
    out.append("<h2>Per-record risk</h2>")
    out.append(
        "<p class='caption'>Individual risk |f_p(z)| of each audited member record (MACE eq. 8; "
        "the posterior P(member | query) = (1 + f_p)/2): quantiles over the member records and "
        "the number of records above each level, per check.</p>"
    )
    any_risk = False
    for q in checks.queries():
        risk_img = plot_risk(checks, q)
        if risk_img is not None:
            any_risk = True
            out.append(_img(risk_img, f"{q}: per-record risk"))
    if not any_risk:
        out.append("<p>No per-record risk was recorded (queries of more than two dimensions).</p>")
    out.append("<h2>Most exposed records</h2>")
    out.append(_top_records_html(checks))
    out.append("<h2>All checks</h2>")
    out.append(_checks_table(checks))
    secs = [r["seconds"] for r in checks.records if math.isfinite(r["seconds"])]
    if secs:
        out.append(f"<p class='caption'>Median check time {float(np.median(secs)):.3g} s.</p>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(
    logdir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
    run: str | None = None,
) -> str:
    """Write the HTML report of the checks of one run under ``logdir``; returns the path written.

    ``out`` defaults to ``LOGDIR/privacy_report.html`` (beside the ``.jsonl`` file when ``logdir``
    is one). ``run`` picks the run when the source holds several (as in
    :func:`~privmon.report.read_checks`). Raises FileNotFoundError when ``logdir`` holds neither
    ``checks.jsonl`` nor TensorBoard privacy scalars, :class:`~privmon.report.SeveralRunsError`
    (a ValueError) when it holds several runs and ``run`` is None, ImportError when matplotlib is
    missing.

    Examples:
        >>> import os, tempfile
        >>> from privmon.report import Report, write_report
        >>> from privmon.sinks import JsonlSink
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     sink = JsonlSink(os.path.join(logdir, "checks.jsonl"))  # as a monitor's sink
        ...     sink.write(Report(step=100, scalars={}, run_id="3f2a9c"))
        ...     sink.close()
        ...     os.path.basename(write_report(logdir))
        'privacy_report.html'
    """
    return write_page(read_checks(logdir, run=run), logdir, out, title)


def write_page(
    checks: Checks,
    logdir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    title: str | None,
) -> str:
    """Write the page of ``checks`` (read from ``logdir``) to ``out`` (default: beside the
    source, :data:`REPORT_NAME`), atomically; returns the path written."""
    if out is None:
        base = os.fspath(logdir)
        folder = os.path.dirname(os.path.abspath(base)) if os.path.isfile(base) else base
        out = os.path.join(folder, REPORT_NAME)
    out = os.fspath(out)
    if not out or out.endswith(("/", os.sep)):
        raise ValueError(f"the output path {out!r} is not a file name: pass e.g. {REPORT_NAME}")
    existing = _output_status(out)  # refused before the plots are drawn
    if existing is not None and checks.kind == "jsonl" and os.path.samefile(out, checks.source):
        raise ValueError(f"the output path {out!r} is the input file: pass another --out")
    try:
        _write_file(out, render_html(checks, title=title).encode("utf-8"), existing)
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, out) from err  # a failed write: name the file
    return out


def _output_status(path: str) -> os.stat_result | None:
    """``lstat`` of the output path (None when it does not exist); a symbolic link or a
    directory there is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(
            f"the output path {path!r} is a symbolic link: privmon report does not write "
            "through links (remove it, or pass the file it points to)"
        )
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(
            f"the output path {path!r} is a directory: pass a file name, e.g. "
            f"{os.path.join(path, REPORT_NAME)}"
        )
    return st


def _write_file(path: str, data: bytes, existing: os.stat_result | None) -> None:
    """Write ``data`` to ``path`` (``existing``: its ``lstat``) without following a link there.

    A regular file (or a new one) is written to a temporary file beside it and renamed over
    it: readers never see half a page, and a failed write (a full disk) leaves the previous
    report whole, with its permission bits kept. A device or a pipe (``/dev/null``) is
    written in place.
    """
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never an existing file or link; mode 0o666 less the umask, as open() gives
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the report
        if existing is not None:
            os.chmod(temp, stat.S_IMODE(existing.st_mode))
        os.replace(temp, path)  # a link created at ``path`` meanwhile is replaced, not followed
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
