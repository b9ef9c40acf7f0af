"""Reading a run: the checks a :class:`~privmon.PrivacyMonitor` wrote, from its JSON lines or its
TensorBoard event files, each line checked (see :mod:`privmon.report`)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ADVANTAGE_TAG", "JSONL_NAME", "RISK_TAG", "ROC_TAG", "Checks", "read_checks"]

JSONL_NAME = "checks.jsonl"
"""The JSON-lines file a :class:`~privmon.sinks.JsonlSink` writes in its log directory."""

ADVANTAGE_TAG = re.compile(
    r"^privacy/(.+)/(histogram|kde)/"
    r"(value|lower|lower_check|plugin|plugin_upper|upper|epsilon_lower_bound)$"
)
RISK_TAG = re.compile(r"^privacy/(.+)/risk/(q\d+|max|n_above_[0-9.]+)$")
ROC_TAG = re.compile(r"^privacy/(.+)/(auc|tpr@fpr=.+|accuracy_at_median)$")
_PR_RE = re.compile(r"^privacy/(.+)/membership_pr$")


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
        """The checks' steps, in increasing order."""
        return [r["step"] for r in self.records]

    def _index(self) -> dict[str, list[str]]:
        """query -> methods, in order of first appearance (cached: records are not mutated)."""
        cached = getattr(self, "_qm", None)
        if cached is not None and cached[0] == len(self.records):
            return cached[1]
        found: dict[str, set[str]] = {}
        for r in self.records:
            for tag in r["scalars"]:
                m = ADVANTAGE_TAG.match(tag)
                if m:
                    found.setdefault(m.group(1), set()).add(m.group(2))
        index: dict[str, list[str]] = {
            q: [m for m in ("histogram", "kde") if m in ms] for q, ms in found.items()
        }
        self._qm = (len(self.records), index)
        return index

    def queries(self) -> list[str]:
        """The queries with advantage figures, in order of first appearance."""
        return list(self._index())

    def methods(self, query: str) -> list[str]:
        """The estimation methods ``query`` reports ("histogram", "kde"), in that order."""
        return list(self._index().get(query, []))

    def series(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the scalar ``tag`` over the checks that report it."""
        steps, values = [], []
        for r in self.records:
            if tag in r["scalars"]:
                steps.append(r["step"])
                values.append(r["scalars"][tag])
        return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)

    def has(self, tag: str) -> bool:
        """Whether any check reports the scalar ``tag``."""
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
