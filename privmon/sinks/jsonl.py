"""JSON-lines sink: one line per check with the scalars, flags and exposed record indices."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from privmon.report import Report

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
    """Append one JSON object per report to ``path`` (created with its parent directory)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # kept open across checks

    def write(self, report: Report) -> None:
        """Append the report's :meth:`~privmon.report.Report.to_json` as one line (flushed)."""
        self._file.write(json.dumps(_clean(report.to_json()), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()
