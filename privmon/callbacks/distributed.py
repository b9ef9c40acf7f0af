"""torch.distributed glue for the monitor: every rank audits its shard, the scores are gathered
so every rank computes the same figures as one process holding all audit records would, and only
rank 0 writes.

A collective returns only once every rank has joined it, and gloo aborts the process when ranks
hand it tensors of different dtypes or shapes. So ranks agree before they exchange scores (on
the step, the monitor's settings, and each query's dtype and trailing shape: scores of different
steps would otherwise mix silently) and after every stage each of them ran alone, which may have
failed on one rank only: a failure anywhere then fails that stage on every rank, and all of them
leave the check together instead of one waiting in the next collective until the process group
times out.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from privmon._process_group import collective_device, every_rank, rank_and_world
from privmon.estimators.estimates import describe_error
from privmon.queries.base import score_shape

__all__ = [
    "Agreement",
    "RankFailure",
    "StepDisagreement",
    "agree",
    "agree_on_outcomes",
    "agree_on_schedule",
    "agree_on_scores",
    "agreed_stage",
    "gather_scores",
]

logger = logging.getLogger("privmon")

Scores = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
Layout = tuple[str, tuple[int, ...]]  # a side's scores: dtype and trailing shape


class RankFailure(RuntimeError):
    """A stage of the check failed on another rank, or the ranks disagree: every rank raises it
    (a rank where the stage itself failed raises its own error instead)."""


class StepDisagreement(RankFailure):
    """The ranks are in checks of different steps (``steps``: one per rank)."""

    def __init__(self, steps: Sequence[int]) -> None:
        self.steps = list(steps)
        at = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(self.steps))
        super().__init__(
            f"privmon: the ranks are in checks of different steps ({at}; a monitor state "
            "restored on some ranks only?): the check is skipped on every rank rather than mix "
            "their scores"
        )


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on before exchanging one check's scores."""

    rows: dict[str, tuple[list[int], list[int]]]
    """Per query to exchange: its member rows and its non-member rows on each rank."""
    layouts: dict[str, tuple[Layout, Layout]]
    """Per query to exchange: its members' and non-members' dtype and trailing shape (a rank
    with no rows on a side takes them from the others)."""
    left_out: dict[str, str]
    """Per query no rank exchanges: why."""
    spent: int
    """The most certified checks any rank has run: every rank goes on from there."""


def agree(error: BaseException | None, *, stage: str, flags: Sequence[bool] = ()) -> list[bool]:
    """Ranks agree on a stage each ran alone, so that none enters the next collective alone.

    Raises on every rank when ``stage`` failed on any (``error`` set there): that rank re-raises
    its ``error``, the others raise a :class:`RankFailure` naming the first rank that failed and
    its error. Otherwise returns, for each of ``flags`` (the same number on every rank), whether
    it is True on any rank. One all-reduce of a few integers; a second collective carries the
    error's message only when a stage failed. Outside a process group: ``error`` is re-raised,
    ``flags`` returned as they are.
    """
    _, world = rank_and_world()
    if world == 1:
        if error is not None:
            raise error
        return [bool(f) for f in flags]
    dist = torch.distributed
    # one MAX all-reduce: world - rank marks a failure, so its maximum names the first rank
    rank = dist.get_rank()
    local = torch.tensor(
        [world - rank if error is not None else 0, *flags],
        dtype=torch.int64,
        device=collective_device(),
    )
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    agreed = local.tolist()
    if agreed[0]:
        first = world - agreed[0]
        message = [None if error is None else describe_error(error)]
        dist.broadcast_object_list(message, src=first)
        if error is not None:
            raise error
        raise RankFailure(f"privmon: {stage} failed on rank {first}: {message[0]}")
    return [bool(f) for f in agreed[1:]]


@contextmanager
def agreed_stage(stage: str, flags: list[bool] | None = None) -> Iterator[list[bool]]:
    """A stage of the check each rank runs alone, then :func:`agree` on: an exception in the
    ``with`` block is raised after the ranks agreed, on every rank (there as a
    :class:`RankFailure`). ``flags`` (one list of the same length on every rank) is what the
    block yields; set its entries there, and after the block each holds whether it is True on
    any rank."""
    flags = [] if flags is None else flags
    error = None
    try:
        yield flags
    except Exception as err:
        error = err
    flags[:] = agree(error, stage=stage, flags=flags)


