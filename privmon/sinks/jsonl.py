"""JSON-lines sink: one line per check with the scalars, flags, early stopping's decision and
exposed record indices; a line of the run's early-stopping outcome at its end."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

from privmon.report import Report, tags
from privmon.report.stopping import StoppingOutcome
from privmon.sinks.base import Backlog

__all__ = ["JsonlSink"]

logger = logging.getLogger("privmon")


def _clean(obj: Any) -> Any:
    """JSON has no NaN / inf: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


@contextlib.contextmanager
def _exclusive(fd: int) -> Iterator[None]:
    """Hold an advisory lock on the file (POSIX ``flock``) while a line is written or the file is
    repaired, so that two runs appending at once never cut each other's lines. Where there is no
    such lock (Windows, some network file systems) the line is written unlocked."""
    locked = False
    if sys.platform != "win32":
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError:
            logger.debug("privmon: no lock on the JSON lines; writing unlocked", exc_info=True)
    try:
        yield
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _read_at(file: Any, offset: int, size: int) -> bytes:
    """``size`` bytes of ``file`` from ``offset`` (appends still go to the end)."""
    file.seek(offset)
    return bytes(file.read(size))


def _last_newline(file: Any, size: int) -> int:
    """The offset just past the last newline in the file's first ``size`` bytes (0: none)."""
    end = size
    while end > 0:
        start = max(0, end - 65536)
        at = _read_at(file, start, end - start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


class JsonlSink:
    """Append one JSON object per report to ``path`` (created with its parent directory).

    Every line is written whole or not at all: a write that fails (a full disk) is cut back to the
    last complete line, and the report is written again, before the next one, at the next check
    (:class:`~privmon.sinks.base.Backlog`). A cut-off last line left by a killed run is repaired
    before anything is appended (a whole JSON object gets its newline, anything else is cut off,
    with a warning). Each line is written under an advisory lock (POSIX), so two runs appending
    to one file keep their lines whole; ``privmon report`` separates them by their run ids.

    Args:
        path: the ``.jsonl`` file, appended to (``privmon report`` reads it).

    Examples:
        >>> import json
        >>> import tempfile
        >>> from pathlib import Path
        >>> from privmon.report import Report
        >>> from privmon.sinks import JsonlSink
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "run" / "checks.jsonl"
        ...     sink = JsonlSink(path)
        ...     sink.write(Report(step=100, scalars={"privacy/loss/auc": 0.61}, run_id="demo"))
        ...     sink.close()
        ...     line = json.loads(path.read_text())
        >>> line["run_id"], line["step"], line["scalars"]
        ('demo', 100, {'privacy/loss/auc': 0.61})
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        # unbuffered: a failed write leaves nothing in a buffer to surface later; readable, to
        # find a cut-off last line
        self._file = open(self.path, "a+b", buffering=0)  # kept open across checks
        try:
            with _exclusive(self._file.fileno()):
                self._repair_last_line()
        except BaseException:
            self._file.close()
            raise
        self._backlog = Backlog()

    def _repair_last_line(self) -> None:
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        if size == 0 or _read_at(self._file, size - 1, 1) == b"\n":
            return
        start = _last_newline(self._file, size)
        tail = _read_at(self._file, start, size - start)
        try:
            whole = isinstance(json.loads(tail), dict)
        except (ValueError, RecursionError):
            whole = False
        if whole:  # written in full but for its newline
            self._file.write(b"\n")
            return
        os.ftruncate(fd, start)
        logger.warning(
            "privmon: the last line of %s was cut off mid-write (%d bytes with no newline, from "
            "a run interrupted while writing it); it was removed before appending",
            self.path,
            size - start,
        )

    def _write_line(self, report: Report) -> None:
        self._append(report.to_json())

    def _append(self, obj: dict[str, Any]) -> None:
        line = (json.dumps(_clean(obj), allow_nan=False) + "\n").encode()
        fd = self._file.fileno()
        with _exclusive(fd):
            end = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[self._file.write(view) :]
            except BaseException:
                os.ftruncate(fd, end)  # no partial line stays behind
                raise

    def write(self, report: Report) -> None:
        """Append the report's :meth:`~privmon.report.Report.to_json` as one line, after any
        earlier ones a fault kept back."""
        self._backlog.write(report, self._write_line)

    def write_outcome(self, outcome: StoppingOutcome) -> None:
        """Append the run's early-stopping outcome as one line of its own: ``run_id`` and
        ``stopping_outcome`` (:meth:`~privmon.report.stopping.StoppingOutcome.to_json`), no
        ``step`` (it is not a check); ``privmon report`` keeps the run's last."""
        self._append({"run_id": outcome.run_id, tags.STOPPING_OUTCOME_KEY: outcome.to_json()})

    def close(self) -> None:
        """Close the file."""
        self._file.close()
