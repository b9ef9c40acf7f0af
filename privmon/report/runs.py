"""Reading a run: the checks of one run a :class:`~privmon.PrivacyMonitor` wrote, from its JSON
lines (:mod:`~privmon.report.read_jsonl`) or its TensorBoard event files
(:mod:`~privmon.report.read_tensorboard`), see :mod:`privmon.report`.

Every line and event a monitor writes carries its run id (:attr:`privmon.report.Report.run_id`).
A source that holds several runs — a second run written later into the same log directory, or
two written at the same time — is never merged into one report: :func:`read_checks` refuses it
with :class:`SeveralRunsError`, which names the runs, unless ``run=`` picks one. Within one run a
step written again (a run resumed from a checkpoint re-runs the steps after it) replaces the
earlier check.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privmon._validation import check_optional_str, check_writable_dir
from privmon.estimators.methods import registered_methods
from privmon.report import tags
from privmon.report.check import Report
from privmon.report.read_jsonl import BadLine, JsonlChecks, check_record, check_stopping, read_jsonl
from privmon.report.read_tensorboard import EventChecks, event_dirs, roc_beside
from privmon.report.run_index import RunIndex, RunInfo
from privmon.report.stopping import StoppingOutcome

__all__ = [
    "JSONL_NAME",
    "LATEST",
    "Checks",
    "RunInfo",
    "SeveralRunsError",
    "checks_from_reports",
    "read_checks",
    "read_runs",
    "runs_in",
    "version_dir",
]

LATEST = "latest"
"""What ``run=`` (``--run``) names the run that wrote last by; no run may take it as its id."""

JSONL_NAME = "checks.jsonl"
"""The JSON-lines file a :class:`~privmon.sinks.JsonlSink` writes in its log directory."""


class SeveralRunsError(ValueError):
    """A source holds several runs and none was picked: ``runs`` names them, oldest first (by
    when each last wrote).

    Examples:
        >>> from privmon.report import Report, SeveralRunsError, checks_from_reports
        >>> reports = [Report(step=100, scalars={}, run_id=run) for run in ("3f2a9c", "77aa01")]
        >>> try:
        ...     checks_from_reports(reports)
        ... except SeveralRunsError as err:
        ...     print([str(run) for run in err.runs])
        ['3f2a9c (step 100, 1 check)', '77aa01 (step 100, 1 check)']
    """

    def __init__(self, source: str, runs: Sequence[RunInfo]) -> None:
        self.source = source
        self.runs = list(runs)
        listed = "; ".join(r.describe(latest=i == len(runs) - 1) for i, r in enumerate(runs))
        super().__init__(
            f"{source} holds {len(runs)} runs, and privmon never merges two runs into one "
            f"report: {listed}. Pick one with --run ID (read_checks(..., run=ID)): an id or a "
            "unique prefix of one, or 'latest' for the run that wrote last"
        )


@dataclass
class Checks:
    """The checks of one run, sorted by step (one record per step).

    Examples:
        >>> from privmon import epsilon_lower_bound
        >>> from privmon.report import Report, checks_from_reports
        >>> def check(step, lower):  # the figures a monitor's check reports, in brief
        ...     figures = {"privacy/loss/histogram/lower": lower,
        ...                "privacy/loss/histogram/epsilon_lower_bound": epsilon_lower_bound(lower)}
        ...     return Report(step=step, scalars=figures, run_id="3f2a9c")
        >>> checks = checks_from_reports([check(100, 0.0), check(200, 0.15)])
        >>> checks.steps, checks.queries(), checks.methods("loss")
        ([100, 200], ['loss'], ['histogram'])
        >>> steps, lower = checks.series("privacy/loss/histogram/lower")
        >>> steps.tolist(), lower.tolist()
        ([100, 200], [0.0, 0.15])
    """

    source: str  # the file or directory read
    kind: str  # "jsonl", "tensorboard" or "reports" (in memory: checks_from_reports)
    files: list[str]  # every file read (the JSON lines, event files): never written onto
    # step, scalars, epsilon, dp_violation, top_records, messages (and dp_causes, if any)
    records: list[dict[str, Any]]
    # query -> (step, fpr, tpr) of the ROC at the last check, when a PR curve was found
    roc: dict[str, tuple[int, np.ndarray, np.ndarray]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped_line: int | None = None  # the JSONL's last line, when it was cut off mid-write
    torn_lines: list[int] = field(default_factory=list)  # lines that begin with a cut-off line
    # a sentence for each event file read whose records stop before its end (cut off or damaged)
    lost_events: list[str] = field(default_factory=list)
    run_id: str = ""  # the run reported ("" when the source holds none)
    other_runs: list[RunInfo] = field(default_factory=list)  # runs in the source left out
    # early stopping's outcome over the run (``sentence``, ``stopped_step``, ``restored_step``,
    # ``highest`` …; from event files the sentence alone), when the run wrote one
    outcome: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """How a comparison names the run: its folder and the first 8 characters of its id."""
        folder = self.source
        if self.kind == "jsonl":
            folder = os.path.dirname(os.path.abspath(folder))
        name = os.path.basename(os.path.normpath(folder)) or folder
        return f"{name}: {self.run_id[:8] or '(no run id)'}"

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
                parsed = tags.parse_advantage(tag)
                if parsed is not None:
                    found.setdefault(parsed[0], set()).add(parsed[1])
        index: dict[str, list[str]] = {
            q: [m for m in registered_methods() if m in ms] for q, ms in found.items()
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
                method = tags.parse_canary(tag)
                if method is not None:
                    found.setdefault(method)
        return list(found)

    def methods(self, query: str) -> list[str]:
        """The estimation methods ``query`` reports, in the estimators' order."""
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