def agree_on_outcomes(
    error: BaseException | None, outcomes: Mapping[str, str], *, stage: str
) -> dict[str, str]:
    """:func:`agree` on a stage run per item (e.g. each query's analysis), and on each item's
    outcome: ``outcomes`` maps every item, the same ones in the same order on every rank, to
    what went wrong with it on this rank ("" for nothing). Returns the items whose outcome
    differs between ranks, with the reason (logged): the caller leaves them out on every rank,
    as they would otherwise give different figures on different ranks."""
    names = list(outcomes)
    flagged = agree(error, stage=stage, flags=[bool(outcomes[n]) for n in names])
    if rank_and_world()[1] == 1 or not any(flagged):  # any() is the same on every rank
        return {}
    every = every_rank([outcomes[n] for n in names], rank_and_world()[1])
    reasons = {}
    for i, name in enumerate(names):
        seen = [rank_outcomes[i] for rank_outcomes in every]
        if len(set(seen)) > 1:
            failed = "; ".join(f"failed on rank {r}: {o}" for r, o in enumerate(seen) if o)
            reasons[name] = f"its outcome differs between ranks ({failed})"
            logger.error("privmon: %r is left out on every rank: %s", name, reasons[name])
    return reasons


def _layout(scores: tuple[torch.Tensor, torch.Tensor]) -> tuple[Layout | None, ...]:
    """Per side, the scores' dtype and trailing shape; None for a side with no rows (an empty
    shard), which takes the other ranks'."""
    return tuple(
        None if t.shape[0] == 0 else (str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))
        for t in scores
    )


def _show(layout: tuple[Layout | None, ...]) -> str:
    def side(what: str, found: Layout | None) -> str:
        return f"{what} none" if found is None else f"{what} {found[0]} {score_shape(found[1])}"

    return f"{side('members', layout[0])}, {side('non-members', layout[1])}"


def agree_on_schedule(every_n_steps: int, *, strict: bool) -> int:
    """The check schedule every rank follows, agreed at the first ``step()`` (one all-gather of
    an integer): each rank decides alone whether a step is due, so ranks with different
    ``every_n_steps`` would enter checks the others never enter. On a mismatch every rank takes
    rank 0's, said as an error and a warning; ``strict``: every rank raises a
    :class:`RankFailure`."""
    every = every_rank(every_n_steps, rank_and_world()[1])
    if len(set(every)) == 1:
        return every_n_steps
    shown = ", ".join(f"rank {r}: {e}" for r, e in enumerate(every))
    message = f"privmon: the ranks' monitors check on different schedules (every_n_steps: {shown})"
    if strict:
        raise RankFailure(message)
    message += f": every rank checks every {every[0]} steps, as rank 0 does"
    logger.error(message)
    warnings.warn(message, UserWarning, stacklevel=3)
    return int(every[0])


