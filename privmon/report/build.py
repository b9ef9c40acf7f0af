"""Building one check's :class:`~privmon.report.Report` from what the check computed: the queries'
analyses, ε from the accountant and the DP ceilings it implies, the ε lower bounds of the
certified advantages, the canaries' figures (one-run bounds, DP mechanism checks) and the
DP-violation flag with its causes, each figure named by :mod:`~privmon.report.tags`. A pure
function: the monitor logs and warns what it returns."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from privmon._failure import Failure
from privmon.bounds import epsilon_lower_bound, tanh_bound
from privmon.estimators.analysis import QueryResult
from privmon.report import tags
from privmon.report.check import Report, Vulnerable

__all__ = ["CANARIES", "CanaryFigures", "TraceFigures", "build_report", "violation_message"]

CANARIES = "canaries"
"""The canary audit's entry among a check's failures."""

_ROUNDING = 1e-12  # a certified bound above the ceiling by less than this is rounding


@dataclass(frozen=True)
class CanaryFigures:
    """What one canaries object said at one check: ``scalars`` (tag -> value), whether it found
    a DP violation (an audited ε above the accountant's, a mechanism check that fired), the
    messages saying so and their ``causes`` (one sentence each, what fired and its evidence)."""

    scalars: dict[str, float]
    violation: bool
    messages: tuple[str, ...]
    causes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class TraceFigures:
    """What the loss traces said at one check: LOSS TNR ``scalars`` (tag -> estimate), the most
    ``vulnerable`` records per source and the ``failures`` (what failed -> why)."""

    scalars: dict[str, float] = field(default_factory=dict)
    vulnerable: dict[str, Vulnerable] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def violation_message(step: int, tag: str, lower: float, ceiling: float, eps: float) -> str:
    """What a certified lower bound above the (ε, δ)-DP ceiling means."""
    return (
        f"privmon: at step {step} the certified lower bound on the membership advantage "
        f"({tag}: {lower:.4f}) exceeds the ceiling {ceiling:.4f} that (ε={eps:.3f}, δ)-DP allows. "
        "Something the DP claim rests on is false: either the DP implementation or its "
        "accounting is broken (e.g. less noise than the accountant was told), or the members "
        "and non-members are not drawn from the same distribution — the ceiling assumes they are "
        "exchangeable, and a shifted held-out set looks like leakage."
    )


def build_report(
    *,
    step: int,
    results: Mapping[str, QueryResult | Failure],
    detectable: Mapping[str, float],
    epsilon: float | None,
    canaries: Mapping[str, CanaryFigures | Failure],
    prior: float,
    delta: float,
    certify_delta: float,
    run_id: str,
    seconds: float,
    query_seconds: float,
    traces: TraceFigures | None = None,
) -> Report:
    """The report of the check at ``step``.

    Args:
        step: the check's global step.
        results: per query, in the monitor's order: its analysis, or why it failed.
        detectable: per query analysed: the smallest advantage the check certifies in half
            the runs at its audit sizes.
        epsilon: ε read from the accountant at ``delta`` (None: no accountant); it gives the
            ε-DP and (ε, δ)-DP ceilings on the advantage (none when NaN).
        canaries: per part of the canaries' audit (its entry among the failures, e.g.
            :data:`CANARIES`): its figures, or why it failed; empty without canaries.
        prior: P(member).
        delta: the DP δ of ``epsilon``.
        certify_delta: the δ each certified figure of the check holds at.
        run_id: the run's id.
        seconds: the whole check's duration; ``query_seconds``: of which in the queries.
        traces: the loss traces' figures (None: no loss traces).

    Raises:
        RuntimeError: when every query's analysis failed and no part of the canaries' audit
            gave figures (with figures, the report holds them and the queries' failures).
    """
    ceilings = _ceilings(epsilon, prior=prior, delta=delta)
    scalars: dict[str, float] = {}
    if epsilon is not None:
        scalars[tags.EPSILON] = epsilon
        scalars.update(ceilings)
    scalars[tags.CERTIFY_DELTA] = certify_delta
    analysed = {n: r for n, r in results.items() if isinstance(r, QueryResult)}
    parts = [
        _failed(name, result) if isinstance(result, Failure) else _query_part(
            step, name, result, detectable=detectable[name], epsilon=epsilon,
            ceiling=ceilings.get(tags.CEILING_EPS_DELTA), prior=prior,
        )
        for name, result in results.items()
    ]  # fmt: skip
    audited = [f for f in canaries.values() if isinstance(f, CanaryFigures)]
    parts += [
        _failed(key, f)
        if isinstance(f, Failure)
        else _Part(f.scalars, {}, f.messages, f.causes, f.violation)
        for key, f in canaries.items()
    ]
    traces = traces or TraceFigures()
    parts.append(_Part(traces.scalars, traces.failures))
    failures = {k: v for part in parts for k, v in part.failures.items()}
    if not analysed and not audited:
        raise RuntimeError(f"every query's analysis failed: {failures}")
    for part in parts:
        scalars.update(part.scalars)
    violation = any(part.violation for part in parts)
    if epsilon is not None or any(tags.parse_dp_check(t) for t in scalars):
        scalars[tags.DP_VIOLATION] = float(violation)
    return Report(
        step=step,
        scalars=scalars,
        queries=analysed,
        epsilon=epsilon,
        dp_violation=violation,
        messages=tuple(m for part in parts for m in part.messages),
        failures=failures,
        seconds=seconds,
        query_seconds=query_seconds,
        run_id=run_id,
        dp_causes=tuple(c for part in parts for c in part.causes),
        vulnerable=dict(traces.vulnerable),
    )


@dataclass(frozen=True)
class _Part:
    """What one query or one part of the canaries' audit adds to the report."""

    scalars: dict[str, float]
    failures: dict[str, str]
    messages: tuple[str, ...] = ()
    causes: tuple[str, ...] = ()
    violation: bool = False


def _failed(key: str, failure: Failure) -> _Part:
    return _Part({}, {key: failure.reason})


def _ceilings(epsilon: float | None, *, prior: float, delta: float) -> dict[str, float]:
    """The ε-DP and (ε, δ)-DP ceilings on the advantage (none without ε, or when it is NaN;
    ε = inf gives the trivial ceiling 1)."""
    if epsilon is None or math.isnan(epsilon):
        return {}
    return {
        tags.CEILING_TANH: float(tanh_bound(epsilon, prior=prior)),
        tags.CEILING_EPS_DELTA: float(tanh_bound(epsilon, prior=prior, delta=delta)),
    }


def _query_part(
    step: int,
    name: str,
    result: QueryResult,
    *,
    detectable: float,
    epsilon: float | None,
    ceiling: float | None,
    prior: float,
) -> _Part:
    """One analysed query's figures, the ε implied by each certified lower bound (in one call),
    and a message per certified bound above the (ε, δ)-DP ``ceiling``."""
    scalars = {tags.query_figure(name, k): v for k, v in result.scalars().items()}
    scalars[tags.detectable(name)] = detectable
    eps_bounds = epsilon_lower_bound(
        np.array([est.lower for est in result.estimates.values()]), prior=prior
    )
    for method, eps_bound in zip(result.estimates, eps_bounds.tolist(), strict=True):
        scalars[tags.epsilon_lower_bound(name, method)] = eps_bound
    messages = tuple(
        violation_message(step, f"{name}/{method}", est.lower, ceiling, epsilon)
        for method, est in result.estimates.items()
        if epsilon is not None and ceiling is not None and est.lower > ceiling + _ROUNDING
    )
    failures = {f"{name}/{what}": e for what, e in result.failures.items()}
    return _Part(scalars, failures, messages, violation=bool(messages))
