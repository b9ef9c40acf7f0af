"""The audits' models split over the ranks of a torch.distributed group.

Called on every rank of an initialised default process group (``torchrun``, any backend), an
audit gives each rank a contiguous share of the models still to train (:func:`share`), and the
ranks exchange what each trained (:func:`exchange`) so that every rank returns the result one
process would. Model i's seed and mask depend only on ``(seed, i)``
(:mod:`privmon.audit.seeding`), never on the rank or the world size.

A collective returns only once every rank has joined it, so the ranks meet twice and at the same
points whatever happens on each: once before training, to agree on the recipe and on what a
checkpoint folder already holds (:func:`plan`), and once after, where a rank that
failed hands its error instead of its models and every rank then raises (:func:`exchange`). A
rank that dies leaves the others in that collective until the process group's timeout
(``init_process_group(timeout=...)``), which then raises: an error, never a hang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypeVar

import numpy as np

from privmon._process_group import every_rank, rank_and_world

__all__ = ["Work", "exchange", "plan", "share"]

T = TypeVar("T")


def share(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """This rank's contiguous share of ``indices``: the shares of ranks 0 .. world-1 cover
    them in order, each of ``len // world`` or one more items (the first ranks the larger)."""
    return [int(i) for i in np.array_split(np.asarray(indices, dtype=np.int64), world)[rank]]


class Work(NamedTuple):
    """This rank's part of the models: ``load`` from the checkpoint folder, ``train``."""

    rank: int
    world: int
    load: list[int]
    train: list[int]


def plan(
    n_models: int,
    recipe: Mapping[str, str],
    saved_here: Sequence[int],
    *,
    distributed: bool,
    what: str,
) -> Work:
    """Ranks agree on the recipe and on which models a checkpoint folder already holds, and
    share out the rest.

    ``recipe``: this rank's fingerprint of what it was asked (every rank must be asked the
    same); ``saved_here``: the model indices this rank finds saved. Each saved model is loaded
    by the lowest rank that sees it (so a folder shared by the ranks is read once, and folders
    local to each rank work too); the models no rank has are split by :func:`share`. Raises
    ValueError on every rank, naming what differs, when the ranks were given different
    recipes. In one process: loads what is saved, trains the rest.
    """
    rank, world = rank_and_world(distributed)
    plans = every_rank((dict(recipe), sorted(saved_here)), world)
    first = plans[0][0]
    for r, (other, _) in enumerate(plans):
        differs = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        if differs:
            raise ValueError(
                f"{what}: the ranks were called with different arguments ({', '.join(differs)} "
                f"differ between rank 0 and rank {r}): every rank must pass the same ones"
            )
    owner: dict[int, int] = {}
    for r, (_, seen) in enumerate(plans):
        for i in seen:
            owner.setdefault(i, r)
    mine = sorted(i for i, r in owner.items() if r == rank)
    missing = sorted(set(range(n_models)) - set(owner))
    return Work(rank, world, mine, share(missing, rank, world))


def exchange(
    payload: Mapping[int, T], error: BaseException | None, *, world: int, stage: str
) -> dict[int, T]:
    """Every rank's ``payload`` (model index -> what this rank computed for it), merged.

    Ranks agree on success at the same time: where ``stage`` failed on a rank (``error`` set
    there), that rank re-raises its error and every other rank raises a RuntimeError naming
    the first rank that failed and its error, so that no rank goes on alone into a later
    collective. In one process ``error`` is re-raised and ``payload`` returned.
    """
    if world == 1:
        if error is not None:
            raise error
        return dict(payload)
    mine = (f"{type(error).__name__}: {error}", {}) if error is not None else (None, payload)
    parts = every_rank(mine, world)
    if error is not None:
        raise error
    for r, (failure, _) in enumerate(parts):
        if failure is not None:
            raise RuntimeError(f"privmon: {stage} failed on rank {r}: {failure}")
    merged: dict[int, T] = {}
    for _, part in parts:
        merged.update(part)
    return merged
