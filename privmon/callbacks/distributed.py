"""The ranks of a torch.distributed group in one check: each rank collects alone, then ONE
exchange carries what each collected — a small :class:`Header` (one all-gather of objects,
:func:`agree_on_headers` reading it the same way on every rank), then the scores themselves
(:func:`~privmon.callbacks.score_exchange.gather_scores`, one tensor collective to rank 0) —
rank 0 alone analyses, and one broadcast shares the outcome. A rank never enters a collective
the others skip: whatever one rank found (its collection failed, it had already checked the
step, the setups or steps differ, a query's scores differ in dtype or shape) is in the headers,
so every rank decides the same from them. The check schedule is agreed once, at the first
``step()`` (:func:`agree_on_schedule`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from privmon._failure import Failure
from privmon._process_group import every_rank, rank_and_world
from privmon.callbacks.mechanism_audit import Local
from privmon.queries.base import score_shape

__all__ = [
    "Agreement",
    "Header",
    "Layout",
    "RankFailure",
    "StageFailure",
    "StepDisagreement",
    "agree_on_headers",
    "agree_on_schedule",
    "failed_stage",
    "layout_of",
]

logger = logging.getLogger("privmon")

Layout = tuple[str, tuple[int, ...]]
"""A side's scores: dtype name and trailing shape."""


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
class StageFailure:
    """A stage of a check that failed on one rank: the others raise :meth:`error`."""

    stage: str
    rank: int
    failure: Failure

    def error(self) -> RankFailure:
        """What the ranks where the stage did not fail raise."""
        return RankFailure(
            f"privmon: {self.stage} failed on rank {self.rank}: {self.failure.reason}"
        )


@dataclass(frozen=True)
class Header:
    """What one rank tells the others before any score moves."""

    step: int
    setup: tuple[list[str], str]
    """The query names and the monitor's settings (whatever changes the figures)."""
    spent: int
    """The certified checks this rank has run."""
    checked: bool
    """Whether this rank had already checked this step (every rank then skips it)."""
    error: StageFailure | None
    """Collecting failed on this rank (nothing else here then counts)."""
    failed: dict[str, Failure]
    """Per query left out on this rank: why."""
    layouts: dict[str, tuple[Layout | None, Layout | None]]
    """Per query scored: each side's layout (None: no rows on this rank)."""
    rows: dict[str, tuple[int, int]]
    """Per query scored: its member and non-member rows on this rank."""
    findings: Local
    """This rank's DP mechanism checks' findings."""
    forward: float
    """Seconds this rank spent in the queries."""
    sent: dict[str, tuple[int, int]]
    """Per query scored, in the order this rank sends them: the bytes of each side."""
    traces: tuple[int, int, int, int] | None = None
    """What this rank sends after the scores of its loop's loss traces (stride, steps, dropped
    losses, bytes); None: none."""


@dataclass(frozen=True)
class Agreement:
    """What every rank reads the same from the headers."""

    rows: dict[str, tuple[list[int], list[int]]]
    """Per query to exchange: its member rows and its non-member rows on each rank."""
    layouts: dict[str, tuple[Layout, Layout]]
    """Per query to exchange: its members' and non-members' layout."""
    left_out: dict[str, Failure]
    """Per query no rank exchanges: why."""
    spent: int
    """The most certified checks any rank has run: every rank goes on from there."""
    forward: float
    """The longest any rank spent in the queries."""
    findings: list[Local]
    """Every rank's mechanism findings, in rank order."""
    sent: list[dict[str, tuple[int, int]]]
    """What each rank sends of its scores (:attr:`Header.sent`), in rank order."""
    gathered: Exception | None = None
    """On rank 0: why rebuilding the gathered scores failed, after the collective (the others
    already wait for its outcome, which then says so)."""
    traces: list[tuple[int, int, int, int] | None] = field(default_factory=list)
    """What each rank sends of its loop's loss traces (:attr:`Header.traces`), in rank order."""
    traces_data: tuple[torch.Tensor, ...] = ()
    """On rank 0: each rank's loss-trace bytes, in rank order."""


def layout_of(scores: tuple[torch.Tensor, torch.Tensor]) -> tuple[Layout | None, Layout | None]:
    """Per side, the scores' dtype and trailing shape; None for a side with no rows (an empty
    shard), which takes the other ranks'."""
    member, nonmember = (
        None if t.shape[0] == 0 else (str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))
        for t in scores
    )
    return member, nonmember


