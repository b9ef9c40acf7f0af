"""Reading a run: the checks a :class:`~privmon.PrivacyMonitor` wrote, from its JSON lines or its
TensorBoard event files, each line checked, one run at a time (see :mod:`privmon.report`).

Every line and event a monitor writes carries its run id (:attr:`privmon.report.Report.run_id`):
a JSON line its ``run_id`` field, a TensorBoard check a text summary :data:`RUN_ID_TAG` written
before its figures. Lines and event files without one (written by privmon before run ids) are
one run, the *legacy* run. A source that holds several runs — a second run written later into
the same log directory, or two written at the same time — is never merged into one report:
:func:`read_checks` refuses it with :class:`SeveralRunsError`, which names the runs, unless
``run=`` picks one. Within one run a step written again (a run resumed from a checkpoint re-runs
the steps after it) replaces the earlier check.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privmon._validation import check_optional_str
from privmon.report.check import Report

__all__ = [
    "ADVANTAGE_TAG",
    "AXIS_TAGS",
    "CANARY_TAG",
    "JSONL_NAME",
    "RISK_TAG",
    "ROC_TAG",
    "RUN_ID_TAG",
    "Checks",
    "RunInfo",
    "SeveralRunsError",
    "checks_from_reports",
    "read_checks",
]

JSONL_NAME = "checks.jsonl"
"""The JSON-lines file a :class:`~privmon.sinks.JsonlSink` writes in its log directory."""

RUN_ID_TAG = "privacy/run_id"
"""The text summary (``add_text``) a :class:`~privmon.sinks.TensorBoardSink` writes before each
check's figures: the run's id. TensorBoard stores it under ``privacy/run_id/text_summary``."""

AXIS_TAGS = {"privacy/axis/min": 0.0, "privacy/axis/max": 1.0}
"""Constant series a :class:`~privmon.sinks.TensorBoardSink` writes at each check and puts on each
advantage chart, so that the chart spans [0, 1]: TensorBoard's chart layout has no y-range, and
its default outlier clipping (values outside the 5–95 % quantiles of a chart) would cut the
curves' ends."""

ADVANTAGE_TAG = re.compile(
    r"^privacy/(.+)/(histogram|kde)/"
    r"(value|lower|lower_check|plugin|plugin_upper|upper|epsilon_lower_bound)$"
)
CANARY_TAG = re.compile(r"^privacy/canaries/(.+)/epsilon_lower_bound$")
"""The one-run canary audit's ε lower bound of a method (the method in group 1)."""
RISK_TAG = re.compile(r"^privacy/(.+)/risk/(q\d+|max|n_above_[0-9.]+)$")
ROC_TAG = re.compile(r"^privacy/(.+)/(auc|tpr@fpr=.+|accuracy_at_median)$")
_PR_RE = re.compile(r"^privacy/(.+)/membership_pr$")
_RUN_ID_EVENT = RUN_ID_TAG + "/text_summary"
_LEGACY = ""  # the run id of lines and events written without one
_LINE_START = re.compile(rb'\{"(?:run_id|step)":')  # how every line a JsonlSink writes begins


@dataclass(frozen=True)
class RunInfo:
    """One run found in a source: its id (``""`` for the legacy run, written without one), how
    many lines (JSON lines) or checks (TensorBoard) it wrote — a resumed run's repeats included —
    and the range of its steps."""

    run_id: str
    n_written: int
    first_step: int
    last_step: int
    unit: str  # "lines" or "checks"

    @property
    def label(self) -> str:
        """The id, or ``legacy (no run id)``."""
        return self.run_id or "legacy (no run id)"

    def describe(self, *, latest: bool = False) -> str:
        """``ID (steps A–B, N lines)``, with ``, the latest`` when ``latest``."""
        steps = (
            f"step {self.first_step}"
            if self.first_step == self.last_step
            else f"steps {self.first_step}–{self.last_step}"
        )
        unit = self.unit if self.n_written != 1 else self.unit.removesuffix("s")
        return f"{self.label} ({steps}, {self.n_written} {unit}{', the latest' if latest else ''})"

    def __str__(self) -> str:
        return self.describe()


