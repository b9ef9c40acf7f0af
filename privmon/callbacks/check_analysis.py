"""One check's analysis: ε read from the accountant, each query's figures
(:func:`~privmon.estimators.analysis.analyse`) at the check's share of δ, the canaries' one-run
ε lower bounds (:mod:`~privmon.callbacks.canary_audit`) and their DP mechanism checks
(:mod:`~privmon.callbacks.mechanism_audit`, every rank's findings combined, decided at the
alarm's own level). A query or a
canaries object failing is logged and skips only that part (``strict``: raised). A pure step:
under torch.distributed it runs once per check, on rank 0, on every rank's scores.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from privmon._failure import Failure
from privmon.bounds import epsilon_from_opacus
from privmon.callbacks.canary_audit import CanaryAudits, CanarySource, canary_figures
from privmon.callbacks.mechanism_audit import DP_CHECKS, Local, mechanism_figures
from privmon.estimators.analysis import QueryResult, analyse
from privmon.report.build import CanaryFigures

__all__ = ["CheckAnalysis", "analyse_check"]

logger = logging.getLogger("privmon")


@dataclass(frozen=True)
class CheckAnalysis:
    """What :func:`analyse_check` found."""

    epsilon: float | None
    """ε from the accountant (None without one)."""
    certify_delta: float
    """The δ each certified figure of the check holds at."""
    results: dict[str, QueryResult | Failure]
    """Per query, in the monitor's order: its figures, or why it failed."""
    canaries: dict[str, CanaryFigures | Failure]
    """Per part of the canaries' audit (each object's one-run bounds, the mechanism checks),
    its figures or why it failed; empty without canaries."""


def _analysed(
    query: Any, scores: tuple[torch.Tensor, torch.Tensor], *, strict: bool, options: dict
) -> QueryResult | Failure:
    """One query's figures, or why its analysis failed (logged; re-raised when strict)."""
    try:
        result = analyse(
            *scores,
            discrete=getattr(query, "discrete", False),
            higher_is_member=getattr(query, "higher_is_member", None),
            name=query.name,
            errors="raise" if strict else "skip",
            **options,
        )
    except Exception as err:
        if strict:
            raise
        logger.exception("privmon: the analysis of query %r failed", query.name)
        return Failure.of(err)
    for what, error in result.failures.items():
        logger.error("privmon: %s of query %r failed: %s", what, query.name, error)
    return result


def _audited(
    source: CanarySource, *, step: int, strict: bool, **options: Any
) -> CanaryFigures | Failure:
    """One canaries object's one-run bounds at this check, or why its scores or bounds failed
    (logged; re-raised when strict)."""
    try:
        in_scores, out_scores = source.canaries.scores()
        return canary_figures(in_scores, out_scores, step=step, source=source.tag_source, **options)
    except Exception as err:
        if strict:
            raise
        if source.tag_source is None:
            logger.exception("privmon: the canary audit failed at step %s", step)
        else:
            logger.exception("privmon: the canary audit of %r failed at step %s", source.name, step)
        return Failure.of(err)


def analyse_check(
    step: int,
    *,
    queries: Sequence[Any],
    scores: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    failed: Mapping[str, Failure],
    certify_delta: float,
    alarm_delta: float,
    methods: Sequence[str],
    prior: float,
    interval_delta: float,
    top_k: int,
    accountant: Any,
    delta: float,
    canaries: CanaryAudits,
    findings: Sequence[Local],
    strict: bool,
) -> CheckAnalysis:
    """The analysis of the check at ``step``: ε from ``accountant`` at ``delta``, each query's
    figures from its ``scores`` (queries in ``failed`` left out, with why), certified at
    ``certify_delta``, the ``canaries``' bounds, and the mechanism checks' ``findings`` (each
    rank's, in rank order), their statistical tests decided at ``alarm_delta``. Raises when
    reading ε fails, or a part fails with ``strict``."""
    eps = None if accountant is None else float(epsilon_from_opacus(accountant, delta=delta))
    options = dict(
        methods=methods,
        prior=prior,
        delta=interval_delta,
        certify_delta=certify_delta,
        top_k=top_k,
    )
    results: dict[str, QueryResult | Failure] = {
        q.name: failed.get(q.name) or _analysed(q, scores[q.name], strict=strict, options=options)
        for q in queries
    }
    parts: dict[str, CanaryFigures | Failure] = {
        s.key: _audited(
            s, step=step, strict=strict, delta=delta, significance=certify_delta, epsilon=eps
        )
        for s in canaries.sources
        if s.scores
    }
    if findings and findings[0]:  # every rank has the same objects with mechanism()
        figures, failures = mechanism_figures(findings, alarm_delta=alarm_delta, step=step)
        if figures is not None:
            parts[DP_CHECKS] = figures
        parts.update(failures)
    return CheckAnalysis(epsilon=eps, certify_delta=certify_delta, results=results, canaries=parts)
