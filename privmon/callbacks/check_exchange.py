"""One check's collection and exchange: this rank's part — its queries' scores
(:class:`~privmon.callbacks.check_scores.CheckScores`), its DP mechanism checks' findings
(:func:`~privmon.callbacks.mechanism_audit.findings_of`) and what failed — and, under
torch.distributed, the check's one exchange: every rank's :class:`~privmon.callbacks.distributed.
Header` (one all-gather of small objects, read the same on every rank) and the scores gathered
on rank 0 (:func:`~privmon.callbacks.score_exchange.gather_scores`, one tensor collective).
Outside a process group nothing is exchanged, nor pickled."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from privmon._failure import Failure
from privmon._process_group import every_rank, rank_and_world
from privmon.callbacks.canary_audit import CanaryAudits
from privmon.callbacks.check_scores import CheckScores
from privmon.callbacks.collection import Collected, Scores
from privmon.callbacks.distributed import (
    Agreement,
    Header,
    agree_on_headers,
    failed_stage,
    layout_of,
)
from privmon.callbacks.loss_tracking import LossTracing, TracesSent
from privmon.callbacks.mechanism_audit import Local, findings_of
from privmon.callbacks.score_exchange import Packed, gather_scores, packed

__all__ = ["exchange"]

logger = logging.getLogger("privmon")

_NOTHING = Collected(scores={}, failed={}, forward=0.0, digests=None)


def _collected(
    step: int, *, scores: CheckScores, audits: CanaryAudits, accountant: Any, strict: bool
) -> tuple[Collected, Local, Exception | None, str]:
    """This rank's scores, its DP mechanism findings, and what failed with the stage's name:
    with canaries (not strict) a failed collection leaves every query out, logged, and the
    check goes on (the canaries need no audit set)."""
    try:
        collected = scores.collect()
    except Exception as err:
        if not audits or strict:
            return _NOTHING, {}, err, "collecting the scores"
        logger.exception("privmon: collecting the scores failed at step %s", step)
        failed = {q.name: Failure.of(err) for q in scores.queries}
        collected = Collected(scores={}, failed=failed, forward=0.0, digests=None)
    try:
        findings = findings_of(
            audits.sources, accountant=accountant, step=step, strict=strict, said=audits.said
        )
    except Exception as err:
        return collected, {}, err, "the DP mechanism checks"
    return collected, findings, None, ""


def _packed(
    collected: Collected, traces: LossTracing | None
) -> tuple[tuple[Packed, TracesSent | None] | None, Exception | None]:
    """This rank's scores and loop loss traces as the bytes it sends, and what it sends of the
    traces; or why they could not be packed."""
    try:
        sent, data = (None, None) if traces is None else traces.outgoing()
        return (packed(collected.scores, data), sent), None
    except Exception as err:  # e.g. out of memory on the collective device
        return None, err


def exchange(
    step: int,
    *,
    checked: bool,
    scores: CheckScores,
    audits: CanaryAudits,
    accountant: Any,
    spent: int,
    settings: str,
    strict: bool,
    traces: LossTracing | None = None,
) -> tuple[Agreement, Scores] | None:
    """This rank's part of the check at ``step`` (none when it ``checked`` the step already)
    and, under torch.distributed, every rank's agreed on (None: a rank had checked the step,
    and every rank skips it) with the scores on rank 0 (the others get none); one process: its
    own, with no collective. Raises where the check must fail on every rank
    (:func:`~privmon.callbacks.distributed.agree_on_headers`); ``spent``: this rank's
    certified checks, ``settings``: whatever changes the figures; ``traces``: the monitor's
    loss traces, whose loop losses go to rank 0 with the scores (there in
    ``Agreement.traces_data``)."""
    local, findings, error, stage = (
        (_NOTHING, {}, None, "")
        if checked
        else _collected(step, scores=scores, audits=audits, accountant=accountant, strict=strict)
    )
    world = rank_and_world()[1]
    if world == 1:
        if error is not None:
            raise error
        alone = Agreement({}, {}, dict(local.failed), spent, local.forward, [findings], [])
        return alone, local.scores
    mine, failed = _packed(local, traces) if error is None else (None, None)
    if failed is not None:
        local, error, stage = _NOTHING, failed, "collecting the scores"
    header = Header(
        step=step,
        setup=([q.name for q in scores.queries], settings),
        spent=spent,
        checked=checked,
        error=None if error is None else failed_stage(stage, error),
        failed=dict(local.failed),
        layouts={n: layout_of(s) for n, s in local.scores.items()},
        rows={n: (s[0].shape[0], s[1].shape[0]) for n, s in local.scores.items()},
        findings=findings,
        forward=local.forward,
        sent={} if mine is None else mine[0][1],
        traces=None if mine is None else mine[1],
    )
    agreed = agree_on_headers(every_rank(header, world), mine=header, error=error, strict=strict)
    if agreed is None:
        return None
    assert mine is not None  # the agreement raises where a rank failed
    gathered, data, failed = gather_scores(mine[0][0], agreed, like=local.scores)
    if failed is not None:  # rank 0 only: its outcome says so to the others
        return dataclasses.replace(agreed, gathered=failed), {}
    return dataclasses.replace(agreed, traces_data=tuple(data)), gathered or {}
