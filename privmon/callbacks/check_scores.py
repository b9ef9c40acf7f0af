"""The scores a monitor's check audits: its queries on its audit sets
(:func:`~privmon.callbacks.collection.collect_scores`, the training state of their modules
guarded), the traps of identical or overlapping audit sets said (:class:`Traps`), and under
torch.distributed every rank's scores gathered once the ranks agreed to exchange them
(:func:`~privmon.callbacks.distributed.agree_on_scores`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from privmon._process_group import rank_and_world
from privmon._training_guard import audit_view
from privmon.callbacks.budget import CertificationBudget
from privmon.callbacks.collection import collect_scores
from privmon.callbacks.distributed import StepDisagreement, agree_on_scores, gather_scores
from privmon.callbacks.traps import Traps
from privmon.estimators.estimates import describe_error

__all__ = ["CheckScores", "Scores"]

logger = logging.getLogger("privmon")

Scores = dict[str, tuple[torch.Tensor, torch.Tensor]]


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

    def collect(self) -> tuple[Scores, dict[str, str], float]:
        """Scores of every query on members and non-members, the training state untouched; the
        queries left out (name -> why: the others are still scored); and the seconds spent in
        the queries themselves (the forward passes). The first check also compares the two
        sets' records by content: identical sets fail this check and every later one,
        overlapping ones warn."""
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
        return collected.scores, collected.failed, collected.forward

    def gathered(
        self, step: int, *, settings: str, budget: CertificationBudget, or_none: bool = False
    ) -> tuple[Scores, dict[str, str], float]:
        """:meth:`scores`, except that with ``or_none`` (and not ``strict``) a failure — but the
        ranks being at different steps — is logged and leaves every query out (no scores) on
        every rank instead of raising: the check goes on without them (the canaries' audit
        needs no audit set)."""
        try:
            return self.scores(step, settings=settings, budget=budget)
        except StepDisagreement:
            raise
        except Exception as err:
            if not or_none or self.strict:
                raise
            logger.exception("privmon: collecting the scores failed at step %s", step)
            return {}, {q.name: describe_error(err) for q in self.queries}, 0.0

    def scores(
        self, step: int, *, settings: str, budget: CertificationBudget
    ) -> tuple[Scores, dict[str, str], float]:
        """:meth:`collect` on this process; under torch.distributed every rank's scores, in rank
        order, once the ranks agreed that every one of them collected its shard, at the same
        step, with the same ``settings``, and on each query's dtype and trailing shape: a failure
        or a disagreement skips the check, or that query, on every rank instead of leaving the
        others waiting in a collective or mixing scores of different steps
        (:class:`~privmon.callbacks.distributed.StepDisagreement` when the steps differ). The
        ranks go on from the most checks any of them certified (``budget.spent``)."""
        if rank_and_world()[1] == 1:
            return self.collect()
        local: Scores = {}
        failed: dict[str, str] = {}
        forward, error = 0.0, None
        try:
            local, failed, forward = self.collect()
        except Exception as err:
            error = err
        agreed = agree_on_scores(
            step,
            names=[q.name for q in self.queries],
            settings=settings,
            spent=budget.spent,
            error=error,
            scores=local,
            failed=failed,
            strict=self.strict,
        )
        budget.spent = agreed.spent
        failed.update(agreed.left_out)
        return gather_scores(local, agreed), failed, forward