def agree_on_scores(
    step: int,
    *,
    names: Sequence[str],
    settings: str,
    spent: int,
    error: BaseException | None,
    scores: Scores,
    failed: Mapping[str, str],
    strict: bool,
) -> Agreement:
    """Before any scores move, ranks exchange a small descriptor each (one all-gather): the step,
    the query names and the monitor's ``settings`` (whatever changes the figures), the certified
    checks ``spent``, whether collecting the scores failed (``error``), and per query its error
    (``failed``) or its scores' dtype, trailing shape and rows.

    Raises on every rank when the collection failed on any (that rank its own ``error``), when
    the names or settings differ, (:class:`StepDisagreement`) when the steps differ, and when
    no rank has a member or a non-member. A query that failed on any rank, or whose scores
    differ in dtype or trailing shape between ranks, is left out on every rank (logged), or with
    ``strict`` raises on every rank. A rank with no rows on a side (an empty shard) contributes
    none and takes the others' dtype and shape.
    """
    mine: dict[str, Any] = {
        "step": step,
        "setup": (list(names), settings),
        "spent": spent,
        "error": None if error is None else describe_error(error),
        "failed": dict(failed),
        "layout": {n: _layout(s) for n, s in scores.items()},
        "rows": {n: (s[0].shape[0], s[1].shape[0]) for n, s in scores.items()},
    }
    ranks = every_rank(mine, rank_and_world()[1])
    if error is not None:
        raise error
    for r, other in enumerate(ranks):
        if other["error"] is not None:
            raise RankFailure(
                f"privmon: collecting the scores failed on rank {r}: {other['error']}"
            )
    if any(other["setup"] != mine["setup"] for other in ranks):
        setups = "; ".join(f"rank {r}: {other['setup']}" for r, other in enumerate(ranks))
        raise RankFailure(f"privmon: the ranks' monitors are set up differently ({setups})")
    steps = [other["step"] for other in ranks]
    if len(set(steps)) > 1:
        raise StepDisagreement(steps)
    rows, left_out, agreed = {}, {}, {}
    for name in names:
        errors = [
            (r, other["failed"][name]) for r, other in enumerate(ranks) if name in other["failed"]
        ]
        if errors:  # the same reason on every rank, as every rank's report is the same
            left_out[name] = f"failed on rank {errors[0][0]}: {errors[0][1]}"
            if name not in failed:  # the rank where it failed logged it
                logger.error(
                    "privmon: query %r is left out on every rank: %s", name, left_out[name]
                )
            continue
        layouts = [other["layout"][name] for other in ranks]
        sides = [{layout[i] for layout in layouts if layout[i] is not None} for i in (0, 1)]
        if any(len(found) > 1 for found in sides):
            shown = "; ".join(f"rank {r}: {_show(layout)}" for r, layout in enumerate(layouts))
            reason = f"its scores differ in dtype or shape between ranks ({shown})"
            if strict:
                raise RankFailure(f"privmon: query {name!r}: {reason}")
            logger.error("privmon: query %r is left out on every rank: %s", name, reason)
            left_out[name] = reason
            continue
        if not all(sides):
            raise ValueError(
                "members and nonmembers must each yield at least one batch (on some rank)"
            )
        agreed[name] = (sides[0].pop(), sides[1].pop())
        rows[name] = (
            [other["rows"][name][0] for other in ranks],
            [other["rows"][name][1] for other in ranks],
        )
    spents = [other["spent"] for other in ranks]
    if len(set(spents)) > 1:
        logger.warning(
            "privmon: the ranks had run different numbers of certified checks (%s; a monitor "
            "state restored on some ranks only?): every rank goes on from %d",
            ", ".join(f"rank {r}: {s}" for r, s in enumerate(spents)),
            max(spents),
        )
    return Agreement(rows=rows, layouts=agreed, left_out=left_out, spent=max(spents))


def gather_scores(
    scores: Scores, agreed: Agreement
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's rows of each query in ``agreed.rows``, concatenated in rank order (shards
    may differ in length, an empty one has none; ``agreed`` comes from
    :func:`agree_on_scores`).

    The buffers are allocated before the first exchange, and the results assembled after the
    last, and ranks :func:`agree` on both: a rank that runs out of memory there fails the check
    on every rank instead of leaving them in a collective.
    """
    dist = torch.distributed
    world = dist.get_world_size()
    dev = collective_device()
    buffers: list[tuple[list[int], torch.Tensor, list[torch.Tensor]]] = []
    error = None
    try:
        for name, sides in agreed.rows.items():
            layouts = agreed.layouts[name]
            for local, counts, (dtype, trailing) in zip(scores[name], sides, layouts, strict=True):
                padded = torch.zeros(
                    (max(counts), *trailing), dtype=getattr(torch, dtype), device=dev
                )
                padded[: local.shape[0]] = local
                buffers.append((counts, padded, [torch.empty_like(padded) for _ in range(world)]))
    except Exception as err:
        error = err
    agree(error, stage="gathering the scores")
    for _, padded, parts in buffers:
        dist.all_gather(parts, padded)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        whole = []
        while buffers:  # each buffer is dropped once its rows are assembled
            counts, _, parts = buffers.pop(0)
            whole.append(torch.cat([p[:k] for p, k in zip(parts, counts, strict=True)]))
        for i, name in enumerate(agreed.rows):
            mem, non = scores[name]
            out[name] = (whole[2 * i].to(mem.device), whole[2 * i + 1].to(non.device))
    except Exception as err:
        error = err
    agree(error, stage="gathering the scores")
    return out
