"""Everything one check reports for one query, as one pure function: :func:`analyse`.

The monitor calls it once per query and check (as ``torchmetrics.Metric.compute`` calls its
functional twin); offline users call it on saved scores. It is the estimators' one pipeline:
the scores enter each stage of :mod:`~privmon.estimators.stages` once — keep the finite rows,
bin, smooth, the plug-ins and each method's rule and certificate, the ROC (1-D), the
per-record risks (1-2 D) — and leave for the next. Every advantage and ROC figure equals the
one the public function of its module gives on the same scores
(:func:`~privmon.optimal_advantage`, :func:`~privmon.roc_summary`), to rounding; the per-record
risks are cross-fitted, out of sample.

Stage by stage: Theory, *One check's analysis, stage by stage*.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from privmon._validation import check_int, check_open_unit, check_subset
from privmon.estimators.estimates import AdvantageEstimate, describe_error
from privmon.estimators.methods import METHODS, applicable_methods, registered_methods
from privmon.estimators.risk import most_exposed, record_signed_risk, risk_summary, tied_beyond
from privmon.estimators.roc import summary_from_ascending
from privmon.estimators.rules import RuleDensities
from privmon.estimators.stages import (
    Binned,
    EstimatorOptions,
    FiniteScores,
    bin_scores,
    estimate_advantages,
    finite_scores,
)

__all__ = ["ESTIMATE_FIELDS", "QueryResult", "analyse"]

# the figures of each method's estimate that a check reports, with their scalar names
ESTIMATE_FIELDS = {
    "value": "value",
    "lower": "lower",
    "lower_check": "lower_check",
    "plugin": "plugin",
    "upper": "plugin_upper",
}

# a check's estimators: each method's default grid, Scott's KDE bandwidth, 4 folds
_OPTIONS = EstimatorOptions()


@dataclass(frozen=True)
class QueryResult:
    """What one query revealed at one check (:func:`analyse`).

    ``estimates``: method -> :class:`~privmon.estimators.estimates.AdvantageEstimate`, for the
    methods that succeeded. ``roc`` (1-D): AUC, ``tpr@fpr=…`` and accuracy at the median.
    ``risk`` (1-2 D): quantiles, max and counts above levels of the members' risks |f_p|.
    ``member_risk`` / ``member_posterior`` / ``nonmember_posterior``: per record, in the order
    given (NaN for dropped records). ``top_records``: member indices, most exposed first (the
    highest membership posterior: the likeliest members), with their posteriors (Song &
    Mittal's privacy risk score) in ``top_risks``; ``top_tied`` more members share the last
    one's posterior (posteriors read off shared cells tie: the order among tied records is by
    index, not a ranking).
    ``failures``: what could not be computed (a method, "roc" or "risk") -> the error.
    Arrays are dropped from results kept in a monitor's history.

    Examples:
        >>> import torch
        >>> from privmon import analyse
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> result = analyse(members, torch.randn(500, generator=gen), name="loss")
        >>> sorted(result.estimates), result.member_risk.shape
        (['histogram', 'kde'], (500,))
        >>> {tag: round(v, 3) for tag, v in result.scalars().items() if tag.startswith("kde/")}
        {'kde/value': 0.22, 'kde/lower': 0.17, 'kde/lower_check': 0.17, 'kde/plugin': 0.217,
         'kde/plugin_upper': 0.303}
    """

    name: str
    estimates: dict[str, AdvantageEstimate]
    dim: int
    n_dropped: int
    roc: dict[str, float] = field(default_factory=dict)
    risk: dict[str, float] = field(default_factory=dict)
    member_risk: np.ndarray | None = None
    member_posterior: np.ndarray | None = None
    nonmember_posterior: np.ndarray | None = None
    top_records: tuple[int, ...] = ()
    top_risks: tuple[float, ...] = ()
    top_tied: int = 0
    failures: dict[str, str] = field(default_factory=dict)

    def without_arrays(self) -> QueryResult:
        """A copy without the per-record arrays (risks and posteriors): what a history keeps."""
        return dataclasses.replace(
            self, member_risk=None, member_posterior=None, nonmember_posterior=None
        )

    def scalars(self) -> dict[str, float]:
        """The figures as flat ``name -> float`` tags relative to the query (``kde/lower``,
        ``auc``, ``risk/q50``, ``n_dropped`` …), as the monitor logs them under
        ``privacy/<query>/``."""
        out: dict[str, float] = {}
        for method, est in self.estimates.items():
            for attr, tag in ESTIMATE_FIELDS.items():
                out[f"{method}/{tag}"] = getattr(est, attr)
        out.update(self.roc)
        out.update({f"risk/{k}": v for k, v in self.risk.items()})
        out["n_dropped"] = float(self.n_dropped)
        return out


def analyse(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    methods: Sequence[str] = METHODS,
    prior: float = 0.5,
    delta: float = 0.05,
    certify_delta: float | None = None,
    discrete: bool = False,
    higher_is_member: bool | None = None,
    top_k: int = 10,
    name: str = "query",
    errors: Literal["raise", "skip"] = "raise",
) -> QueryResult:
    """Every figure a privacy check reports for one query's scores.

    Args:
        member_scores, nonmember_scores: query outputs, (n,) or (n, d), numpy or torch on any
            device; NaN / inf rows are dropped and counted (NaN in the per-record outputs).
        methods: advantage estimators, from ("histogram", "kde") (MACE Thm 2 / Thm 3) and any
            registered (:func:`~privmon.estimators.methods.register_method`).
        prior: P(member), in (0, 1).
        delta: 1 − confidence level of ``lower_check`` and of the plug-in interval, in (0, 1).
        certify_delta: the δ each method's ``lower`` is certified at (default ``delta``); the
            monitor passes its check's share of the run's δ (:mod:`privmon.estimators.spending`).
        discrete: the scores take few values (e.g. correctness): the KDE method is skipped.
        higher_is_member: orientation of 1-D scores for the ROC figures (None: the one with
            AUC ≥ 0.5, as an attacker would pick).
        top_k: how many most exposed member indices to return, >= 0.
        name: the query's name, carried into the result.
        errors: "raise" re-raises the first failure; "skip" reports a failing method, ROC or
            risk step in ``failures`` and computes everything else.

    Returns:
        :class:`QueryResult`.

    Examples:
        >>> import torch
        >>> from privmon import analyse
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> result = analyse(members, torch.randn(500, generator=gen), methods=["histogram"])
        >>> round(result.estimates["histogram"].lower, 3), round(result.roc["auc"], 3)
        (0.17, 0.649)
        >>> len(result.top_records), round(result.risk["max"], 3)
        (10, 0.539)
    """
    methods = check_subset(methods, registered_methods(), name="methods")
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    lower_delta = (
        delta if certify_delta is None else check_open_unit(certify_delta, name="certify_delta")
    )
    if higher_is_member not in (True, False, None):
        raise ValueError(f"higher_is_member must be True, False or None, got {higher_is_member!r}")
    top_k = check_int(top_k, name="top_k")
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
    skip = errors == "skip"
    methods = applicable_methods(methods, discrete=discrete)

    scores = finite_scores(member_scores, nonmember_scores, aligned=True)  # 0. finite rows
    with torch.inference_mode():  # hundreds of small operations: no autograd bookkeeping
        binned = bin_scores(  # 1. bin
            scores, methods=methods, per_record=True, options=_OPTIONS, skip_errors=skip
        )
        advantages = estimate_advantages(  # 2-3. smooth, plug-ins, rule + certificate
            scores,
            binned,
            methods=methods,
            prior=prior,
            delta=delta,
            lower_delta=lower_delta,
            options=_OPTIONS,
            skip_errors=skip,
        )
        failures = dict(advantages.failures)
        roc = _roc_figures(  # 4. ROC
            binned, scores, higher_is_member=higher_is_member, failures=failures, skip=skip
        )
        result = QueryResult(
            name, advantages.estimates, scores.dim, scores.n_dropped, roc=roc, failures=failures
        )
        return _with_record_risks(  # 5. per-record risks
            result, binned, advantages.densities, scores, prior=prior, top_k=top_k, skip=skip
        )


def _roc_figures(
    binned: Binned,
    scores: FiniteScores,
    *,
    higher_is_member: bool | None,
    failures: dict[str, str],
    skip: bool,
) -> dict[str, float]:
    """Stage 4: the ROC figures of 1-D scores from stage 1's one sort (empty above 1-D); a
    failure is reported in ``failures`` when ``skip``."""
    if not binned.passes or binned.passes[0].records.ascending is None:
        return {}
    try:
        return summary_from_ascending(
            *binned.passes[0].records.ascending,
            scores.n_members,
            higher_is_member=higher_is_member,
        )
    except Exception as err:
        if not skip:
            raise
        failures["roc"] = describe_error(err)
        return {}


def _with_record_risks(
    result: QueryResult,
    binned: Binned,
    densities: RuleDensities | None,
    scores: FiniteScores,
    *,
    prior: float,
    top_k: int,
    skip: bool,
) -> QueryResult:
    """Stage 5: ``result`` with the per-record risks (1-2 D) read out of sample off the
    histogram rule's ``densities`` in the cells of stage 1's first pass, aligned with the
    records given (NaN for the dropped ones); a failure is reported in ``failures`` when
    ``skip``."""
    if not binned.passes:
        return result
    try:
        if densities is None:
            raise ValueError("the histogram rule that per-record risks read failed")
        signed = record_signed_risk(binned.passes[0].records, densities, prior=prior)
        if scores.kept is not None:  # back to the records given, NaN for the dropped ones
            full = np.full(scores.kept.shape[0], np.nan)
            full[scores.kept.cpu().numpy()] = signed
            signed = full
        n_mem = scores.n_given_members
        risk = np.abs(signed[:n_mem])
        posterior = (1 + signed) / 2
        member_posterior = posterior[:n_mem]
        # the most exposed are the likeliest members: |f_p| also ranks high a member the attack
        # confidently calls a non-member
        top = most_exposed(member_posterior, top_k)
        return dataclasses.replace(
            result,
            risk=risk_summary(risk),
            member_risk=risk,
            member_posterior=member_posterior,
            nonmember_posterior=posterior[n_mem:],
            top_records=top,
            top_risks=tuple(member_posterior[list(top)].tolist()),
            top_tied=tied_beyond(member_posterior, top),
        )
    except Exception as err:
        if not skip:
            raise
        return dataclasses.replace(
            result, failures={**result.failures, "risk": describe_error(err)}
        )