def _pick(source: str, runs: Sequence[RunInfo], run: str | None) -> str:
    """The id of the run to report: the only one, or the one ``run`` names (an id or a unique
    prefix of one, "latest"); SeveralRunsError when several and none named."""
    if run is None:
        if len(runs) > 1:
            raise SeveralRunsError(source, runs)
        return runs[0].run_id if runs else ""
    if run == LATEST:
        return runs[-1].run_id if runs else ""
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


def _from_jsonl(
    jsonl: str,
    lines: JsonlChecks,
    events: Sequence[EventChecks],
    chosen: str,
    every: Sequence[RunInfo],
    source: str,
) -> Checks:
    """The checks of run ``chosen`` of a JSON-lines file, with the ROC from the ``events``
    beside it; ``every``: the runs of ``source`` (the file, or the directory that holds it and
    event files of other runs)."""
    lost = [sentence for found in events for sentence in found.lost]
    notes: list[str] = list(lost)
    if lines.skipped is not None:
        notes.append(
            f"Line {lines.skipped} of {jsonl}, the last, was cut off mid-write (the run was "
            "interrupted while writing it) and is skipped: the report covers the checks "
            "before it."
        )
    for lineno in lines.torn:
        notes.append(
            f"Line {lineno} of {jsonl} begins with a line cut off mid-write (a run "
            "interrupted while writing it, then another line appended to it): "
            "the cut-off part is skipped, the check after it on that line is read."
        )
    others, left_out = _left_out(source, every, chosen)
    notes += left_out
    return Checks(
        source=jsonl,
        kind="jsonl",
        files=[jsonl, *(path for found in events for path in found.files)],
        records=lines.runs.entries(chosen),
        roc=roc_beside(events, chosen, notes),
        notes=notes,
        skipped_line=lines.skipped,
        torn_lines=lines.torn,
        lost_events=lost,
        run_id=chosen,
        other_runs=others,
        outcome=lines.outcomes.get(chosen),
    )


def _event_runs(
    events: Sequence[EventChecks], without: Container[str] = ()
) -> dict[str, list[EventChecks]]:
    """Run id -> the folders of ``events`` with privacy scalars whose event files hold it (the
    runs ``without`` names left out)."""
    held: dict[str, list[EventChecks]] = {}
    for found in events:
        if found.has_figures():
            for info in found.runs.infos():
                if info.run_id not in without:
                    held.setdefault(info.run_id, []).append(found)
    return held


def _event_infos(held: dict[str, list[EventChecks]]) -> list[RunInfo]:
    """The runs of ``held`` (:func:`_event_runs`), oldest first, each named with its folders."""
    infos = []
    for run_id, found in held.items():
        parts = [e.runs.info(run_id) for e in found]
        when = max(e.runs.last[run_id] for e in found)
        info = RunInfo(
            run_id,
            sum(p.n_written for p in parts),
            min(p.first_step for p in parts),
            max(p.last_step for p in parts),
            "checks",
            ", ".join(e.folder for e in found),
        )
        infos.append((when, info))
    return [info for _, info in sorted(infos, key=lambda pair: pair[0])]


