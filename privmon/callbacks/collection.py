"""One check's scores: every query on every audit batch, with the training state guarded
(:class:`~privmon._training_guard.TrainingGuard`) and each query on its own.

A query that raises, that writes to the weights, or whose output breaks the query protocol — not
a tensor of shape (n,) or (n, d), not one row per record of its batch
(:func:`~privmon.queries.batches.count_records`), a trailing shape that changes between batches
— is left out with the reason, and the other queries are still scored (``strict``: raised).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from privmon._failure import Failure
from privmon._training_guard import TrainingGuard
from privmon.audit.opacus_per_sample import PerSampleState
from privmon.queries.base import check_scores
from privmon.queries.batches import batch_digests, count_records

__all__ = ["Collected", "Scores", "collect_scores"]

logger = logging.getLogger("privmon")

Scores = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Per query: its member and non-member scores."""


@dataclass(frozen=True)
class Collected:
    """What :func:`collect_scores` gathered."""

    scores: Scores
    """Per query scored: its member and non-member scores (a side that yielded no batch, where
    allowed, has zero rows)."""
    failed: dict[str, Failure]
    """Per query left out: why."""
    forward: float
    """Seconds spent in the query calls themselves (the forward passes), without the guard's
    work between them."""
    digests: tuple[list[bytes], list[bytes]] | None
    """Per side, one digest per record (:func:`~privmon.queries.batches.batch_digests`) when
    asked for and every batch held rows; else None."""


class _Scoring:
    """The queries' scores as they are collected, batch by batch, under ``guard``: each
    query's batches per side, its trailing shape, the queries left out, the seconds in the
    calls and the records' digests (None: not asked for, or a batch without rows)."""

    def __init__(self, queries: Sequence[Any], guard: TrainingGuard, *, strict: bool) -> None:
        self.queries, self.guard, self.strict = queries, guard, strict
        self.parts: dict[str, list[list[torch.Tensor]]] = {q.name: [[], []] for q in queries}
        self.trailing: dict[str, tuple[int, ...]] = {}
        self.failed: dict[str, Failure] = {}
        self.forward = 0.0
        self.seen: list[list[bytes]] | None = None

    def fail(self, q: Any, err: Exception, what: str) -> None:
        """Leave ``q`` out (logged), or re-raise ``err`` when strict."""
        if self.strict:
            raise err
        logger.error("privmon: %s failed: %s", what, err, exc_info=err)
        self.failed[q.name] = Failure.of(err)

    def prepare(self, device: torch.device) -> None:
        """Every query's ``prepare(device)``, checked by the guard."""
        for q in self.queries:
            try:
                try:
                    getattr(q, "prepare", lambda device: None)(device)
                finally:
                    refused = self.guard.after_query()
                if refused:
                    raise RuntimeError(f"query {q.name!r} {refused}")
            except Exception as err:  # this query only: the others are still scored
                self.fail(q, err, f"query {q.name!r} preparing")

    def digest(self, batch: Any, side: int, transform: Any) -> None:
        """Keep the digests of ``batch``'s records (none kept once a batch has none)."""
        if self.seen is None:
            return
        try:
            found = batch_digests(batch, transform)
        except Exception:  # a batch the transform cannot read: not compared
            found = None
        if found is None:
            self.seen = None
        else:
            self.seen[side].extend(found)

    def score(self, q: Any, batch: Any, side: int) -> None:
        """``q`` on one batch, its output checked against the protocol."""
        records = count_records(batch, getattr(q, "transform", None))
        t = time.perf_counter()
        try:
            out = q(batch)
        finally:
            self.forward += time.perf_counter() - t  # the call, not the guard
            refused = self.guard.after_query()
        if refused:
            raise RuntimeError(f"query {q.name!r} {refused}")
        if isinstance(out, torch.Tensor):
            out = out.detach()
        out = check_scores(out, records=records, trailing=self.trailing.get(q.name), name=q.name)
        self.trailing[q.name] = tuple(out.shape[1:])
        self.parts[q.name][side].append(out)

    def batch(self, batch: Any, side: int) -> None:
        """Every query still in on one batch."""
        for q in self.queries:
            if q.name in self.failed:
                continue
            try:
                self.score(q, batch, side)
            except Exception as err:  # this query only: the others go on
                self.fail(q, err, f"query {q.name!r}")

    def joined(self, device: torch.device) -> Scores:
        """Each query still in, its batches joined per side."""
        scores = {}
        for q in self.queries:
            if q.name in self.failed:
                continue
            try:
                sides = self.parts[q.name]
                scores[q.name] = (_joined(sides[0], device), _joined(sides[1], device))
            except Exception as err:  # e.g. batches on different devices
                self.fail(q, err, f"joining query {q.name!r}'s batches")
        return scores


def _scored(
    scoring: _Scoring, audit_sets: tuple[Any, Any], *, max_batches: int | None, transform: Any
) -> list[int]:
    """Every batch of both sets (at most ``max_batches`` each) through ``scoring``: how many
    batches each side yielded."""
    batches = [0, 0]
    for side, data in enumerate(audit_sets):
        for i, batch in enumerate(data):
            if max_batches is not None and i >= max_batches:
                break
            batches[side] += 1
            scoring.digest(batch, side, transform)
            scoring.batch(batch, side)
    return batches


def _released(queries: Sequence[Any], *, strict: bool) -> None:
    """Every query's ``release()``; one that raises is logged (re-raised when strict)."""
    for q in queries:
        try:
            getattr(q, "release", lambda: None)()
        except Exception:
            if strict:
                raise
            logger.exception("privmon: release of query %r failed", q.name)


def collect_scores(
    queries: Sequence[Any],
    audit_sets: tuple[Any, Any],
    *,
    roots: Sequence[nn.Module],
    device: torch.device,
    max_batches: int | None,
    strict: bool,
    digests: bool = False,
    allow_empty: bool = False,
) -> Collected:
    """Run every query on the member and non-member batches (at most ``max_batches`` of each)
    with the training state of ``roots`` guarded; ``release()`` every query after, once the
    state is restored. ``allow_empty``: a set that yields no batch gives zero rows (a rank's
    empty shard) instead of failing the check. ``digests``: also digest every record, read
    through the first query ``transform`` there is (the raw batch without one)."""
    transforms = (getattr(q, "transform", None) for q in queries)
    transform = next((t for t in transforms if t is not None), None)
    try:
        per_sample = PerSampleState(roots)
        with TrainingGuard(roots, audit_sets, per_sample=per_sample) as guard:
            scoring = _Scoring(queries, guard, strict=strict)
            scoring.prepare(device)
            scoring.seen = [[], []] if digests else None
            batches = _scored(scoring, audit_sets, max_batches=max_batches, transform=transform)
            if not allow_empty and not all(batches):
                raise ValueError("members and nonmembers must each yield at least one batch")
            scores = scoring.joined(device)
            if device.type == "cuda":  # queued kernels belong to the forward passes
                t = time.perf_counter()
                torch.cuda.synchronize(device)
                scoring.forward += time.perf_counter() - t
    finally:
        # after training's state is restored: a release() that raises cannot leave the
        # model in eval mode or the RNGs advanced
        _released(queries, strict=strict)
    seen = scoring.seen
    return Collected(
        scores=scores,
        failed=dict(scoring.failed),
        forward=scoring.forward,
        digests=None if seen is None else (seen[0], seen[1]),
    )


def _joined(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A side's batches as one tensor; zero rows on ``device`` when it had none."""
    return torch.cat(parts) if parts else torch.empty(0, device=device)
