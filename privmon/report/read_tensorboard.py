"""Reading the TensorBoard event files a :class:`~privmon.sinks.TensorBoardSink` wrote: the privacy
scalars per run, and the ROC rebuilt from each run's last membership PR curve (see
:mod:`privmon.report`).

Each file's events belong to the run named by the last run-id text summary
(:data:`~privmon.report.tags.RUN_ID_TEXT_TAG`) before them in that file; figures before any (a
file written by a privmon before run ids) are refused. A file whose records stop before its end
(cut off mid-write, or a damaged record: its checksum fails) loses the events from there on;
:attr:`EventChecks.lost` says which file, from which byte and after which step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from privmon.report import tags
from privmon.report.run_index import RunIndex
from privmon.report.stopping import parse_decision_text

__all__ = ["EventChecks", "event_dirs", "roc_beside"]


def event_dirs(root: str) -> list[str]:
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


def _before_run_ids(path: str, tag: str) -> ValueError:
    return ValueError(
        f"{path}: the figure {tag!r} comes before any run id: the file was written by a privmon "
        "before run ids, whose logs privmon report does not read"
    )


def _figure(path: str, step: int, tag: str, value: float) -> float:
    """``value`` after checking it lies in the figure's range (NaN aside); a ValueError names
    the file, the step and the figure (the verdict must not read it)."""
    wrong = tags.out_of_range(tag, value)
    if wrong is not None:
        raise ValueError(f"{path}, step {step}: the figure {tag!r} {wrong}, got {value!r}")
    return value


_FRAME = 16  # a record's bytes beside its data: length (8), its checksum (4), data checksum (4)


def _lost(path: str, read: int, size: int, step: int | None) -> str:
    """What a file whose records stop at byte ``read`` of ``size`` lost (``step``: the last
    event read before it)."""
    after = "before its first event" if step is None else f"after the event of step {step}"
    return (
        f"The TensorBoard event file {path} is cut off or damaged at byte {read} of its {size} "
        f"({after}): its events from there on are lost, and this report lacks whatever "
        "they held."
    )


class EventChecks:
    """The privacy figures of the event files in one directory, per run; ``lost``: a sentence
    for each file whose records stop before its end (:func:`_lost`)."""

    def __init__(self, folder: str) -> None:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto import event_pb2
        from tensorboard.util import tensor_util

        self.folder = folder
        self.runs = RunIndex("checks")  # step -> {tag: value}
        # run -> query -> (step, wall time, counts) of its latest membership PR curve
        self.pr: dict[str, dict[str, tuple[int, float, np.ndarray]]] = {}
        self.causes: dict[str, dict[int, list[str]]] = {}  # run -> step -> a DP violation's causes
        self.stopping: dict[str, dict[int, str]] = {}  # run -> step -> early stopping's decision
        self.outcomes: dict[str, str] = {}  # run -> its last early-stopping outcome
        self.lost: list[str] = []
        self.files = _event_files(folder)  # the event files read
        for path in self.files:
            self._read_file(path, RawEventFileLoader, event_pb2.Event, tensor_util)

    def _read_file(self, path: str, loader: Any, event_type: Any, tensor_util: Any) -> None:
        """One event file's records, as written: the loader ends quietly at a cut-off or
        damaged record, which :attr:`lost` then says."""
        current: str | None = None
        read, step = 0, None
        for record in loader(path).Load():
            read += len(record) + _FRAME
            event = event_type.FromString(record)
            step, when = int(event.step), float(event.wall_time)
            for value in event.summary.value:
                current = self._read_value(path, value, current, step, when, tensor_util)
        size = os.path.getsize(path)
        if read < size:
            self.lost.append(_lost(path, read, size, step))

    def _read_value(
        self, path: str, value: Any, current: str | None, step: int, when: float, tensor_util: Any
    ) -> str | None:
        """One summary value of run ``current`` (a run-id value begins a check of a new one):
        kept where it belongs; returns the run the next value belongs to."""
        tag = value.tag
        if tag == tags.RUN_ID_EVENT_TAG:
            ids = value.tensor.string_val
            current = ids[0].decode("utf-8", "replace") if ids else ""
            self.runs.put(current, step, {}, when)  # a check begins
        elif tag == tags.DP_CAUSES_EVENT_TAG and current is not None:
            text = b"".join(value.tensor.string_val).decode("utf-8", "replace")
            self.causes.setdefault(current, {})[step] = text.split("\n")
        elif tag == tags.STOPPING_EVENT_TAG and current is not None:
            text = b"".join(value.tensor.string_val).decode("utf-8", "replace")
            if parse_decision_text(text):
                self.stopping.setdefault(current, {})[step] = text
            else:  # the run's outcome, a sentence
                self.outcomes[current] = text
        elif value.HasField("simple_value"):
            if tags.is_privacy_figure(tag):
                if current is None:
                    raise _before_run_ids(path, tag)
                figure = _figure(path, step, tag, float(value.simple_value))
                self.runs.steps.setdefault(current, {}).setdefault(step, {})[tag] = figure
                self.runs.seen(current, when)
        elif (query := tags.parse_membership_pr(tag)) is not None and value.HasField("tensor"):
            if current is None:
                raise _before_run_ids(path, tag)
            kept = self.pr.setdefault(current, {})
            old = kept.get(query)
            if old is None or (step, when) >= old[:2]:
                kept[query] = (step, when, tensor_util.make_ndarray(value.tensor))
        return current

    def has_figures(self) -> bool:
        """Whether any run here wrote privacy scalars."""
        return any(any(s.values()) for s in self.runs.steps.values())

    def records(self, run_id: str) -> list[dict[str, Any]]:
        """The run's checks, as the JSON lines' records (no top records: not in event files)."""
        causes, stopping = self.causes.get(run_id, {}), self.stopping.get(run_id, {})
        return [
            {
                "run_id": run_id,
                "step": step,
                "scalars": s,
                "epsilon": s.get(tags.EPSILON),
                "dp_violation": s.get(tags.DP_VIOLATION, 0.0) >= 0.5,
                "top_records": {},
                "top_risks": {},
                "top_tied": {},
                "messages": [],
                "seconds": math.nan,
                **({"dp_causes": causes[step]} if step in causes else {}),
                **(
                    {"stopping": {"text": stopping[step], **parse_decision_text(stopping[step])}}
                    if step in stopping
                    else {}
                ),
            }
            for step, s in sorted(self.runs.steps.get(run_id, {}).items())
        ]

    def roc(self, run_id: str) -> dict[str, tuple[int, float, np.ndarray, np.ndarray]]:
        """query -> (step, wall time, fpr, tpr) of the run's last membership PR curve."""
        return {
            q: (step, when, *_roc(counts))
            for q, (step, when, counts) in self.pr.get(run_id, {}).items()
        }


def roc_beside(
    found: Sequence[EventChecks], run_id: str, notes: list[str]
) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """The ROC curves of run ``run_id`` from the membership PR curves ``found`` in the event
    files beside the JSON lines; a note when they hold PR curves of other runs only."""
    mine = [roc for events in found if (roc := events.roc(run_id))]
    if not mine:
        others = sorted({r for events in found for r, by_q in events.pr.items() if by_q})
        if others:
            notes.append(
                "The TensorBoard event files beside the JSON lines hold membership PR curves of "
                f"other runs only ({', '.join(others)}), so the ROC shows only the operating "
                "points of the JSON lines."
            )
        return {}
    latest: dict[str, tuple[int, float, np.ndarray, np.ndarray]] = {}
    for roc in mine:  # one run in several directories: its latest curve per query
        for q, curve in roc.items():
            if q not in latest or curve[:2] >= latest[q][:2]:
                latest[q] = curve
    return {q: (step, fpr, tpr) for q, (step, _, fpr, tpr) in latest.items()}
