"""The monitor's kept reports, in O(checks × tags) floats: one float32 column per tag.

A run of 100,000 checks of four queries keeps about 100 figures per check; as Python dicts of
reports that is ~18 kB a check, as columns 0.4 kB. The latest report is kept whole (its per-query
results and per-record arrays); every earlier one is rebuilt on access from the columns: its step,
scalars (to float32 precision, 7 significant digits, read back as the shortest decimal), ε,
violation flag, timings, and its messages, failures and DP-violation causes (kept only for the
checks that have them).
"""

from __future__ import annotations

import array
import math
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch

from privmon.report import Report

__all__ = ["ReportHistory"]

_COLUMNS = {  # per-check fields besides the scalars: typecode of the array that holds them
    "steps": "q",
    "epsilon": "d",  # NaN where the check had no ε
    "has_epsilon": "b",
    "dp_violation": "b",
    "seconds": "f",
    "query_seconds": "f",
    "tagset": "i",  # which tags the check reported (an index into tagsets)
}
_DTYPES = {  # typecode -> (numpy, torch) dtypes of the same bytes
    "q": (np.int64, torch.int64),
    "d": (np.float64, torch.float64),
    "b": (np.bool_, torch.bool),
    "f": (np.float32, torch.float32),
    "i": (np.int32, torch.int32),
}