class SeveralRunsError(ValueError):
    """A source holds several runs and none was picked: ``runs`` names them, oldest first (by
    when each last wrote)."""

    def __init__(self, source: str, runs: Sequence[RunInfo]) -> None:
        self.source = source
        self.runs = list(runs)
        listed = "; ".join(r.describe(latest=i == len(runs) - 1) for i, r in enumerate(runs))
        super().__init__(
            f"{source} holds {len(runs)} runs, and privmon never merges two runs into one "
            f"report: {listed}. Pick one with --run ID (read_checks(..., run=ID)): an id or a "
            "unique prefix of one, 'latest' for the run that wrote last, 'legacy' for what was "
            "written without a run id"
        )


@dataclass
class Checks:
    """The checks of one run, sorted by step (one record per step)."""

    source: str  # the file or directory read
    kind: str  # "jsonl", "tensorboard" or "reports" (in memory: checks_from_reports)
    records: list[dict[str, Any]]  # step, scalars, epsilon, dp_violation, top_records, messages
    # query -> (step, fpr, tpr) of the ROC at the last check, when a PR curve was found
    roc: dict[str, tuple[int, np.ndarray, np.ndarray]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped_line: int | None = None  # the JSONL's last line, when it was cut off mid-write
    torn_lines: list[int] = field(default_factory=list)  # lines that begin with a cut-off line
    run_id: str = _LEGACY  # the run reported ("" for the legacy run)
    other_runs: list[RunInfo] = field(default_factory=list)  # runs in the source left out

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

    def canary_methods(self) -> list[str]:
        """The one-run canary audit's methods the checks report, in order of first appearance."""
        found: dict[str, None] = {}
        for r in self.records:
            for tag in r["scalars"]:
                m = CANARY_TAG.match(tag)
                if m:
                    found.setdefault(m.group(1))
        return list(found)

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


class _ByRun:
    """What a source holds, per run id: one entry per step (a later check at a step replaces the
    earlier one), how many lines or checks each run wrote, and when each last wrote."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self.steps: dict[str, dict[int, Any]] = {}
        self.written: dict[str, int] = {}
        self.last: dict[str, float] = {}  # a line number or a wall time

    def put(self, run_id: str, step: int, entry: Any, when: float) -> None:
        """A new check of ``run_id`` at ``step``: it replaces any earlier one there."""
        self.steps.setdefault(run_id, {})[step] = entry
        self.written[run_id] = self.written.get(run_id, 0) + 1
        self.seen(run_id, when)

    def seen(self, run_id: str, when: float) -> None:
        self.last[run_id] = max(self.last.get(run_id, when), when)

    def infos(self) -> list[RunInfo]:
        """The runs, oldest first (by when each last wrote)."""
        return [
            RunInfo(
                run_id,
                # legacy TensorBoard files mark no check: count their steps
                self.written.get(run_id) or len(by_step),
                min(by_step),
                max(by_step),
                self.unit,
            )
            for run_id, by_step in sorted(self.steps.items(), key=lambda kv: self.last[kv[0]])
            if by_step
        ]

    def entries(self, run_id: str) -> list[Any]:
        """The run's entries, by step."""
        by_step = self.steps.get(run_id, {})
        return [by_step[s] for s in sorted(by_step)]


def _pick(source: str, runs: Sequence[RunInfo], run: str | None) -> str:
    """The id of the run to report: the only one, or the one ``run`` names (an id or a unique
    prefix of one, "latest", "legacy"); SeveralRunsError when several and none named."""
    if run is None:
        if len(runs) > 1:
            raise SeveralRunsError(source, runs)
        return runs[0].run_id if runs else _LEGACY
    if run == "latest":
        return runs[-1].run_id if runs else _LEGACY
    if run == "legacy":
        matches = [r for r in runs if not r.run_id]
    else:
        matches = [r for r in runs if r.run_id.startswith(run) and r.run_id]
        exact = [r for r in matches if r.run_id == run]
        matches = exact or matches
    if len(matches) != 1:
        held = "; ".join(str(r) for r in runs) if runs else "no checks"
        what = "matches no run" if not matches else "is the prefix of several runs"
        raise ValueError(f"run {run!r} {what} of {source}, which holds: {held}")
    return matches[0].run_id


def _left_out(source: str, runs: Sequence[RunInfo], chosen: str) -> tuple[list[RunInfo], list[str]]:
    """The runs left out of the report and the note that says so."""
    others = [r for r in runs if r.run_id != chosen]
    if not others:
        return [], []
    kept = next((r for r in runs if r.run_id == chosen), None)
    return others, [
        f"{source} holds {len(runs)} runs; this report covers only "
        f"{kept if kept is not None else repr(chosen)}. Left out, never merged into it: "
        + "; ".join(str(r) for r in others)
        + "."
    ]


_MAX_STEP = 2**63 - 1  # steps are plotted as int64


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
    run_id = obj.get("run_id", _LEGACY)  # lines written before run ids: the legacy run
    if not isinstance(run_id, str):
        raise _BadLine(f"run_id must be a string, got {_shown(run_id)}")
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
        "run_id": run_id,
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
        raise _BadLine(f"not valid JSON ({err})") from None


def _after_torn_start(raw: bytes) -> Any:
    """The JSON object of the whole line that follows a line cut off mid-write on the same line,
    or None. A JsonlSink before this version appended a resumed run's lines right after a cut-off
    last line: both parts begin as every line it writes does, and only the second parses."""
    if not _LINE_START.match(raw):
        return None
    for start in _LINE_START.finditer(raw, 1):
        try:
            value = _parse_line(raw[start.start() :])
        except _BadLine:
            continue
        return value if isinstance(value, dict) else None
    return None


@dataclass
class _Lines:
    runs: _ByRun
    skipped: int | None  # the last line, cut off mid-write
    torn: list[int]  # lines that begin with a line cut off mid-write


def _read_jsonl(path: str) -> _Lines:
    """The check records of a JSON-lines file, per run.

    Only what a crash leaves is skipped: a last line with no newline that does not parse (the
    writer was interrupted mid-line), and a cut-off line that a resumed run's line was appended
    to. Any other bad line is an error naming the line and the field, never skipped: the
    verdict is a statement about every check, and a dropped check could be the one that
    certifies leakage.
    """
    runs = _ByRun("lines")
    skipped, torn = None, []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = _parse_line(raw)
            except _BadLine as err:
                obj = _after_torn_start(raw)
                if obj is not None:
                    torn.append(lineno)
                elif not raw.endswith(b"\n"):  # only the last line can lack its newline
                    skipped = lineno
                    continue
                else:
                    raise ValueError(f"{path}, line {lineno}: {err}") from None
            try:
                record = _check_record(obj)
            except _BadLine as err:
                raise ValueError(f"{path}, line {lineno}: {err}") from None
            runs.put(record["run_id"], record["step"], record, lineno)
    return _Lines(runs, skipped, torn)


def _event_dirs(root: str) -> list[str]:
    """``root`` and its direct sub-directories that hold TensorBoard event files (not deeper: a
    log directory is where ``SummaryWriter`` writes, and ``runs/`` trees can be large)."""
    candidates = [root]
    try:
        candidates += sorted(e.path for e in os.scandir(root) if e.is_dir())
    except OSError:
        pass
    return [d for d in candidates if _event_files(d)]


def _event_files(folder: str) -> list[str]:
    """The event files in ``folder``, in name order (TensorBoard's: by creation time)."""
    try:
        return sorted(e.path for e in os.scandir(folder) if "tfevents" in e.name and e.is_file())
    except OSError:
        return []


def _roc(tp_fp_tn_fn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) of a membership PR curve's counts, from (0, 0) to (1, 1)."""
    tp, fp, tn, fn = tp_fp_tn_fn[:4].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpr = tp / (tp + fn)
        fpr = fp / (fp + tn)
    keep = np.isfinite(tpr) & np.isfinite(fpr)
    fpr = np.concatenate([[0.0], fpr[keep][::-1], [1.0]])
    tpr = np.concatenate([[0.0], tpr[keep][::-1], [1.0]])
    order = np.lexsort((tpr, fpr))
    return fpr[order], tpr[order]


class _Events:
    """The privacy figures of the event files in one directory, per run: each file's events
    belong to the run named by the last run-id summary before them in that file (events before
    any: the legacy run)."""

    def __init__(self, folder: str) -> None:
        from tensorboard.backend.event_processing.event_file_loader import (
            LegacyEventFileLoader,
        )
        from tensorboard.util import tensor_util

        self.folder = folder
        self.runs = _ByRun("checks")  # step -> {tag: value}
        # run -> query -> (step, wall time, counts) of its latest membership PR curve
        self.pr: dict[str, dict[str, tuple[int, float, np.ndarray]]] = {}
        for path in _event_files(folder):
            current = _LEGACY
            # the raw events, as written: a truncated last record ends the file quietly
            for event in LegacyEventFileLoader(path).Load():
                step, when = int(event.step), float(event.wall_time)
                for value in event.summary.value:
                    tag = value.tag
                    if tag == _RUN_ID_EVENT:
                        ids = value.tensor.string_val
                        current = ids[0].decode("utf-8", "replace") if ids else _LEGACY
                        self.runs.put(current, step, {}, when)  # a check begins
                    elif value.HasField("simple_value"):
                        if tag.startswith("privacy/") and tag not in AXIS_TAGS:
                            by_step = self.runs.steps.setdefault(current, {})
                            by_step.setdefault(step, {})[tag] = float(value.simple_value)
                            self.runs.seen(current, when)
                    elif (m := _PR_RE.match(tag)) is not None and value.HasField("tensor"):
                        kept = self.pr.setdefault(current, {})
                        old = kept.get(m.group(1))
                        if old is None or (step, when) >= old[:2]:
                            counts = tensor_util.make_ndarray(value.tensor)
                            kept[m.group(1)] = (step, when, counts)

    def has_figures(self) -> bool:
        """Whether any run here wrote privacy scalars."""
        return any(any(s.values()) for s in self.runs.steps.values())

    def records(self, run_id: str) -> list[dict[str, Any]]:
        """The run's checks, as the JSON lines' records (no top records: not in event files)."""
        return [
            {
                "run_id": run_id,
                "step": step,
                "scalars": s,
                "epsilon": s.get("privacy/epsilon"),
                "dp_violation": s.get("privacy/dp_violation", 0.0) >= 0.5,
                "top_records": {},
                "top_risks": {},
                "top_tied": {},
                "messages": [],
                "seconds": math.nan,
            }
            for step, s in sorted(self.runs.steps.get(run_id, {}).items())
        ]

    def roc(self, run_id: str) -> dict[str, tuple[int, float, np.ndarray, np.ndarray]]:
        """query -> (step, wall time, fpr, tpr) of the run's last membership PR curve."""
        return {
            q: (step, when, *_roc(counts))
            for q, (step, when, counts) in self.pr.get(run_id, {}).items()
        }


def _roc_beside(
    event_dirs: Sequence[str], run_id: str, notes: list[str]
) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """The ROC curves of run ``run_id`` from the membership PR curves in ``event_dirs`` (the
    event files beside the JSON lines); a note when they hold PR curves of other runs only, or
    of the legacy run in several directories (which one belongs to the lines is ambiguous)."""
    found = [(d, events.roc(run_id), events) for d in event_dirs for events in [_Events(d)]]
    mine = [(d, roc) for d, roc, _ in found if roc]
    if run_id == _LEGACY and len(mine) > 1:
        notes.append(
            "Several TensorBoard runs under the log directory hold membership PR curves "
            f"({', '.join(d for d, _ in mine)}); which one belongs to the JSON lines is "
            "ambiguous, so the ROC shows only the operating points of the JSON lines."
        )
        return {}
    if not mine:
        others = sorted({r or "legacy" for _, _, ev in found for r, by_q in ev.pr.items() if by_q})
        if others:
            notes.append(
                "The TensorBoard event files beside the JSON lines hold membership PR curves of "
                f"other runs only ({', '.join(others)}), so the ROC shows only the operating "
                "points of the JSON lines."
            )
        return {}
    latest: dict[str, tuple[int, float, np.ndarray, np.ndarray]] = {}
    for _, roc in mine:  # one run in several directories: its latest curve per query
        for q, curve in roc.items():
            if q not in latest or curve[:2] >= latest[q][:2]:
                latest[q] = curve
    return {q: (step, fpr, tpr) for q, (step, _, fpr, tpr) in latest.items()}


def read_checks(logdir: str | os.PathLike[str], *, run: str | None = None) -> Checks:
    """The checks of one run that a monitor wrote under ``logdir`` (the sources are in the
    :mod:`privmon.report` docstring).

    Args:
        logdir: the monitor's log directory, or its JSON-lines file.
        run: which run to read when the source holds several: a run id or a unique prefix of
            one, ``"latest"`` (the run that wrote last) or ``"legacy"`` (what was written
            without a run id). None reads the only run.

    Raises:
        SeveralRunsError (a ValueError): several runs and ``run`` is None; the message names
            them (ids, steps, lines or checks).
        ValueError: a line that is not a check, or ``run`` that names no run.
        FileNotFoundError: no JSON lines and no TensorBoard privacy scalars.
    """
    run = check_optional_str(run, name="run")
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
        lines = _read_jsonl(jsonl)
        if lines.skipped is not None:
            notes.append(
                f"Line {lines.skipped} of {jsonl}, the last, was cut off mid-write (the run was "
                "interrupted while writing it) and is skipped: the report covers the checks "
                "before it."
            )
        for lineno in lines.torn:
            notes.append(
                f"Line {lineno} of {jsonl} begins with a line cut off mid-write (a run "
                "interrupted while writing it, then resumed in append mode by an older privmon): "
                "the cut-off part is skipped, the check after it on that line is read."
            )
        infos = lines.runs.infos()
        chosen = _pick(jsonl, infos, run)
        others, left_out = _left_out(jsonl, infos, chosen)
        notes += left_out
        return Checks(
            source=jsonl,
            kind="jsonl",
            records=lines.runs.entries(chosen),
            roc=_roc_beside(event_dirs, chosen, notes),
            notes=notes,
            skipped_line=lines.skipped,
            torn_lines=lines.torn,
            run_id=chosen,
            other_runs=others,
        )
    with_figures = [events for d in event_dirs if (events := _Events(d)).has_figures()]
    if not with_figures:
        raise FileNotFoundError(
            f"no {JSONL_NAME} and no TensorBoard privacy scalars under {logdir!r}: point privmon "
            "report at the directory given to PrivacyMonitor(writer=...) or at a JsonlSink's file"
        )
    if len(with_figures) > 1:
        raise ValueError(
            "several TensorBoard runs with privacy scalars under "
            f"{logdir!r}: {[e.folder for e in with_figures]}; pass one of them"
        )
    events = with_figures[0]
    infos = events.runs.infos()
    chosen = _pick(events.folder, infos, run)
    others, left_out = _left_out(events.folder, infos, chosen)
    notes += left_out
    notes.append(
        "Read from TensorBoard event files: the indices of the most exposed records are not "
        f"recorded there (add privmon.sinks.JsonlSink('{JSONL_NAME}') to the monitor's sinks)."
    )
    return Checks(
        source=events.folder,
        kind="tensorboard",
        records=events.records(chosen),
        roc={q: (step, fpr, tpr) for q, (step, _, fpr, tpr) in events.roc(chosen).items()},
        notes=notes,
        run_id=chosen,
        other_runs=others,
    )


def checks_from_reports(reports: Iterable[Report], *, source: str = "memory") -> Checks:
    """The checks of one run held in memory (a monitor's ``history``, a sink's reports), read as
    the JSON lines of the same reports would be: the verdict and the page without files.
    Reports of several runs raise :class:`SeveralRunsError`, as :func:`read_checks` does."""
    runs = _ByRun("checks")
    for i, report in enumerate(reports):
        try:
            record = _check_record(report.to_json())
        except _BadLine as err:
            raise ValueError(f"{source}, report {i} (step {report.step}): {err}") from None
        runs.put(record["run_id"], record["step"], record, i)
    chosen = _pick(source, runs.infos(), None)
    return Checks(source=source, kind="reports", records=runs.entries(chosen), run_id=chosen)
