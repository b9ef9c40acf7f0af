"""What a source holds, run by run: the checks each run wrote, one per step, and how each run is
named to the user (:class:`RunInfo`). Both readers (:mod:`~privmon.report.read_jsonl`,
:mod:`~privmon.report.read_tensorboard`) fill a :class:`RunIndex`; :mod:`~privmon.report.runs`
picks one run from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RunIndex", "RunInfo"]


@dataclass(frozen=True)
class RunInfo:
    """One run found in a source: its id (``""``: reports written without one, e.g. made by
    hand), how many lines (JSON lines) or checks (TensorBoard) it wrote — a resumed run's
    repeats included — the range of its steps, and ``where`` it is when a directory's runs
    span several files (its JSON-lines file, or the folders of its event files; else "").

    Examples:
        >>> from privmon.report import RunInfo
        >>> str(RunInfo(run_id="3f2a9c", n_written=2, first_step=100, last_step=200, unit="lines"))
        '3f2a9c (steps 100–200, 2 lines)'
    """

    run_id: str
    n_written: int
    first_step: int
    last_step: int
    unit: str  # "lines" or "checks"
    where: str = ""  # the file or folder it is in, when a report reads several sources

    def describe(self, *, latest: bool = False) -> str:
        """``ID (steps A–B, N lines)``, with ``, the latest`` when ``latest``."""
        steps = (
            f"step {self.first_step}"
            if self.first_step == self.last_step
            else f"steps {self.first_step}–{self.last_step}"
        )
        unit = self.unit if self.n_written != 1 else self.unit.removesuffix("s")
        name = self.run_id or "(no run id)"
        where = f" in {self.where}" if self.where else ""
        return f"{name} ({steps}, {self.n_written} {unit}{where}{', the latest' if latest else ''})"

    def __str__(self) -> str:
        return self.describe()


class RunIndex:
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
        """``run_id`` wrote something at ``when``."""
        self.last[run_id] = max(self.last.get(run_id, when), when)

    def infos(self, where: str = "") -> list[RunInfo]:
        """The runs, oldest first (by when each last wrote); ``where``: the source's name, for
        a report that reads several."""
        return [
            self.info(run_id, where)
            for run_id, by_step in sorted(self.steps.items(), key=lambda kv: self.last[kv[0]])
            if by_step
        ]

    def info(self, run_id: str, where: str = "") -> RunInfo:
        """One run that wrote at least one check."""
        by_step = self.steps[run_id]
        return RunInfo(run_id, self.written[run_id], min(by_step), max(by_step), self.unit, where)

    def entries(self, run_id: str) -> list[Any]:
        """The run's entries, by step."""
        by_step = self.steps.get(run_id, {})
        return [by_step[s] for s in sorted(by_step)]
