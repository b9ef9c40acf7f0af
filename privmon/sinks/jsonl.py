"""JSON-lines sink: one line per check with the scalars, flags and exposed record indices."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from privmon.report import Report
from privmon.sinks.base import Backlog

__all__ = ["JsonlSink"]


def _clean(obj: Any) -> Any:
    """JSON has no NaN / inf: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class JsonlSink:
    """Append one JSON object per report to ``path`` (created with its parent directory).

    Every line is written whole or not at all: a write that fails (a full disk) is cut back to the
    last complete line, and the report is written again, before the next one, at the next check
    (:class:`~privmon.sinks.base.Backlog`).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        # unbuffered: a failed write leaves nothing in a buffer to surface later
        self._file = open(self.path, "ab", buffering=0)  # kept open across checks
        self._backlog = Backlog()

    def _write_line(self, report: Report) -> None:
        line = (json.dumps(_clean(report.to_json()), allow_nan=False) + "\n").encode()
        end = os.fstat(self._file.fileno()).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[self._file.write(view) :]
        except BaseException:
            os.ftruncate(self._file.fileno(), end)  # no partial line stays behind
            raise

    def write(self, report: Report) -> None:
        """Append the report's :meth:`~privmon.report.Report.to_json` as one line, after any
        earlier ones a fault kept back."""
        self._backlog.write(report, self._write_line)

    def close(self) -> None:
        """Close the file."""
        self._file.close()