class ReportHistory(Sequence[Report]):
    """Every kept check's :class:`~privmon.report.Report`, oldest first (a read-only sequence)."""

    def __init__(self) -> None:
        self._fields: dict[str, array.array[Any]] = {
            name: array.array(code) for name, code in _COLUMNS.items()
        }
        self._scalars: dict[str, array.array[float]] = {}  # tag -> float32 column
        self._tagsets: list[tuple[str, ...]] = []
        self._tagset_index: dict[tuple[str, ...], int] = {}
        # check index -> (messages, failures, DP-violation causes), for the checks with any
        self._notes: dict[int, tuple[tuple[str, ...], dict[str, str], tuple[str, ...]]] = {}
        self._latest: Report | None = None
        self.run_id = ""  # a history holds one run's checks (its monitor's)

    def __len__(self) -> int:
        return len(self._fields["steps"])

    @overload
    def __getitem__(self, index: int) -> Report: ...

    @overload
    def __getitem__(self, index: slice) -> list[Report]: ...

    def __getitem__(self, index: int | slice) -> Report | list[Report]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"history index {index} out of range for {n} checks")
        if i == n - 1 and self._latest is not None:
            return self._latest
        return self._rebuild(i)

    def __iter__(self) -> Iterator[Report]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ReportHistory, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __repr__(self) -> str:
        return f"ReportHistory({len(self)} checks)"

    @property
    def steps(self) -> np.ndarray:
        """The checks' steps, as an int64 array."""
        return _tensor(self._fields["steps"]).numpy()

    def column(self, tag: str) -> np.ndarray:
        """One figure over the checks, as a float array (NaN where a check did not report it)."""
        if tag not in self._scalars:
            raise KeyError(f"no check reported {tag!r}")
        values = np.array(self._scalars[tag], dtype=np.float32).astype(str).astype(np.float64)
        reports_tag = np.array([tag in tags for tags in self._tagsets], dtype=bool)
        present = reports_tag[np.frombuffer(self._fields["tagset"], dtype=np.int32)]
        return np.where(present, values, np.nan)

    def append(self, report: Report) -> None:
        """Keep ``report`` whole until the next one arrives; its figures go into the columns."""
        n = len(self)
        tags = tuple(report.scalars)
        tagset = self._tagset_index.get(tags)
        if tagset is None:
            tagset = self._tagset_index[tags] = len(self._tagsets)
            self._tagsets.append(tags)
        f = self._fields
        f["steps"].append(report.step)
        f["epsilon"].append(math.nan if report.epsilon is None else report.epsilon)
        f["has_epsilon"].append(report.epsilon is not None)
        f["dp_violation"].append(report.dp_violation)
        f["seconds"].append(report.seconds)
        f["query_seconds"].append(report.query_seconds)
        f["tagset"].append(tagset)
        for tag, value in report.scalars.items():
            col = self._scalars.get(tag)
            if col is None:  # a tag first reported now: earlier checks did not have it
                col = self._scalars[tag] = array.array("f", [math.nan]) * n
            col.append(value)
        for col in self._scalars.values():
            if len(col) == n:  # a tag this check did not report
                col.append(math.nan)
        if report.messages or report.failures or report.dp_causes:
            self._notes[n] = (tuple(report.messages), dict(report.failures), report.dp_causes)
        self._latest = report
        self.run_id = report.run_id

    def _rebuild(self, i: int) -> Report:
        f = self._fields
        messages, failures, causes = self._notes.get(i, ((), {}, ()))
        return Report(
            step=f["steps"][i],
            scalars={tag: _decimal(self._scalars[tag][i]) for tag in self._tagsets[f["tagset"][i]]},
            epsilon=f["epsilon"][i] if f["has_epsilon"][i] else None,
            dp_violation=bool(f["dp_violation"][i]),
            messages=messages,
            failures=dict(failures),
            seconds=f["seconds"][i],
            query_seconds=f["query_seconds"][i],
            run_id=self.run_id,
            dp_causes=causes,
        )

    # -- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain containers only (loads with ``torch.load(weights_only=True)``)."""
        return {
            "run_id": self.run_id,
            "fields": {name: _tensor(col) for name, col in self._fields.items()},
            "scalars": {tag: _tensor(col) for tag, col in self._scalars.items()},
            "tagsets": [list(t) for t in self._tagsets],
            "notes": {  # "causes" only for a check that found a DP violation
                i: {"messages": list(m), "failures": fl, **({"causes": list(c)} if c else {})}
                for i, (m, fl, c) in self._notes.items()
            },
        }

    @classmethod
    def from_state_dict(cls, state: Any) -> ReportHistory:
        """A history from :meth:`state_dict`'s output, checked field by field: a ValueError
        names the first field that does not fit."""
        history = cls()
        keys = {"run_id", "fields", "scalars", "tagsets", "notes"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError("history must hold run_id, fields, scalars, tagsets and notes")
        run_id = state["run_id"]
        if not isinstance(run_id, str):
            raise ValueError(f"history run_id must be a string, got {run_id!r}")
        history.run_id = run_id
        fields, scalars, tagsets, notes = (
            state[k] for k in ("fields", "scalars", "tagsets", "notes")
        )
        if not isinstance(fields, dict) or set(fields) != set(_COLUMNS):
            raise ValueError(f"history fields must be {sorted(_COLUMNS)}")
        n = None
        for name, code in _COLUMNS.items():
            col = _column(fields[name], f"history field {name!r}", code, n)
            n = len(col)
            history._fields[name] = col
        if not isinstance(tagsets, list) or not all(
            isinstance(t, (list, tuple)) and all(isinstance(s, str) for s in t) for t in tagsets
        ):
            raise ValueError("history tagsets must be lists of tag names")
        history._tagsets = [tuple(t) for t in tagsets]
        history._tagset_index = {t: i for i, t in enumerate(history._tagsets)}
        if any(not 0 <= t < len(tagsets) for t in history._fields["tagset"]):
            raise ValueError("history field 'tagset' must index tagsets")
        if any(step < 0 for step in history._fields["steps"]):
            raise ValueError("history steps must be non-negative")
        if not isinstance(scalars, dict) or set(scalars) != {t for ts in tagsets for t in ts}:
            raise ValueError("history scalars must hold one column per reported tag")
        history._scalars = {
            tag: _column(col, f"history column {tag!r}", "f", n) for tag, col in scalars.items()
        }
        if not isinstance(notes, dict) or not all(
            isinstance(i, int)
            and 0 <= i < (n or 0)
            and isinstance(v, dict)
            and set(v) - {"causes"} == {"messages", "failures"}
            for i, v in notes.items()
        ):
            raise ValueError("history notes must map a check's index to messages and failures")
        history._notes = {
            i: (
                tuple(map(str, v["messages"])),
                {str(a): str(b) for a, b in v["failures"].items()},
                tuple(map(str, v.get("causes", ()))),
            )
            for i, v in notes.items()
        }
        return history


def _decimal(value: float) -> float:
    """A float32 figure as the float64 of its shortest decimal: an AUC of 0.563 reads back as
    0.563, not 0.5630000233650208."""
    return float(str(np.float32(value)))


def _tensor(col: array.array[Any]) -> torch.Tensor:
    np_dtype, _ = _DTYPES[col.typecode]
    return torch.from_numpy(np.frombuffer(col.tobytes(), dtype=np_dtype).copy())


def _column(values: Any, what: str, code: str, n: int | None) -> array.array[Any]:
    dtype = _DTYPES[code][1]
    if not isinstance(values, torch.Tensor) or values.ndim != 1 or values.dtype != dtype:
        raise ValueError(f"{what} must be a 1-D {dtype} tensor")
    if n is not None and len(values) != n:
        raise ValueError(f"{what} has {len(values)} entries, the history has {n} checks")
    return array.array(code, values.contiguous().numpy().tobytes())