def _from_events(
    source: str, found: Sequence[EventChecks], chosen: str, every: Sequence[RunInfo]
) -> Checks:
    """The checks of run ``chosen`` from the event files that hold it (``found``: one folder);
    ``every``: the runs of ``source``."""
    if len(found) > 1:
        raise ValueError(
            f"run {chosen!r} wrote privacy scalars into the event files of several folders "
            f"under {source!r}: {[e.folder for e in found]}; pass one of them"
        )
    events = found[0]
    others, left_out = _left_out(source, every, chosen)
    notes = [*events.lost, *left_out]
    notes.append(
        "Read from TensorBoard event files: the indices of the most exposed records are not "
        f"recorded there (add privmon.sinks.JsonlSink('{JSONL_NAME}') to the monitor's sinks)."
    )
    return Checks(
        source=events.folder,
        kind="tensorboard",
        files=list(events.files),
        records=events.records(chosen),
        roc={q: (step, fpr, tpr) for q, (step, _, fpr, tpr) in events.roc(chosen).items()},
        notes=notes,
        lost_events=list(events.lost),
        run_id=chosen,
        other_runs=others,
        outcome={"sentence": events.outcomes[chosen]} if chosen in events.outcomes else None,
    )


def _runs_of(logdir: str | os.PathLike[str]) -> tuple[str, list[RunInfo], Callable[[str], Checks]]:
    """The runs a source holds: the name runs are listed under, its runs (oldest first) and
    how to read the checks of one of them (see :func:`read_checks`)."""
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
    events = [EventChecks(d) for d in event_dirs(root)]
    if jsonl is None:
        held = _event_runs(events)
        folders = {e.folder: e for found in held.values() for e in found}
        if not held:
            lost = " ".join(sentence for found in events for sentence in found.lost)
            raise FileNotFoundError(
                f"no {JSONL_NAME} and no TensorBoard privacy scalars under {logdir!r}: point "
                "privmon report at the directory given to PrivacyMonitor(writer=...) or at a "
                "JsonlSink's file" + (f". {lost}" if lost else "")
            )
        if len(folders) == 1:  # one folder: its runs, as it names them
            (only,) = folders.values()
            infos = only.runs.infos()
            return only.folder, infos, lambda c: _from_events(only.folder, [only], c, infos)
        every = _event_infos(held)
        return logdir, every, lambda c: _from_events(logdir, held[c], c, every)
    lines = read_jsonl(jsonl)
    beside = {} if os.path.isfile(logdir) else _event_runs(events, without=lines.runs.steps)
    if not beside:
        infos = lines.runs.infos()
        return jsonl, infos, lambda c: _from_jsonl(jsonl, lines, events, c, infos, jsonl)
    every = _event_infos(beside) + lines.runs.infos(where=jsonl)

    def read(chosen: str) -> Checks:
        if chosen in beside:
            return _from_events(logdir, beside[chosen], chosen, every)
        return _from_jsonl(jsonl, lines, events, chosen, every, logdir)

    return logdir, every, read


def read_checks(logdir: str | os.PathLike[str], *, run: str | None = None) -> Checks:
    """The checks of one run that a monitor wrote under ``logdir`` (the sources are in the
    :mod:`privmon.report` docstring).

    A directory's runs are those of its JSON lines and of the TensorBoard event files in it and
    in its direct sub-directories (the same run in both counts once): several, and none picked,
    raise :class:`SeveralRunsError`, whichever files hold them. Beside JSON lines, the runs of
    event files alone are listed first, so ``"latest"`` is the JSON lines' last run.

    Args:
        logdir: the monitor's log directory, or its JSON-lines file (then that file's runs).
        run: which run to read when the source holds several: a run id or a unique prefix of
            one, or ``"latest"`` (the run that wrote last). None reads the only run.

    Raises:
        SeveralRunsError (a ValueError): several runs and ``run`` is None; the message names
            them (ids, steps, lines or checks, and where each is when the sources are several).
        ValueError: a line that is not a check (one written by a privmon before run ids
            included; on the first line: the file is no privmon log), a figure out of its
            range, or ``run`` that names no run.
        FileNotFoundError: no JSON lines and no TensorBoard privacy scalars.

    Examples:
        >>> import os, tempfile
        >>> from privmon.report import Report, read_checks
        >>> from privmon.sinks import JsonlSink
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     sink = JsonlSink(os.path.join(logdir, "checks.jsonl"))  # as a monitor's sink
        ...     for step in (100, 200):
        ...         sink.write(Report(step=step, scalars={}, run_id="3f2a9c"))
        ...     sink.close()
        ...     checks = read_checks(logdir)
        >>> checks.kind, checks.run_id, checks.steps
        ('jsonl', '3f2a9c', [100, 200])
    """
    run = check_optional_str(run, name="run")
    source, infos, read = _runs_of(logdir)
    return read(_pick(source, infos, run))


