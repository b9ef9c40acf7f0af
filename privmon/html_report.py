"""A membership-privacy certificate: one self-contained HTML page from a monitor's log directory.

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
one direct sub-directory that holds privacy scalars (read with TensorBoard's
``EventAccumulator``). Lines of the JSONL that repeat a step (a run resumed from a checkpoint
re-runs the steps after it) are replaced by the later line. A last line with no newline that
does not parse was cut off mid-write (a crash, a full disk): it is skipped and the page and the
command say so. Any other line that is not a check (not UTF-8, not JSON, a field of the wrong
type, a step outside [0, 2**63 - 1]) is an error naming the line and the field, never skipped:
the verdict speaks for every check, and the one dropped could be the one that certifies leakage.

The page is written to a temporary file beside the output path and renamed over it, so a failed
write leaves the previous report whole; a symbolic link or a directory at the output path is
refused (the link and what it points to are left untouched).

ROC — a decision, documented here: the JSON lines hold only scalar ROC figures (AUC, TPR at fixed
FPRs of the threshold attack on the raw score). When TensorBoard event files sit beside the JSONL
(``writer=`` and ``JsonlSink`` pointed at the same directory, the usual set-up) or are the source,
the full ROC of the Bayes-rule attack at the last check is rebuilt from the monitor's membership PR
curve (TP / FP / TN / FN per threshold of the per-record posterior). That posterior is fitted on
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

Command line (wired into ``privmon report``): :func:`main_report` — ``LOGDIR [--out FILE]``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as _dt
import html
import io
import json
import math
import os
import re
import secrets
import stat
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "JSONL_NAME",
    "REPORT_NAME",
    "Checks",
    "Verdict",
    "add_report_arguments",
    "main_report",
    "read_checks",
    "render_html",
    "run_report",
    "verdict",
    "write_report",
]

JSONL_NAME = "checks.jsonl"
REPORT_NAME = "privacy_report.html"
TOL = 1e-9  # an ε lower bound above this certifies leakage (below: floating-point noise)

_ADV_RE = re.compile(
    r"^privacy/(.+)/(histogram|kde)/"
    r"(value|lower|lower_check|plugin|plugin_upper|upper|epsilon_lower_bound)$"
)
_RISK_RE = re.compile(r"^privacy/(.+)/risk/(q\d+|max|n_above_[0-9.]+)$")
_ROC_RE = re.compile(r"^privacy/(.+)/(auc|tpr@fpr=.+|accuracy_at_median)$")
_PR_RE = re.compile(r"^privacy/(.+)/membership_pr$")
_EXCHANGEABILITY = (
    "The DP ceiling compares like with like only when members and non-members are exchangeable "
    "(the audited members are a random part of the same pool as the held-out records). A shifted "
    "held-out set looks like leakage: check how the audit sets were drawn before blaming the DP "
    "implementation or its accounting."
)


# --------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------
@dataclass
class Checks:
    """The checks of one run, sorted by step (one record per step)."""

    source: str  # the file or directory read
    kind: str  # "jsonl" or "tensorboard"
    records: list[dict[str, Any]]  # step, scalars, epsilon, dp_violation, top_records, messages
    # query -> (step, fpr, tpr) of the ROC at the last check, when a PR curve was found
    roc: dict[str, tuple[int, np.ndarray, np.ndarray]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped_line: int | None = None  # the JSONL's last line, when it was cut off mid-write

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.records]

    def _index(self) -> dict[str, list[str]]:
        """query -> methods, in order of first appearance (cached: records are not mutated)."""
        cached = getattr(self, "_qm", None)
        if cached is not None and cached[0] == len(self.records):
            return cached[1]
        found: dict[str, set[str]] = {}
        for r in self.records:
            for tag in r["scalars"]:
                m = _ADV_RE.match(tag)
                if m:
                    found.setdefault(m.group(1), set()).add(m.group(2))
        index: dict[str, list[str]] = {
            q: [m for m in ("histogram", "kde") if m in ms] for q, ms in found.items()
        }
        self._qm = (len(self.records), index)
        return index

    def queries(self) -> list[str]:
        return list(self._index())

    def methods(self, query: str) -> list[str]:
        return list(self._index().get(query, []))

    def series(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        steps, values = [], []
        for r in self.records:
            if tag in r["scalars"]:
                steps.append(r["step"])
                values.append(r["scalars"][tag])
        return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)

    def has(self, tag: str) -> bool:
        return any(tag in r["scalars"] for r in self.records)


_MAX_STEP = 2**63 - 1  # steps are plotted as int64
_RESUMED = re.compile(r'\{"step":')


class _BadLine(ValueError):
    """A line of the JSON lines that is not a privmon check; the message names the field."""


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _number_or_null(v: Any, field: str) -> float:
    """A JSON number (the literals NaN / Infinity too) or null (the sink's NaN / inf) -> float."""
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _BadLine(f"{field} must be a number or null, got {_shown(v)}")
    try:
        return float(v)
    except OverflowError:  # an integer literal beyond the float range
        raise _BadLine(f"{field} is out of range for a float: {_shown(v)}") from None


def _count(v: Any, field: str, maximum: int = _MAX_STEP) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= maximum:
        raise _BadLine(f"{field} must be an integer >= 0, got {_shown(v)}")
    return v


def _mapping(obj: dict[str, Any], field: str) -> dict[str, Any]:
    """``obj[field]`` as a dict; missing or null -> {}."""
    v = obj.get(field)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _BadLine(f"{field} must be a JSON object, got {_shown(v)}")
    return v


def _list(v: Any, field: str, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise _BadLine(f"{field} must be a list of {what}, got {_shown(v)}")
    return v


def _check_record(obj: Any) -> dict[str, Any]:
    """One line's JSON value as a check record, every field type checked (JsonlSink's format:
    ``privmon.report.Report.to_json``; other keys are ignored)."""
    if not isinstance(obj, dict):
        raise _BadLine(f"a check must be a JSON object, got {type(obj).__name__}")
    if "step" not in obj:
        raise _BadLine("step is missing")
    step = obj["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        raise _BadLine(f"step must be an integer in [0, 2**63 - 1], got {_shown(step)}")
    scalars = {
        k: _number_or_null(v, f"scalars[{k!r}]") for k, v in _mapping(obj, "scalars").items()
    }
    eps = obj.get("epsilon")
    dp_violation = obj.get("dp_violation", False)
    if not isinstance(dp_violation, bool):
        raise _BadLine(f"dp_violation must be true or false, got {_shown(dp_violation)}")
    top_records = {}
    for k, v in _mapping(obj, "top_records").items():
        field = f"top_records[{k!r}]"
        indices = _list(v, field, "record indices (integers >= 0)")
        top_records[k] = [_count(i, f"{field}[{j}]") for j, i in enumerate(indices)]
    top_risks = {}
    for k, v in _mapping(obj, "top_risks").items():
        field = f"top_risks[{k!r}]"
        risks = _list(v, field, "numbers or null")
        top_risks[k] = [_number_or_null(r, f"{field}[{j}]") for j, r in enumerate(risks)]
    messages = _list(obj.get("messages") or [], "messages", "strings")
    if not all(isinstance(m, str) for m in messages):
        raise _BadLine(f"messages must be a list of strings, got {_shown(messages)}")
    return {
        "step": step,
        "scalars": scalars,
        "epsilon": None if eps is None else _number_or_null(eps, "epsilon"),
        "dp_violation": dp_violation,
        "top_records": top_records,
        "top_risks": top_risks,
        "top_tied": {
            k: _count(v, f"top_tied[{k!r}]") for k, v in _mapping(obj, "top_tied").items()
        },
        "messages": messages,
        "seconds": _number_or_null(obj.get("seconds"), "seconds"),
    }


def _parse_line(raw: bytes) -> Any:
    """One line's JSON value; _BadLine when it is not UTF-8 text or not valid JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _BadLine(f"not UTF-8 text (byte {err.start + 1})") from None
    try:
        return json.loads(text)
    except RecursionError:  # nested too deep for the parser
        raise _BadLine("not valid JSON (nested too deep)") from None
    except ValueError as err:
        hint = ""
        if len(_RESUMED.findall(text)) > 1:
            hint = (
                "; it holds the start of a line cut off mid-write and, after it, a whole line "
                "written when the run was resumed: delete the cut-off part"
            )
        raise _BadLine(f"not valid JSON ({err}){hint}") from None


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], int | None]:
    """The check records of a JSON-lines file (one per step: a later line for a step wins, as in
    a resumed run) and the number of the line skipped, if any.

    Only a last line with no newline that does not parse is skipped: the writer was interrupted
    mid-line (a crash, a full disk). Any other bad line is an error naming the line and the
    field, never skipped: the verdict is a statement about every check, and a dropped check
    could be the one that certifies leakage.
    """
    by_step: dict[int, dict[str, Any]] = {}
    skipped = None
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            cut_off = not raw.endswith(b"\n")  # only the last line can lack its newline
            try:
                obj = _parse_line(raw)
            except _BadLine as err:
                if cut_off:
                    skipped = lineno
                    continue
                raise ValueError(f"{path}, line {lineno}: {err}") from None
            try:
                record = _check_record(obj)
            except _BadLine as err:
                raise ValueError(f"{path}, line {lineno}: {err}") from None
            by_step[record["step"]] = record  # a later line for the same step wins
    return [by_step[s] for s in sorted(by_step)], skipped


def _event_dirs(root: str) -> list[str]:
    """``root`` and its direct sub-directories that hold TensorBoard event files (not deeper: a
    log directory is where ``SummaryWriter`` writes, and ``runs/`` trees can be large)."""
    candidates = [root]
    try:
        candidates += sorted(e.path for e in os.scandir(root) if e.is_dir())
    except OSError:
        pass
    out = []
    for d in candidates:
        try:
            if any("tfevents" in e.name and e.is_file() for e in os.scandir(d)):
                out.append(d)
        except OSError:
            continue
    return out


def _accumulator(path: str, scalars: bool) -> Any:
    from tensorboard.backend.event_processing import event_accumulator as ea

    guidance = {
        ea.SCALARS: 0 if scalars else 1,
        ea.TENSORS: 0,
        ea.HISTOGRAMS: 1,
        ea.COMPRESSED_HISTOGRAMS: 1,
        ea.IMAGES: 1,
        ea.AUDIO: 1,
    }
    acc = ea.EventAccumulator(path, size_guidance=guidance)
    acc.Reload()
    return acc


def _privacy_scalar_tags(acc: Any) -> list[str]:
    return [t for t in acc.Tags().get("scalars", []) if t.startswith("privacy/")]


def _records_from_events(acc: Any) -> list[dict[str, Any]]:
    by_step: dict[int, dict[str, float]] = {}
    for tag in _privacy_scalar_tags(acc):
        for e in acc.Scalars(tag):
            by_step.setdefault(int(e.step), {})[tag] = float(e.value)
    records = []
    for step in sorted(by_step):
        s = by_step[step]
        eps = s.get("privacy/epsilon")
        records.append(
            {
                "step": step,
                "scalars": s,
                "epsilon": eps,
                "dp_violation": s.get("privacy/dp_violation", 0.0) >= 0.5,
                "top_records": {},
                "messages": [],
                "seconds": math.nan,
            }
        )
    return records


def _roc_from_events(acc: Any) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    from tensorboard.util import tensor_util

    out = {}
    for tag in acc.Tags().get("tensors", []):
        m = _PR_RE.match(tag)
        if not m:
            continue
        events = acc.Tensors(tag)
        if not events:
            continue
        last = max(events, key=lambda e: (e.step, e.wall_time))
        tp, fp, tn, fn = tensor_util.make_ndarray(last.tensor_proto)[:4].astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpr = tp / (tp + fn)
            fpr = fp / (fp + tn)
        keep = np.isfinite(tpr) & np.isfinite(fpr)
        fpr = np.concatenate([[0.0], fpr[keep][::-1], [1.0]])
        tpr = np.concatenate([[0.0], tpr[keep][::-1], [1.0]])
        order = np.lexsort((tpr, fpr))
        out[m.group(1)] = (int(last.step), fpr[order], tpr[order])
    return out


def read_checks(logdir: str | os.PathLike[str]) -> Checks:
    """The checks a monitor wrote under ``logdir`` (see the module docstring for the sources)."""
    logdir = os.fspath(logdir)
    if not os.path.exists(logdir):
        raise FileNotFoundError(f"logdir {logdir!r} does not exist")
    jsonl = None
    if os.path.isfile(logdir):
        jsonl, root = logdir, os.path.dirname(os.path.abspath(logdir))
    else:
        root = logdir
        if os.path.isfile(os.path.join(logdir, JSONL_NAME)):
            jsonl = os.path.join(logdir, JSONL_NAME)
    event_dirs = _event_dirs(root)
    notes: list[str] = []
    if jsonl is not None:
        records, skipped = _read_jsonl(jsonl)
        if skipped is not None:
            notes.append(
                f"Line {skipped} of {jsonl}, the last, was cut off mid-write (the run was "
                "interrupted while writing it) and is skipped: the report covers the checks "
                "before it."
            )
        checks = Checks(
            source=jsonl, kind="jsonl", records=records, notes=notes, skipped_line=skipped
        )
        # ROC curves from a PR curve beside the JSONL, when exactly one event directory has them.
        with_pr = []
        for d in event_dirs:
            acc = _accumulator(d, scalars=False)
            roc = _roc_from_events(acc)
            if roc:
                with_pr.append((d, roc))
        if len(with_pr) == 1:
            checks.roc = with_pr[0][1]
        elif len(with_pr) > 1:
            notes.append(
                "Several TensorBoard runs under the log directory hold membership PR curves "
                f"({', '.join(d for d, _ in with_pr)}); which one belongs to the JSON lines is "
                "ambiguous, so the ROC shows only the operating points of the JSON lines."
            )
        return checks
    runs = []
    for d in event_dirs:
        acc = _accumulator(d, scalars=True)
        if _privacy_scalar_tags(acc):
            runs.append((d, acc))
    if not runs:
        raise FileNotFoundError(
            f"no {JSONL_NAME} and no TensorBoard privacy scalars under {logdir!r}: point privmon "
            "report at the directory given to PrivacyMonitor(writer=...) or at a JsonlSink's file"
        )
    if len(runs) > 1:
        raise ValueError(
            "several TensorBoard runs with privacy scalars under "
            f"{logdir!r}: {[d for d, _ in runs]}; pass one of them"
        )
    d, acc = runs[0]
    notes.append(
        "Read from TensorBoard event files: the indices of the most exposed records are not "
        f"recorded there (add privmon.sinks.JsonlSink('{JSONL_NAME}') to the monitor's sinks)."
    )
    return Checks(
        source=d,
        kind="tensorboard",
        records=_records_from_events(acc),
        roc=_roc_from_events(acc),
        notes=notes,
    )


# --------------------------------------------------------------------------------------------------
# the verdict
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    level: str  # "violation", "leakage", "none", "empty"
    headline: str
    details: tuple[str, ...] = ()


def _certificates(checks: Checks) -> list[tuple[int, str, str, float, float]]:
    """(step, query, method, lower, eps_lower_bound) of every check that certifies leakage."""
    hits = []
    for r in checks.records:
        s = r["scalars"]
        for q in checks.queries():
            for m in checks.methods(q):
                lower = s.get(f"privacy/{q}/{m}/lower", math.nan)
                elb = s.get(f"privacy/{q}/{m}/epsilon_lower_bound", math.nan)
                certified = elb > TOL if not math.isnan(elb) else lower > TOL
                if certified and not math.isnan(lower):
                    hits.append((r["step"], q, m, lower, elb))
    return hits


def _floor(hits: Sequence[tuple[int, str, str, float, float]]) -> float | None:
    """The trivial floor |2p − 1|, recovered from a certificate: ε_lb = 2·artanh(lower) − |λ|."""
    for _, _, _, lower, elb in hits:
        if math.isfinite(elb) and 0.0 <= lower < 1.0:
            lam = 2.0 * math.atanh(lower) - elb
            return max(0.0, math.tanh(lam / 2.0))
    return None


def _violations(checks: Checks) -> list[tuple[int, str, float, float, float]]:
    """(step, tag, lower, ceiling, eps) for each query/method above the (ε, δ) ceiling."""
    out = []
    for r in checks.records:
        s = r["scalars"]
        ceiling = s.get("privacy/ceiling/eps_delta", math.nan)
        eps = r["epsilon"] if r["epsilon"] is not None else s.get("privacy/epsilon", math.nan)
        found = False
        if not math.isnan(ceiling):
            for q in checks.queries():
                for m in checks.methods(q):
                    lower = s.get(f"privacy/{q}/{m}/lower", math.nan)
                    if lower > ceiling + 1e-12:
                        out.append((r["step"], f"{q}/{m}", lower, ceiling, eps))
                        found = True
        if r["dp_violation"] and not found:
            out.append((r["step"], "?", math.nan, ceiling, eps))
    return out


def verdict(checks: Checks) -> Verdict:
    """The plain-language verdict of a run (rules in the module docstring)."""
    if not checks.records:
        return Verdict("empty", "No checks recorded: nothing to certify.")
    n = len(checks.records)
    last_step = checks.records[-1]["step"]
    hits = _certificates(checks)
    floor = _floor(hits)
    details: list[str] = []
    floor_note = (
        f" (the trivial floor at this run's prior is {floor:.3f}: an advantage up to it needs no "
        "leakage)"
        if floor is not None and floor > 1e-6
        else ""
    )
    hit_steps = sorted({h[0] for h in hits})
    best = max(hits, key=lambda h: (h[3], -h[0])) if hits else None
    if best is not None:
        step, q, m, lower, elb = best
        leak_text = (
            f"The largest certified advantage is {lower:.3f}, at step {step} (query {q!r}, {m} "
            f"estimator){floor_note}; leakage was certified at {len(hit_steps)} of {n} checks, "
            f"first at step {hit_steps[0]}. The certified bounds hold together over every check, "
            "query and method of the run at the monitor's confidence 1 − δ, so one is enough. "
            f"Were training ε-DP, ε would have to be at least {elb:.3g} (given exchangeable "
            "audit sets)."
        )
    violations = _violations(checks)
    has_eps = any(r["epsilon"] is not None for r in checks.records) or checks.has("privacy/epsilon")
    if violations:
        step, tag, lower, ceiling, eps = violations[0]
        what = (
            f"the certified lower bound on the membership advantage ({tag}: {lower:.3f}) exceeds "
            f"the ceiling {ceiling:.3f} that (ε = {eps:.3g}, δ)-DP allows"
            if tag != "?"
            else "the monitor flagged a certified advantage above the (ε, δ)-DP ceiling"
        )
        headline = f"DP violation: at step {step} {what}."
        steps = sorted({v[0] for v in violations})
        details.append(
            f"Flagged at {len(steps)} of {n} checks (steps {_steps_text(steps)}). Something the DP "
            "claim rests on is false: either the DP implementation or its accounting is broken "
            "(e.g. less noise than the accountant was told), or the audit sets are not "
            "exchangeable."
        )
        if best is not None:
            details.append("Leakage detected. " + leak_text)
        details.append(_EXCHANGEABILITY)
        return Verdict("violation", headline, tuple(details))
    if best is not None:
        headline = f"Leakage detected: certified advantage ≥ {best[3]:.3f} at step {best[0]}."
        details.append(leak_text)
        level = "leakage"
    else:
        v_best = None
        for r in checks.records:
            for q in checks.queries():
                for m in checks.methods(q):
                    v = r["scalars"].get(f"privacy/{q}/{m}/value", math.nan)
                    if not math.isnan(v) and (v_best is None or v > v_best[0]):
                        v_best = (v, r["step"], q, m)
        headline = "No measurable membership leakage."
        text = (
            f"At none of the {n} checks (steps {checks.steps[0]}–{last_step}) did a certified "
            "lower bound on the optimal membership advantage rise above the trivial floor "
            "(0 at prior 0.5)."
        )
        if v_best is not None:
            text += (
                f" The largest point estimate was {v_best[0]:.3f} (step {v_best[1]}, query "
                f"{v_best[2]!r}, {v_best[3]})."
            )
        details.append(text)
        details.append(
            "This is not a proof of privacy: it covers the queries audited, on the audit sets "
            "used, with the power these sample sizes give; a stronger query or more audit records "
            "may find leakage these did not."
        )
        level = "none"
    if has_eps:
        eps_last = checks.records[-1]["epsilon"]
        ceil = checks.records[-1]["scalars"].get("privacy/ceiling/eps_delta", math.nan)
        details.append(
            f"Consistent with the DP budget: no certified lower bound exceeded the (ε, δ) "
            f"ceiling (at the last check ε = {_fmt(eps_last)}, ceiling {_fmt(ceil)}). "
            + _EXCHANGEABILITY
        )
    return Verdict(level, headline, tuple(details))


def _steps_text(steps: Sequence[int], limit: int = 12) -> str:
    text = ", ".join(str(s) for s in steps[:limit])
    return text + (f", … ({len(steps)} in all)" if len(steps) > limit else "")


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "—"
    v = float(v)
    if math.isnan(v):
        return "—"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.{digits}g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------
_COLORS = {"histogram": "#1f77b4", "kde": "#d62728"}


def _figure(ncols: int = 1, width: float = 7.0, height: float = 3.6) -> tuple[Any, Any]:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "privmon report needs matplotlib for its plots: pip install 'privmon[report]'"
        ) from err
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plot_advantage(checks: Checks, q: str, floor: float | None) -> str:
    fig, (ax,) = _figure()
    for m in checks.methods(q):
        c = _COLORS.get(m, "k")
        s, v = checks.series(f"privacy/{q}/{m}/value")
        ax.plot(s, v, "-o", color=c, ms=3, label=f"{m}: estimate (value)")
        s, v = checks.series(f"privacy/{q}/{m}/lower")
        ax.plot(s, v, "--", color=c, label=f"{m}: certified lower bound")
    for tag, style, label in (
        ("privacy/ceiling/tanh", ":", "ε-DP ceiling (tanh)"),
        ("privacy/ceiling/eps_delta", "-.", "(ε, δ)-DP ceiling"),
    ):
        s, v = checks.series(tag)
        if len(s):
            ax.plot(s, v, style, color="k", label=label)
    if floor is not None and floor > 1e-6:
        ax.axhline(floor, color="0.6", lw=1, label="trivial floor |2p − 1|")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("optimal membership advantage")
    ax.set_title(f"{q}: membership advantage vs DP ceiling")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def _plot_epsilon(checks: Checks) -> str:
    fig, (ax,) = _figure()
    s, v = checks.series("privacy/epsilon")
    ax.plot(s, v, "-", color="k", lw=2, label="ε (accountant)")
    for q in checks.queries():
        for m in checks.methods(q):
            s, v = checks.series(f"privacy/{q}/{m}/epsilon_lower_bound")
            ax.plot(s, v, "--o", ms=3, label=f"ε lower bound ({q}, {m})")
    ax.set_xlabel("training step")
    ax.set_ylabel("ε")
    ax.set_title("ε: accountant vs measured lower bounds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def _operating_points(scalars: dict[str, float], q: str) -> list[tuple[float, float]]:
    pts = []
    for tag, v in scalars.items():
        m = _ROC_RE.match(tag)
        if m and m.group(1) == q and m.group(2).startswith("tpr@fpr="):
            try:
                pts.append((float(m.group(2)[len("tpr@fpr=") :]), float(v)))
            except ValueError:
                continue
    return sorted(pts)


def _plot_roc(checks: Checks, q: str) -> tuple[str, str]:
    """The ROC image and a caption."""
    last = checks.records[-1]
    pts = _operating_points(last["scalars"], q)
    auc = last["scalars"].get(f"privacy/{q}/auc", math.nan)
    fig, (ax,) = _figure(width=5.0, height=4.2)
    diag = np.concatenate([[0.0], np.logspace(-4, 0, 200)])  # y = x, drawn on the symlog axis
    ax.plot(diag, diag, ":", color="0.5", label="chance")
    curve = checks.roc.get(q)
    if curve is not None:
        step, fpr, tpr = curve
        ax.plot(fpr, tpr, "-", color="#1f77b4", label=f"Bayes-rule attack (posterior), step {step}")
        caption = (
            f"ROC of the histogram Bayes-rule attack at step {step}, from the monitor's membership "
            "PR curve: the per-record posterior is fitted on the records it scores, so this curve "
            "is in-sample and optimistic, like the plug-in W_N."
        )
    else:
        caption = (
            "Only scalars were recorded, so the full ROC curve is not available (it is rebuilt "
            "from TensorBoard's membership PR curve when the event files sit beside the JSON "
            "lines): the points are the threshold attack's TPR at the target FPRs."
        )
    if pts:
        x, y = zip(*pts, strict=True)
        ax.plot(
            x,
            y,
            "o",
            color="#d62728",
            ms=6,
            label=f"threshold attack on the score: TPR@FPR (AUC {_fmt(auc, 3)})",
        )
        if curve is not None:
            caption += (
                f" Red points: the threshold attack on the raw score at the last check "
                f"(AUC {_fmt(auc, 3)})."
            )
    if curve is None and not pts:
        caption = "No ROC figures were recorded for this query (vector query)."
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("false positive rate (symlog)")
    ax.set_ylabel("true positive rate")
    ax.set_title(f"{q}: ROC at step {last['step']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _png(fig), caption


def _risk_tags(checks: Checks, q: str) -> tuple[list[str], list[str]]:
    quant: set[str] = set()
    counts: set[str] = set()
    for r in checks.records:
        for tag in r["scalars"]:
            m = _RISK_RE.match(tag)
            if m and m.group(1) == q:
                (counts if m.group(2).startswith("n_above_") else quant).add(tag)

    def key(t: str) -> float:
        last = t.rsplit("/", 1)[1]
        if last == "max":
            return 1e9
        return float(last[1:]) if last.startswith("q") else float(last[len("n_above_") :])

    return sorted(quant, key=key), sorted(counts, key=key)


def _plot_risk(checks: Checks, q: str) -> str | None:
    quant, counts = _risk_tags(checks, q)
    if not quant and not counts:
        return None
    fig, (a1, a2) = _figure(ncols=2, width=9.0, height=3.4)
    for tag in quant:
        s, v = checks.series(tag)
        name = tag.rsplit("/", 1)[1]
        label = "max" if name == "max" else f"{int(name[1:])}th percentile"
        a1.plot(s, v, "-o", ms=3, label=label)
    a1.set_ylim(-0.02, 1.02)
    a1.set_xlabel("training step")
    a1.set_ylabel("|f_p| of member records")
    a1.set_title(f"{q}: per-record risk quantiles")
    a1.grid(alpha=0.3)
    if quant:  # a legend without lines warns
        a1.legend(fontsize=7)
    for tag in counts:
        s, v = checks.series(tag)
        a2.plot(s, v, "-o", ms=3, label=f"risk > {tag.rsplit('_', 1)[1]}")
    a2.set_xlabel("training step")
    a2.set_ylabel("member records")
    a2.set_title(f"{q}: records above each risk level")
    a2.grid(alpha=0.3)
    if counts:
        a2.legend(fontsize=7)
    return _png(fig)


# --------------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------------
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
        text = v if isinstance(v, str) else _fmt(v)
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
            b = f"privacy/{q}/{m}"
            rows.append(
                [
                    q,
                    m,
                    s.get(f"{b}/value"),
                    s.get(f"{b}/lower"),
                    s.get(f"{b}/plugin"),
                    s.get(f"{b}/plugin_upper", s.get(f"{b}/upper")),
                    s.get(f"{b}/epsilon_lower_bound"),
                    s.get(f"privacy/{q}/auc"),
                    s.get(f"privacy/{q}/tpr@fpr=0.01"),
                    s.get(f"privacy/{q}/n_dropped"),
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
            [str(rank), str(i), _fmt(risks[rank - 1], 3) if rank <= len(risks) else "–",
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
            row.append(
                f"{_fmt(s.get(f'privacy/{q}/{m}/value'), 3)} / "
                f"{_fmt(s.get(f'privacy/{q}/{m}/lower'), 3)}"
            )
        if has_eps:
            row += [
                r["epsilon"],
                s.get("privacy/ceiling/eps_delta"),
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
    """The report page for ``checks`` as one HTML string."""
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
        f"{len(checks.records)} checks"
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
    floor = _floor(_certificates(checks))
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
        "biased up, they bound nothing and are shown only to reproduce the paper.</p>"
    )
    out.append("<h2>Advantage over training</h2>")
    for q in checks.queries():
        out.append(_img(_plot_advantage(checks, q, floor), f"{q}: advantage vs DP ceiling"))
    if checks.has("privacy/epsilon"):
        out.append(_img(_plot_epsilon(checks), "epsilon: accountant vs measured lower bounds"))
        out.append(f"<p class='caption'>{esc(_EXCHANGEABILITY)}</p>")
    out.append(f"<h2>ROC at the last check (step {last['step']})</h2>")
    for q in checks.queries():
        img, caption = _plot_roc(checks, q)
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
        risk_img = _plot_risk(checks, q)
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
) -> str:
    """Write the HTML report of the checks under ``logdir``; returns the path written.

    ``out`` defaults to ``LOGDIR/privacy_report.html`` (beside the ``.jsonl`` file when ``logdir``
    is one). Raises FileNotFoundError when ``logdir`` holds neither ``checks.jsonl`` nor
    TensorBoard privacy scalars, ImportError when matplotlib is missing.
    """
    return _write(read_checks(logdir), logdir, out, title)


def _write(
    checks: Checks,
    logdir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    title: str | None,
) -> str:
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


# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------
def add_report_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``privmon report`` arguments to ``parser`` (a sub-parser of the CLI)."""
    parser.add_argument(
        "logdir",
        help=f"the monitor's log directory (with {JSONL_NAME} or TensorBoard event files), "
        "or a JSON-lines file",
    )
    parser.add_argument(
        "--out", default=None, help=f"HTML file to write (default LOGDIR/{REPORT_NAME})"
    )
    parser.add_argument("--title", default=None, help="page title")
    return parser


def run_report(args: argparse.Namespace) -> int:
    """Run ``privmon report`` from parsed arguments: prints the verdict, the path and a warning
    line for each skipped line on stderr; returns 0. Bad input raises OSError, ValueError or
    ImportError, which :func:`privmon.cli.main` turns into one error line and exit code 2."""
    checks = read_checks(args.logdir)
    path = _write(checks, args.logdir, args.out, args.title)
    if checks.skipped_line is not None:
        print(
            f"privmon report: warning: skipped 1 line of {checks.source}: line "
            f"{checks.skipped_line} was cut off mid-write (the run was interrupted while "
            "writing it)",
            file=sys.stderr,
        )
    print(verdict(checks).headline)
    print(f"report: {path}")
    return 0


def main_report(argv: Sequence[str] | None = None) -> int:
    """``privmon report LOGDIR [--out FILE] [--title TEXT]``; returns the exit code."""
    from privmon.cli import main

    return main(["report", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main_report())
