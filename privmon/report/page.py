"""The HTML page: the verdict, the figures and the tables in one self-contained file, written
atomically beside its output path (see :mod:`privmon.report`)."""

from __future__ import annotations

import datetime as _dt
import html
import math
import os
from collections import Counter
from typing import Any

import numpy as np

from privmon.report import tags
from privmon.report.blocks import REPORT_NAME, explain, glossary_html, head, img, save_page, table
from privmon.report.figures import plot_advantage, plot_epsilon, plot_risk, plot_roc
from privmon.report.formatting import fmt
from privmon.report.runs import Checks, read_checks
from privmon.report.verdict import EXCHANGEABILITY, certificates, certified_floor, verdict

__all__ = ["REPORT_NAME", "render_html", "write_page", "write_report"]

_LOSS_TRACES_NOTE = (
    'LOSS TNR (Dodd et al., "The Tail Tells All"): the share of held-out records whose loss '
    "exceeds all but a fraction α of the members' losses, an estimate of LiRA's TPR at FPR α "
    "from the losses alone: an estimate, with no confidence level, not a certified bound; "
    "shown beside the advantage and its certified lower bound. Most vulnerable records: the "
    'highest LT-IQR (Pollock et al., "Free Record-Level Privacy Risk Evaluation Through '
    "Artifact-Based Methods\"), the interquartile range of a record's loss over training, "
    "which ranks the records LiRA identifies at low FPR without reference models; beside the "
    "most exposed records above, which rank by the out-of-sample posterior at one check."
)