def read_runs(logdirs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Checks]:
    """The checks of every run under each of ``logdirs`` (each read as :func:`read_checks`
    reads it), one :class:`Checks` per run, oldest first within each source: the runs that
    ``privmon report --compare`` puts side by side. A run found twice (two sources naming one
    file) counts once; one run id written in two places is two runs.

    Examples:
        >>> import os, tempfile
        >>> from privmon.report import Report, read_runs
        >>> from privmon.sinks import JsonlSink
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     sink = JsonlSink(os.path.join(logdir, "checks.jsonl"))
        ...     for run in ("dp", "no-dp"):  # two runs written into one file
        ...         sink.write(Report(step=100, scalars={}, run_id=run))
        ...     sink.close()
        ...     [checks.run_id for checks in read_runs(logdir)]
        ['dp', 'no-dp']
    """
    given = [logdirs] if isinstance(logdirs, str | os.PathLike) else list(logdirs)
    if not given:
        raise ValueError("logdirs must name at least one log directory or JSON-lines file")
    out: list[Checks] = []
    seen: set[tuple[str, str]] = set()  # (where it is written, run id): one id may be in two
    for logdir in given:  # folders (a run_id= given twice), and both are runs to compare
        _, infos, read = _runs_of(logdir)
        source = os.fspath(logdir)
        if os.path.isdir(source) and os.path.isfile(os.path.join(source, JSONL_NAME)):
            source = os.path.join(source, JSONL_NAME)
        for info in infos:
            key = (os.path.realpath(info.where or source), info.run_id)
            if key not in seen:
                seen.add(key)
                out.append(read(info.run_id))
    return out


def runs_in(path: str | os.PathLike[str]) -> list[RunInfo]:
    """The runs already written where a sink writes: a JSON-lines file's, or those of the
    TensorBoard event files directly in a folder (not its sub-folders: TensorBoard shows each
    folder as one run, and draws the checks of every run in it on one line). Nothing there, or
    no privmon figures, gives ``[]``; oldest first.

    Examples:
        >>> import os, tempfile
        >>> from privmon.report import Report, runs_in
        >>> from privmon.sinks import JsonlSink
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     path = os.path.join(logdir, "checks.jsonl")
        ...     print(runs_in(path))
        ...     sink = JsonlSink(path)
        ...     sink.write(Report(step=100, scalars={}, run_id="3f2a9c"))
        ...     sink.close()
        ...     [str(info) for info in runs_in(path)]
        []
        ['3f2a9c (step 100, 1 line)']
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return read_jsonl(path).runs.infos()
    if os.path.isdir(path):
        return EventChecks(path).runs.infos()
    return []


def version_dir(root: str | os.PathLike[str]) -> str:
    """A fresh folder for one run under ``root``: ``root/version_N``, N the first number not
    taken (Lightning's convention), created; ``tensorboard --logdir root`` then shows each run as
    a line of its own, and ``privmon report root --compare`` puts their event files' runs side
    by side (JSON-lines files in the sub-folders are not searched: name each folder,
    ``privmon report root/version_0 root/version_1 --compare``).

    Examples:
        >>> import os, tempfile
        >>> from privmon.report import version_dir
        >>> with tempfile.TemporaryDirectory() as root:
        ...     first, second = version_dir(root), version_dir(root)
        ...     os.path.relpath(first, root), os.path.relpath(second, root)
        ('version_0', 'version_1')
    """
    root = check_writable_dir(root, name="root")
    n = 0
    while True:
        folder = os.path.join(root, f"version_{n}")
        try:
            os.makedirs(folder)
        except FileExistsError:
            n += 1
            continue
        return folder


def checks_from_reports(
    reports: Iterable[Report], *, source: str = "memory", outcome: StoppingOutcome | None = None
) -> Checks:
    """The checks of one run held in memory (a monitor's ``history``, a sink's reports), read as
    the JSON lines of the same reports would be: the verdict and the page without files.
    Reports of several runs raise :class:`SeveralRunsError`, as :func:`read_checks` does.
    ``outcome``: early stopping's outcome over the run (``monitor.stopping_outcome``).

    Examples:
        >>> from privmon.report import Report, checks_from_reports
        >>> reports = [Report(step=step, scalars={}, run_id="3f2a9c") for step in (200, 100)]
        >>> checks = checks_from_reports(reports)  # e.g. a monitor's ``history``
        >>> checks.kind, checks.steps
        ('reports', [100, 200])
    """
    runs = RunIndex("checks")
    for i, report in enumerate(reports):
        try:
            record = check_record(report.to_json())
        except BadLine as err:
            raise ValueError(f"{source}, report {i} (step {report.step}): {err}") from None
        runs.put(record["run_id"], record["step"], record, i)
    chosen = _pick(source, runs.infos(), None)
    said = None if outcome is None else check_stopping(outcome.to_json(), "outcome")
    return Checks(
        source=source,
        kind="reports",
        files=[],
        records=runs.entries(chosen),
        run_id=chosen,
        outcome=said,
    )
