"""One immutable report per privacy check."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privmon.estimators.advantage import AdvantageEstimate

__all__ = ["QueryResult", "Report"]


@dataclass(frozen=True)
class QueryResult:
    """What one query revealed at one check. Arrays are dropped from reports kept in history."""

    name: str
    estimates: dict[str, AdvantageEstimate]  # method -> estimate
    dim: int
    n_dropped: int
    member_risk: np.ndarray | None = None  # |f_p| per member record, in the order yielded
    member_posterior: np.ndarray | None = None
    nonmember_posterior: np.ndarray | None = None
    top_records: tuple[int, ...] = ()  # member indices, most exposed first

    def without_arrays(self) -> QueryResult:
        return dataclasses.replace(
            self, member_risk=None, member_posterior=None, nonmember_posterior=None
        )


@dataclass(frozen=True)
class Report:
    """The result of one check.

    ``scalars`` is a flat dict of tag -> float (the TensorBoard tags, all under ``privacy/``).
    ``dp_violation`` is True when a certified lower bound exceeded the (ε, δ) ceiling.
    Only indices and scores are held, never raw records.
    """

    step: int
    scalars: dict[str, float]
    queries: dict[str, QueryResult] = field(default_factory=dict)
    epsilon: float | None = None
    dp_violation: bool = False
    messages: tuple[str, ...] = ()
    seconds: float = 0.0  # the whole check
    query_seconds: float = 0.0  # of which inside the queries (the forward passes)

    def without_arrays(self) -> Report:
        return dataclasses.replace(
            self, queries={k: q.without_arrays() for k, q in self.queries.items()}
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready summary: scalars, flags and the most exposed record indices."""
        return {
            "step": self.step,
            "epsilon": self.epsilon,
            "dp_violation": self.dp_violation,
            "seconds": self.seconds,
            "query_seconds": self.query_seconds,
            "scalars": self.scalars,
            "top_records": {k: list(q.top_records) for k, q in self.queries.items()},
            "messages": list(self.messages),
        }
