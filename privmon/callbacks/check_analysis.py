"""One check's analysis: ε read from the accountant, each query's figures
(:func:`~privmon.estimators.analysis.analyse`) at the check's share of δ, the canaries' one-run
ε lower bounds (:mod:`~privmon.callbacks.canary_audit`) and their DP mechanism checks
(:mod:`~privmon.callbacks.mechanism_audit`). A query or a canaries object failing is logged and
skips only that part (``strict``: raised). Under torch.distributed every rank runs it on the same
gathered scores, then the ranks agree on each part's outcome
(:func:`~privmon.callbacks.distributed.agree_on_outcomes`): a part that fared differently on
different ranks is left out on all of them; the mechanism checks' findings are combined over
the ranks instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from privmon.bounds import epsilon_from_opacus
from privmon.callbacks.canary_audit import CanaryAudits, CanarySource, canary_figures
from privmon.callbacks.distributed import agree_on_outcomes
from privmon.callbacks.mechanism_audit import DP_CHECKS, Local, findings_of, mechanism_figures
from privmon.estimators.analysis import QueryResult, analyse
from privmon.estimators.estimates import describe_error
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
    results: dict[str, QueryResult | str]
    """Per query, in the monitor's order: its figures, or why it failed."""
    canaries: dict[str, CanaryFigures | str]
    """Per part of the canaries' audit (each object's one-run bounds, the mechanism checks),
    its figures or why it failed; empty without canaries."""


def _analysed(query: Any, scores: tuple[torch.Tensor, torch.Tensor], *, strict: bool, **options):
    """One query's figures, or the error (a string) when its analysis failed (logged;
    re-raised when strict)."""
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
        return describe_error(err)
    for what, error in result.failures.items():
        logger.error("privmon: %s of query %r failed: %s", what, query.name, error)
    return result


def _audited(
    source: CanarySource, *, step: int, strict: bool, **options: Any
) -> CanaryFigures | str:
    """One canaries object's one-run bounds at this check, or the error (a string) when its
    scores or bounds failed (logged; re-raised when strict)."""
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
        return describe_error(err)


def _outcome(result: Any) -> str:
    """What went wrong with one part on this rank: its error, or its figures' failures joined
    ("" for nothing)."""
    if isinstance(result, str):
        return result
    return "; ".join(f"{what}: {e}" for what, e in getattr(result, "failures", {}).items())


def analyse_check(
    step: int,
    *,
    queries: Sequence[Any],
    scores: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    failed: dict[str, str],
    certify_delta: Callable[[], float],
    methods: Sequence[str],
    prior: float,
    interval_delta: float,
    top_k: int,
    accountant: Any,
    delta: float,
    canaries: CanaryAudits,
    strict: bool,
) -> CheckAnalysis:
    """The analysis of the check at ``step``: ε from ``accountant`` at ``delta``, each query's
    figures from its ``scores`` (queries in ``failed`` left out, with why), certified at
    ``certify_delta()``, and the ``canaries``' bounds and mechanism checks; ``failed`` gains the
    parts the ranks left out. Raises on every rank when reading ε, or the analysis as a whole,
    failed on any."""
    eps, analysed, error = None, {}, None
    audits: dict[str, CanaryFigures | str] = {
        s.key: "not computed" for s in canaries.sources if s.scores
    }
    local: Local = {}
    lower_delta = 0.0
    try:
        if accountant is not None:
            eps = float(epsilon_from_opacus(accountant, delta=delta))
        lower_delta = certify_delta()
        for q in queries:
            if q.name not in failed:
                analysed[q.name] = _analysed(
                    q,
                    scores[q.name],
                    strict=strict,
                    methods=methods,
                    prior=prior,
                    delta=interval_delta,
                    certify_delta=lower_delta,
                    top_k=top_k,
                )
        for source in canaries.sources:
            if source.scores:
                audits[source.key] = _audited(
                    source,
                    step=step,
                    strict=strict,
                    delta=delta,
                    significance=lower_delta,
                    epsilon=eps,
                )
        local = findings_of(
            canaries.sources, accountant=accountant, step=step, strict=strict, said=canaries.said
        )
    except Exception as err:
        error = err
    # what failed on this rank ("" for nothing), per query still in, and each object's bounds
    outcomes = {q.name: _outcome(analysed.get(q.name, "")) for q in queries if q.name not in failed}
    outcomes.update({key: a if isinstance(a, str) else "" for key, a in audits.items()})
    failed.update(agree_on_outcomes(error, outcomes, stage="reading ε or the analysis"))
    parts = {key: failed.get(key) or audit for key, audit in audits.items()}
    if local:  # every rank has the same objects with mechanism(), and got here
        figures, failures = mechanism_figures(local, delta=lower_delta, step=step)
        if figures is not None:
            parts[DP_CHECKS] = figures
        parts.update(failures)
    return CheckAnalysis(
        epsilon=eps,
        certify_delta=lower_delta,
        results={q.name: failed.get(q.name) or analysed[q.name] for q in queries},
        canaries=parts,
    )