def _show(layout: tuple[Layout | None, Layout | None]) -> str:
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


def agree_on_headers(
    headers: Sequence[Header], *, mine: Header, error: BaseException | None, strict: bool
) -> Agreement | None:
    """Every rank's headers (``mine`` this rank's, ``error`` what its collection raised) read
    the same on every rank: None when a rank had already checked the step (every rank skips
    it). Raises on every rank when collecting failed on any (that rank its own ``error``, the
    others a :class:`RankFailure` naming it), when the setups differ, (:class:`StepDisagreement`)
    when the steps differ, and when no rank has a member or a non-member. A query that failed
    on any rank, or whose scores differ in dtype or trailing shape between ranks, is left out on
    every rank (logged), or with ``strict`` raises on every rank. A rank with no rows on a side
    (an empty shard) contributes none and takes the others' layout."""
    if any(h.checked for h in headers):
        return None
    if error is not None:
        raise error
    failed = next((h.error for h in headers if h.error is not None), None)
    if failed is not None:
        raise failed.error()
    if any(h.setup != mine.setup for h in headers):
        setups = "; ".join(f"rank {r}: {h.setup}" for r, h in enumerate(headers))
        raise RankFailure(f"privmon: the ranks' monitors are set up differently ({setups})")
    steps = [h.step for h in headers]
    if len(set(steps)) > 1:
        raise StepDisagreement(steps)
    left_out, layouts = _queries_agreed(headers, mine=mine, strict=strict)
    spents = [h.spent for h in headers]
    if len(set(spents)) > 1:
        logger.warning(
            "privmon: the ranks had run different numbers of certified checks (%s; a monitor "
            "state restored on some ranks only?): every rank goes on from %d",
            ", ".join(f"rank {r}: {s}" for r, s in enumerate(spents)),
            max(spents),
        )
    return Agreement(
        rows={
            name: ([h.rows[name][0] for h in headers], [h.rows[name][1] for h in headers])
            for name in layouts
        },
        layouts=layouts,
        left_out=left_out,
        spent=max(spents),
        forward=max(h.forward for h in headers),
        findings=[h.findings for h in headers],
        sent=[h.sent for h in headers],
        traces=[h.traces for h in headers],
    )


def _queries_agreed(
    headers: Sequence[Header], *, mine: Header, strict: bool
) -> tuple[dict[str, Failure], dict[str, tuple[Layout, Layout]]]:
    """Per query: why it is left out on every rank (it failed on some rank: the first one's
    reason; or its layouts differ), or the layout every rank's scores have."""
    left_out: dict[str, Failure] = {}
    agreed: dict[str, tuple[Layout, Layout]] = {}
    for name in mine.setup[0]:
        errors = [(r, h.failed[name]) for r, h in enumerate(headers) if name in h.failed]
        if errors:  # the same reason on every rank, as every rank's report is the same
            left_out[name] = errors[0][1].on_rank(errors[0][0])
            if name not in mine.failed:  # the rank where it failed logged it
                logger.error(
                    "privmon: query %r is left out on every rank: %s", name, left_out[name].reason
                )
            continue
        found = _layout_agreed(name, [h.layouts[name] for h in headers], strict=strict)
        if isinstance(found, Failure):
            left_out[name] = found
        else:
            agreed[name] = found
    return left_out, agreed


def _layout_agreed(
    name: str, layouts: Sequence[tuple[Layout | None, Layout | None]], *, strict: bool
) -> tuple[Layout, Layout] | Failure:
    """The layout of ``name``'s scores on every rank with rows, or why they differ (logged;
    raised when strict)."""
    sides = [{found for found in (layout[i] for layout in layouts) if found} for i in (0, 1)]
    if any(len(found) > 1 for found in sides):
        shown = "; ".join(f"rank {r}: {_show(layout)}" for r, layout in enumerate(layouts))
        reason = f"its scores differ in dtype or shape between ranks ({shown})"
        if strict:
            raise RankFailure(f"privmon: query {name!r}: {reason}")
        logger.error("privmon: query %r is left out on every rank: %s", name, reason)
        return Failure(reason)
    if not all(sides):
        raise ValueError("members and nonmembers must each yield at least one batch (on some rank)")
    return sides[0].pop(), sides[1].pop()


def failed_stage(stage: str, error: BaseException) -> StageFailure:
    """``stage`` failed on this rank with ``error``, as the other ranks are told."""
    return StageFailure(stage, rank_and_world()[0], Failure.of(error))
