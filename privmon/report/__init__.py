"""Reports: one immutable :class:`Report` per check, and the run's membership-privacy report —
one self-contained HTML page from a monitor's log directory.

``write_report(logdir)`` reads what a :class:`~privmon.PrivacyMonitor` wrote and renders, in one
HTML file with the plots embedded as base64 PNG (matplotlib, imported only here — the
``privmon[report]`` extra):

* a plain-language verdict: *No measurable membership leakage*, *Leakage detected: certified
  advantage ≥ X at step S*, or *DP violation: …* (with the exchangeability
  caveat every statement about the DP ceiling carries);
* per query: the estimated optimal advantage (``value``) and its certified lower bound for each
  method over the steps, against both DP ceilings (ε-DP ``tanh`` and (ε, δ)-DP) when an accountant
  was attached, and ε from the accountant against the measured ε lower bounds;
* the ROC of the membership attack at the last check;
* the per-record risk summary over the steps (quantiles of |f_p| over the member records and
  counts above 0.5 / 0.8 / 0.9) and the indices of the most exposed member records.

Sources, in order: ``LOGDIR/checks.jsonl`` (written by :class:`~privmon.sinks.JsonlSink`; ``LOGDIR``
may also be the ``.jsonl`` file itself), else the TensorBoard event files in ``LOGDIR`` or in the
one direct sub-directory that holds privacy scalars (read event by event).

One run per report. Every line and event a monitor writes carries its run id
(:attr:`Report.run_id`; a TensorBoard check a text summary before its figures); lines and event
files written without one come from a privmon before run ids, and are refused with an error
that says so. A source that holds several runs — a second run written into the same log
directory later or at the same time — is never merged into one report: ``read_checks`` raises
:class:`SeveralRunsError`, whose message names every run (its id, steps, and how many lines or
checks it wrote), unless ``run=`` (``privmon report --run``) picks one: an id or a unique
prefix of one, or ``"latest"`` (the run that wrote last). The page and the command then say
which runs were left out. Within one run, a step written again (a run resumed from a checkpoint
re-runs the steps after it) replaces the earlier check.

Damaged lines. What a crash leaves is skipped, and the page and the command say so: a last line
with no newline that does not parse (cut off mid-write: a crash, a full disk), and a cut-off line
that another line was appended to on the same line (a :class:`~privmon.sinks.JsonlSink` repairs
a cut-off last line before appending; a writer that does not, did that). Any other line that
is not a check (not UTF-8, not JSON, a field of the wrong type, a step outside [0, 2**63 - 1])
is an error naming the line and the field, never skipped: the verdict speaks for every check,
and the one dropped could be the one that certifies leakage.

The page is written to a temporary file beside the output path and renamed over it, so a failed
write leaves the previous report whole; a symbolic link or a directory at the output path is
refused (the link and what it points to are left untouched).

ROC — a decision, documented here: the JSON lines hold only scalar ROC figures (AUC, TPR at fixed
FPRs of the threshold attack on the raw score). When TensorBoard event files sit beside the JSONL
(``writer=`` and ``JsonlSink`` pointed at the same directory, the usual set-up) or are the source,
the full ROC of the Bayes-rule attack at the last check is rebuilt from the same run's membership
PR curve (TP / FP / TN / FN per threshold of the per-record posterior; the run is matched by its
id). That posterior is fitted on
the very records it scores, so the curve is in-sample and optimistic, like the plug-in W_N; the
page says so. When no PR curve is available the ROC plot shows only the operating points the
scalars give (TPR at each target FPR, with the AUC in the legend) and says that the curve is
missing. Top records exist only in the JSONL; from TensorBoard alone the page says they are not
recorded.

The verdict rests on the certified lower bounds, not on point estimates. A check *certifies
leakage* when its ``epsilon_lower_bound`` is positive — equivalently its certified lower bound
exceeds the trivial floor |2p − 1| of the prior p, so the rule holds at any prior without knowing
it. The monitor certifies its lower bounds over the whole run (every check, query and method
together hold with probability ≥ 1 − δ), so one certificate at any check is *Leakage detected*.
*DP violation* means a certified lower bound exceeded the (ε, δ) ceiling.

Layout: :mod:`~privmon.report.tags` (every figure's name), :mod:`~privmon.report.check`
(:class:`Report`), :mod:`~privmon.report.runs` (reading a run, from
:mod:`~privmon.report.read_jsonl` or :mod:`~privmon.report.read_tensorboard`),
:mod:`~privmon.report.verdict`, :mod:`~privmon.report.figures`, :mod:`~privmon.report.page`.
Command line: ``privmon report LOGDIR [--out FILE] [--title TEXT] [--run ID]``
(:mod:`privmon.cli`).
"""

from privmon.report.check import QueryResult, Report
from privmon.report.page import REPORT_NAME, render_html, write_report
from privmon.report.runs import (
    JSONL_NAME,
    Checks,
    RunInfo,
    SeveralRunsError,
    checks_from_reports,
    read_checks,
)
from privmon.report.verdict import Verdict, verdict

__all__ = [
    "JSONL_NAME",
    "REPORT_NAME",
    "Checks",
    "QueryResult",
    "Report",
    "RunInfo",
    "SeveralRunsError",
    "Verdict",
    "checks_from_reports",
    "read_checks",
    "render_html",
    "verdict",
    "write_report",
]
