"""Per-record membership posterior of the fixed member audit set, kept across checks in
O(members) memory: the most exposed members are the likeliest ones."""

from __future__ import annotations

import csv
import os
from typing import Any

import numpy as np
import torch

from privmon._shown import shown
from privmon._validation import check_int
from privmon.estimators.risk import most_exposed, tied_beyond

__all__ = ["RankedRecords", "RecordTracker"]

FIELDS = ("last", "max", "max_step", "sum", "count")
ORDERS = ("max", "last", "mean")


class RankedRecords(list[tuple[int, float]]):
    """(index, membership posterior) pairs, highest first, and ``tied_beyond``: how many records
    outside the list share the last one's posterior. When it is positive the list is not a
    ranking at its end: which of the tied records made it was decided by index."""

    def __init__(self, pairs: list[tuple[int, float]], *, tied_beyond: int) -> None:
        super().__init__(pairs)
        self.tied_beyond = tied_beyond

    def __repr__(self) -> str:
        return f"RankedRecords({list(self)!r}, tied_beyond={self.tied_beyond})"


class RecordTracker:
    """For every member record of every query: its latest membership posterior P(member | q) =
    (1 + f_p)/2, its highest and the step it was reached, and its mean over the checks where it
    was finite. The posterior, not |f_p|, ranks them: a member the attack confidently calls a
    non-member has a high |f_p| and is not exposed.

    Records are identified by their position in the order the member iterable yields (keep the
    audit loader unshuffled). If the number of members changes, that query's track restarts.
    Only indices and posteriors are kept, never records.
    """

    def __init__(self) -> None:
        self._tracks: dict[str, dict[str, np.ndarray]] = {}

    def update(self, query: str, step: int, posterior: np.ndarray) -> None:
        """Take one check's member posteriors (NaN: a dropped record)."""
        values = np.asarray(posterior, dtype=np.float64)
        t = self._tracks.get(query)
        if t is None or t["last"].shape != values.shape:
            n = values.shape[0]
            t = self._tracks[query] = {
                "last": np.full(n, np.nan),
                "max": np.full(n, -np.inf),
                "max_step": np.full(n, -1.0),
                "sum": np.zeros(n),
                "count": np.zeros(n),
            }
        finite = np.isfinite(values)
        t["last"] = values.copy()
        higher = finite & (values > t["max"])
        t["max"][higher] = values[higher]
        t["max_step"][higher] = step
        t["sum"][finite] += values[finite]
        t["count"][finite] += 1

    @property
    def queries(self) -> list[str]:
        return list(self._tracks)

    def _pick(self, query: str | None) -> tuple[str, dict[str, np.ndarray]]:
        if not self._tracks:
            raise ValueError("no per-record risk tracked yet: run a check first")
        if query is None:
            if len(self._tracks) > 1:
                raise ValueError(f"query must name one of {self.queries}")
            query = next(iter(self._tracks))
        if query not in self._tracks:
            raise ValueError(f"query must be one of {self.queries}, got {shown(query)}")
        return query, self._tracks[query]

    def _column(self, t: dict[str, np.ndarray], by: str) -> np.ndarray:
        if by == "max":
            return np.where(np.isfinite(t["max"]), t["max"], np.nan)
        if by == "last":
            return t["last"]
        if by == "mean":
            with np.errstate(invalid="ignore", divide="ignore"):
                return np.where(t["count"] > 0, t["sum"] / t["count"], np.nan)
        raise ValueError(f"by must be one of {ORDERS}, got {shown(by)}")

    def top(self, k: int = 10, *, query: str | None = None, by: str = "max") -> RankedRecords:
        """The k most exposed member indices with their posterior, highest first; records of
        equal posterior in index order, and ``tied_beyond`` says how many more share the last
        one's."""
        k = check_int(k, name="k")
        _, t = self._pick(query)
        col = self._column(t, by)
        top = most_exposed(col, k)
        ties = tied_beyond(np.nan_to_num(col, nan=-1.0), top)
        return RankedRecords([(i, float(col[i])) for i in top], tied_beyond=ties)

    def to_csv(self, path: str | os.PathLike[str], *, query: str | None = None) -> str:
        """Write index, last, max, step of max, mean posterior and checks per member record (no
        records)."""
        names = self.queries if query is None else [self._pick(query)[0]]
        if not names:
            raise ValueError("no per-record risk tracked yet: run a check first")
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(
                [
                    "query",
                    "index",
                    "last_posterior",
                    "max_posterior",
                    "max_step",
                    "mean_posterior",
                    "checks",
                ]
            )
            for name in names:
                t = self._tracks[name]
                mx, mean = self._column(t, "max"), self._column(t, "mean")
                for i in range(t["last"].shape[0]):
                    w.writerow(
                        [
                            name,
                            i,
                            _fmt(t["last"][i]),
                            _fmt(mx[i]),
                            int(t["max_step"][i]),
                            _fmt(mean[i]),
                            int(t["count"][i]),
                        ]
                    )
        return path

    def state_dict(self) -> dict[str, Any]:
        return {
            q: {k: torch.from_numpy(v.copy()) for k, v in t.items()}
            for q, t in self._tracks.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the tracks; every one is checked (fields, 1-D float tensors of one length)
        before any replaces the current ones."""
        if not isinstance(state, dict):
            raise ValueError(f"records state must be a dict of tracks, got {type(state).__name__}")
        tracks = {}
        for q, t in state.items():
            if not isinstance(t, dict) or set(t) != set(FIELDS):
                raise ValueError(f"record track {q!r} must hold {FIELDS}, got {sorted(t)}")
            arrays = {}
            for k, v in t.items():
                if not isinstance(v, torch.Tensor) or v.ndim != 1 or not v.is_floating_point():
                    raise ValueError(f"record track {q!r} field {k!r} must be a 1-D float tensor")
                arrays[k] = v.double().numpy().copy()
            if len({a.shape[0] for a in arrays.values()}) != 1:
                raise ValueError(f"record track {q!r} fields differ in length")
            tracks[q] = arrays
        self._tracks = tracks


def _fmt(v: float) -> str:
    return "" if not np.isfinite(v) else f"{v:.6g}"
