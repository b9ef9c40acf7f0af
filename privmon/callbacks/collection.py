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

from privmon._training_guard import TrainingGuard
from privmon.estimators.estimates import describe_error
from privmon.queries.base import check_scores
from privmon.queries.batches import batch_digests, count_records

__all__ = ["Collected", "collect_scores"]

logger = logging.getLogger("privmon")


@dataclass
class Collected:
    """What :func:`collect_scores` gathered."""

    scores: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Per query scored: its member and non-member scores (a side that yielded no batch, where
    allowed, has zero rows)."""
    failed: dict[str, str]
    """Per query left out: why."""
    forward: float
    """Seconds spent in the query calls themselves (the forward passes), without the guard's
    work between them."""
    digests: tuple[list[bytes], list[bytes]] | None
    """Per side, one digest per record (:func:`~privmon.queries.batches.batch_digests`) when
    asked for and every batch held rows; else None."""


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
    failed: dict[str, str] = {}
    transforms = (getattr(q, "transform", None) for q in queries)
    digest_transform = next((t for t in transforms if t is not None), None)

    def fail(q: Any, err: Exception, what: str) -> None:
        if strict:
            raise err
        logger.error("privmon: %s failed: %s", what, err, exc_info=err)
        failed[q.name] = describe_error(err)

    try:
        with TrainingGuard(roots, audit_sets) as guard:
            for q in queries:
                try:
                    try:
                        getattr(q, "prepare", lambda device: None)(device)
                    finally:
                        refused = guard.after_query()
                    if refused:
                        raise RuntimeError(f"query {q.name!r} {refused}")
                except Exception as err:  # this query only: the others are still scored
                    fail(q, err, f"query {q.name!r} preparing")
            parts: dict[str, list[list[torch.Tensor]]] = {q.name: [[], []] for q in queries}
            trailing: dict[str, tuple[int, ...]] = {}
            seen: list[list[bytes]] | None = [[], []] if digests else None
            forward, batches = 0.0, [0, 0]
            for side, data in enumerate(audit_sets):
                for i, batch in enumerate(data):
                    if max_batches is not None and i >= max_batches:
                        break
                    batches[side] += 1
                    if seen is not None:
                        try:
                            found = batch_digests(batch, digest_transform)
                        except Exception:  # a batch the transform cannot read: not compared
                            found = None
                        if found is None:
                            seen = None
                        else:
                            seen[side].extend(found)
                    for q in queries:
                        if q.name in failed:
                            continue
                        try:
                            records = count_records(batch, getattr(q, "transform", None))
                            t = time.perf_counter()
                            try:
                                out = q(batch)
                            finally:
                                forward += time.perf_counter() - t  # the call, not the guard
                                refused = guard.after_query()
                            if refused:
                                raise RuntimeError(f"query {q.name!r} {refused}")
                            if isinstance(out, torch.Tensor):
                                out = out.detach()
                            out = check_scores(
                                out, records=records, trailing=trailing.get(q.name), name=q.name
                            )
                            trailing[q.name] = tuple(out.shape[1:])
                            parts[q.name][side].append(out)
                        except Exception as err:  # this query only: the others go on
                            fail(q, err, f"query {q.name!r}")
            if not allow_empty and not all(batches):
                raise ValueError("members and nonmembers must each yield at least one batch")
            scores = {}
            for q in queries:
                if q.name in failed:
                    continue
                try:
                    scores[q.name] = (
                        _joined(parts[q.name][0], device),
                        _joined(parts[q.name][1], device),
                    )
                except Exception as err:  # e.g. batches on different devices
                    fail(q, err, f"joining query {q.name!r}'s batches")
            if device.type == "cuda":  # queued kernels belong to the forward passes
                t = time.perf_counter()
                torch.cuda.synchronize(device)
                forward += time.perf_counter() - t
    finally:
        # after training's state is restored: a release() that raises cannot leave the
        # model in eval mode or the RNGs advanced
        for q in queries:
            try:
                getattr(q, "release", lambda: None)()
            except Exception:
                if strict:
                    raise
                logger.exception("privmon: release of query %r failed", q.name)
    return Collected(
        scores=scores,
        failed=failed,
        forward=forward,
        digests=None if seen is None else (seen[0], seen[1]),
    )


def _joined(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A side's batches as one tensor; zero rows on ``device`` when it had none."""
    return torch.cat(parts) if parts else torch.empty(0, device=device)