def _summary_table(checks: Checks, used: set[str]) -> str:
    """The last check's figures per query and method, beside the run's largest certified lower
    bound (the verdict's figure, to the verdict's 3 decimals) and its step."""
    s = checks.records[-1]["scalars"]
    best: dict[tuple[str, str], tuple[float, int]] = {}
    for step, q, m, lower, _ in certificates(checks):
        if (q, m) not in best or lower > best[q, m][0]:
            best[q, m] = (lower, step)
    rows = []
    for q in checks.queries():
        for m in checks.methods(q):
            top = best.get((q, m))
            rows.append(
                [
                    q,
                    m,
                    s.get(tags.value(q, m)),
                    s.get(tags.lower(q, m)),
                    f"{top[0]:.3f} (step {top[1]})" if top else "none",
                    s.get(tags.plugin(q, m)),
                    s.get(tags.plugin_upper(q, m)),
                    s.get(tags.epsilon_lower_bound(q, m)),
                    s.get(tags.auc(q)),
                    s.get(tags.tpr_at_fpr(q, 0.01)),
                    s.get(tags.n_dropped(q)),
                    s.get(tags.detectable(q)),
                ]
            )
    header = ["query", "method", "value", "certified lower", "largest certified lower"]
    header += ["plug-in", "plug-in + McDiarmid", "ε lower bound", "AUC", "TPR@FPR=1%"]
    return table([*header, "dropped", "detectable"], rows, left=2, used=used)


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
                f'<p class="note">{tied} more member(s) share the membership posterior of the last '
                "listed record: records with equal posteriors are listed by index, which is not "
                "a ranking.</p>"
            )
        parts.append(
            table(["rank", "member index", "membership posterior", "in the top list"], rows, left=0)
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


def _loss_tail_table(checks: Checks, used: set[str]) -> str | None:
    """Per loss query at the last check: LOSS TNR at each FPR beside the advantage and its
    certified lower bound (each method's); None when no check reported LOSS TNR."""
    s = checks.records[-1]["scalars"]
    tnr: dict[str, dict[str, float]] = {}
    for tag, v in s.items():
        if (parsed := tags.parse_loss_tnr(tag)) is not None:
            tnr.setdefault(parsed[0], {})[parsed[1]] = v
    if not tnr:
        return None
    fprs = sorted({f for by in tnr.values() for f in by}, key=float)
    rows = [
        [q, m, s.get(tags.value(q, m)), s.get(tags.lower(q, m)), *(tnr[q].get(f) for f in fprs)]
        for q in sorted(tnr)
        for m in checks.methods(q) or ["–"]
    ]
    header = ["query", "method", "value", "certified lower"]
    return table([*header, *(f"LOSS TNR at FPR {float(f):.1%}" for f in fprs)], rows, left=2,
                 used=used)  # fmt: skip


def _vulnerable_html(checks: Checks) -> str:
    """Each source's most vulnerable records by LT-IQR at the last check."""
    last = checks.records[-1]
    parts = []
    for source, top in sorted(last.get("lt_iqr", {}).items()):
        what = (
            f"training-set indices, traced up to step {top['steps'] - 1}"
            if source == tags.TRAINING_LOOP
            else f"indices into the audit member set, traced over {top['steps']} checks"
        )
        parts.append(f"<h3>{html.escape(source)}</h3><p>{what}; {top['n_scored']} scored.</p>")
        rows = [[str(r), str(i), fmt(v, 4)] for r, (i, v) in
                enumerate(zip(top["records"], top["scores"], strict=True), 1)]  # fmt: skip
        parts.append(table(["rank", "record index", "LT-IQR"], rows, left=0))
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
    levels = [r["scalars"][tags.DP_ALARM_DELTA] for r in checks.records
              if tags.DP_ALARM_DELTA in r["scalars"]]  # fmt: skip
    n = len(checks.records)
    rows = [
        [
            check,
            f"at {len(steps)} of {n} checks (first at step {steps[0]})" if steps else "never",
            ", ".join(f"{t}: {fmt(p, 3)}" for t, p in p_values.get(check, {}).items()) or "–",
        ]
        for check, steps in fired.items()
    ]
    return table(["check", "fired", "smallest p-value of each test"], rows, left=3) + (
        "<p class='caption'>Each check tests one assumption of the accountant on the optimizer "
        "itself (clipping, noise, sampling, steps counted, no update but the private steps). A "
        "deterministic test never fires on a correct run; a statistical test fires when its "
        f"p-value falls below its check's alarm level ({tags.DP_ALARM_DELTA}: the check's share "
        "of the monitor's dp_alarm_delta, split over its statistical tests), so that their "
        "false alarms over the whole run stay below dp_alarm_delta"
        + (f"; the smallest level of the run: {fmt(min(levels), 3)}" if levels else "")
        + ".</p>"
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
    return table(header, rows, left=1) + note


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
    esc, used = html.escape, set[str]()

    def caption(text: str, cls: str = "caption") -> str:
        return f'<p class="{cls}">{explain(text, used)}</p>'

    out = [
        head(title),
        f'<p class="meta">Source: <code>{esc(checks.source)}</code> ({esc(checks.kind)}) · '
        + (f"run <code>{esc(checks.run_id)}</code> · " if checks.run_id else "")
        + f"{len(checks.records)} checks"
        + (f", steps {checks.steps[0]}–{checks.steps[-1]}" if checks.records else "")
        + f" · generated {generated} by privmon</p>",
        f'<div class="verdict v-{v.level}"><h2>{esc(v.headline)}</h2>',
        *(f"<p>{explain(d, used)}</p>" for d in v.details),
        "</div>",
    ]
    out += [caption(note, "note") for note in checks.notes]
    if not checks.records:
        out += [glossary_html(used), "</body></html>"]
        return "\n".join(out)
    floor = certified_floor(certificates(checks))
    last = checks.records[-1]
    out.append(f"<h2>At the last check (step {last['step']})</h2>")
    out.append(_summary_table(checks, used))
    out += [caption(m, "note") for m in last["messages"]]
    out.append(
        caption(
            "value: debiased estimate of the optimal membership advantage (2·P(the best attack "
            "is right) − 1; 0: nothing leaks, 1: membership certain). certified lower: every "
            "certified lower bound of the run, at every check, holds together with probability "
            "≥ 1 − δ; leakage is certified when one exceeds the trivial floor |2p − 1| (0 at "
            "prior 0.5), i.e. when its ε lower bound is positive; the largest certified lower "
            "bound of the run, the verdict's figure, is the column beside it. plug-in and "
            "plug-in + McDiarmid are the MACE paper's W_N / U_N figures: biased up, they bound "
            "nothing and are shown only to reproduce the paper. detectable: the smallest "
            "advantage this check's certificate detects in half the runs at its audit sizes and "
            "δ; smaller leaks may go uncertified. Hover over a term, or see the terms at the "
            "end of the page."
        )
    )
    out.append("<h2>Advantage over training</h2>")
    for q in checks.queries():
        out.append(img(*plot_advantage(checks, q, floor)))
    if checks.has(tags.EPSILON) or checks.canary_methods():
        out.append(img(plot_epsilon(checks), "epsilon: accountant vs audited lower bounds"))
        if checks.canary_methods():
            out.append(
                caption(
                    "The one-run canary audit's ε lower bounds (Steinke et al.; f-DP, "
                    "Mahloujifar et al.) hold together over the run at the monitor's "
                    "confidence; the canaries' inclusion is randomised, so an audited ε above "
                    "the accountant's proves the DP implementation or its accounting wrong, "
                    "whatever the audit sets."
                )
            )
        out.append(caption(EXCHANGEABILITY))
    if any(tags.parse_dp_check(t) for r in checks.records for t in r["scalars"]):
        out.append("<h2>DP mechanism checks</h2>")
        out.append(_dp_checks_html(checks))
    out.append(f"<h2>ROC at the last check (step {last['step']})</h2>")
    for q in checks.queries():
        picture, text = plot_roc(checks, q)
        out += [img(picture, f"{q}: ROC"), caption(text)]
    out.append("<h2>Per-record risk</h2>")
    out.append(
        caption(
            "Individual risk |f_p| of each audited member record (MACE eq. 8; the posterior "
            "P(member | query) = (1 + f_p)/2): quantiles over the member records and the "
            "number of records above each level, per check."
        )
    )
    any_risk = False
    for q in checks.queries():
        risk_img = plot_risk(checks, q)
        if risk_img is not None:
            any_risk = True
            out.append(img(risk_img, f"{q}: per-record risk"))
    if not any_risk:
        out.append("<p>No per-record risk was recorded (queries of more than two dimensions).</p>")
    out.append("<h2>Most exposed records</h2>")
    out.append(_top_records_html(checks))
    tail = _loss_tail_table(checks, used)
    if tail is not None or last.get("lt_iqr"):
        out.append("<h2>Loss traces and the loss tail</h2>")
        out.append(caption(_LOSS_TRACES_NOTE))
    if tail is not None:
        out.append(tail)
    out.append(_vulnerable_html(checks))
    out.append("<h2>All checks</h2>")
    out.append(_checks_table(checks))
    secs = [r["seconds"] for r in checks.records if math.isfinite(r["seconds"])]
    if secs:
        out.append(f"<p class='caption'>Median check time {float(np.median(secs)):.3g} s.</p>")
    out += [glossary_html(used), "</body></html>"]
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
    return save_page(out, lambda: render_html(checks, title=title), inputs=checks.files)
