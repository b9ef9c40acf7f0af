"""The scores a monitor's check audits on this process: its queries on its audit sets
(:func:`~privmon.callbacks.collection.collect_scores`, the training state of their modules
guarded) and the traps of identical or overlapping audit sets said (:class:`Traps`). Under
torch.distributed each rank collects its shard; the exchange is
:mod:`~privmon.callbacks.distributed`'s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from privmon._process_group import rank_and_world
from privmon._training_guard import audit_view
from privmon.callbacks.collection import Collected, collect_scores
from privmon.callbacks.traps import Traps

__all__ = ["CheckScores"]


class CheckScores:
    """Where a monitor's checks get their scores.

    Args:
        queries: the monitor's queries.
        members, nonmembers: the audit sets (iterated through
            :func:`~privmon._training_guard.audit_view`).
        modules: modules to protect besides those the queries declare.
        max_batches: at most this many batches of each set (None: all).
        strict: re-raise a query's failure instead of leaving it out.
        traps: where identical and overlapping audit sets are said.
    """

    def __init__(
        self,
        queries: Sequence[Any],
        members: Any,
        nonmembers: Any,
        *,
        modules: Sequence[nn.Module],
        max_batches: int | None,
        strict: bool,
        traps: Traps,
    ) -> None:
        self.queries, self.modules = queries, modules
        self._audit_sets = (audit_view(members), audit_view(nonmembers))
        self.max_batches, self.strict = max_batches, strict
        self._traps = traps

    def collect(self) -> Collected:
        """Scores of every query on members and non-members, the training state untouched; the
        queries left out (the others are still scored); and the seconds spent in the queries
        themselves (the forward passes). The first check also compares the two sets' records by
        content: identical sets fail this check and every later one, overlapping ones warn."""
        if self._traps.identical is not None:
            raise ValueError(self._traps.identical)
        roots = [m for q in self.queries for m in getattr(q, "modules", ())] + list(self.modules)
        tensors = (t for root in roots for t in [*root.parameters(), *root.buffers()])
        collected = collect_scores(
            self.queries,
            self._audit_sets,
            roots=roots,
            device=next((t.device for t in tensors), torch.device("cpu")),
            max_batches=self.max_batches,
            strict=self.strict,
            digests=not self._traps.overlap_checked,
            allow_empty=rank_and_world()[1] > 1,  # a rank's empty shard contributes nothing
        )
        self._traps.check_overlap(collected.digests)
        if self._traps.identical is not None:
            raise ValueError(self._traps.identical)
        return collected
