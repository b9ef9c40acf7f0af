"""The verdict of a run: no measurable leakage, leakage certified, or a DP violation, from the
certified lower bounds alone. A check certifies leakage when its ε lower bound is positive (its
certified bound exceeds the prior's floor |2p − 1|); the monitor's bounds hold together over the
run, so one is enough. A DP violation is a DP mechanism check that fired (named with its evidence,
first), a canary ε lower bound above the accountant's ε, or a certified bound above the (ε, δ)
ceiling. With early stopping the verdict says the budget and what it did (:func:`stopping_text`).
Theory, *The report's verdict and its ROC*."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from privmon.report import tags
from privmon.report.formatting import cause_text, fmt
from privmon.report.runs import Checks
from privmon.report.stopping import budget_text

__all__ = [
    "EXCHANGEABILITY",
    "TOL",
    "Verdict",
    "certificates",
    "certified_floor",
    "mechanism_causes",
    "stopping_text",
    "verdict",
]

TOL = 1e-9  # an ε lower bound above this certifies leakage (below: floating-point noise)

EXCHANGEABILITY = (
    "The DP ceiling compares like with like only when members and non-members are exchangeable "
    "(the audited members are a random part of the same pool as the held-out records). A shifted "
    "held-out set looks like leakage: check how the audit sets were drawn before blaming the DP "
    "implementation or its accounting."
)


@dataclass(frozen=True)
class Verdict:
    """A run's verdict: ``level`` ("violation", "leakage", "none" or "empty"), a one-line
    ``headline`` and the ``details`` behind it.

    Examples:
        >>> from privmon.report import Report, checks_from_reports, verdict
        >>> checks = checks_from_reports([Report(step=100, scalars={}, run_id="3f2a9c")])
        >>> result = verdict(checks)
        >>> result.level, result.headline
        ('none', 'No measurable membership leakage.')
    """

    level: str  # "violation", "leakage", "none", "empty"
    headline: str
    details: tuple[str, ...] = ()


def certificates(checks: Checks) -> list[tuple[int, str, str, float, float]]:
    """(step, query, method, lower, eps_lower_bound) of every check that certifies leakage."""
    hits = []
    for r in checks.records:
        s = r["scalars"]
        for q in checks.queries():
            for m in checks.methods(q):
                lower = s.get(tags.lower(q, m), math.nan)
                elb = s.get(tags.epsilon_lower_bound(q, m), math.nan)
                certified = elb > TOL if not math.isnan(elb) else lower > TOL
                if certified and not math.isnan(lower):
                    hits.append((r["step"], q, m, lower, elb))
    return hits


def certified_floor(hits: Sequence[tuple[int, str, str, float, float]]) -> float | None:
    """The trivial floor |2p − 1|, recovered from a certificate: ε_lb = 2·artanh(lower) − |λ|."""
    for _, _, _, lower, elb in hits:
        if math.isfinite(elb) and 0.0 <= lower < 1.0:
            lam = 2.0 * math.atanh(lower) - elb
            return max(0.0, math.tanh(lam / 2.0))
    return None


def mechanism_causes(checks: Checks) -> list[tuple[int, str, str]]:
    """(step, check, cause) for each DP mechanism check that fired at a check: each cause the
    run wrote for it (the JSON lines' ``dp_causes``, the event files' text), else what its
    figures say (its tests' p-values)."""
    out = []
    for r in checks.records:
        s, written = r["scalars"], r.get("dp_causes", [])
        for check in tags.fired_checks(s):
            causes = [c for c in written if c.startswith(f"{check}: ")]
            if not causes:
                p_values = [
                    f"{q[1]} test p = {fmt(p, 3)}"
                    for t, p in s.items()
                    if (q := tags.parse_dp_check(t)) and q[0] == check and q[1] is not None
                ]
                said = f" ({', '.join(p_values)})" if p_values else ""
                causes = [f"{check}: the check fired{said}"]
            out += [(r["step"], check, c) for c in causes]
    return out


def _mechanism_text(causes: Sequence[tuple[int, str, str]], n: int) -> str:
    """What the mechanism checks that fired say, per check: how often, first where and why."""
    parts = []
    for check in dict.fromkeys(c for _, c, _ in causes):
        mine = [(step, cause) for step, c, cause in causes if c == check]
        steps = sorted({step for step, _ in mine})
        parts.append(
            f"{check} at {len(steps)} of {n} checks (first at step {steps[0]}: "
            f"{cause_text(mine[0][1]).split(' — ', 1)[-1]})"
        )
    return (
        "The DP mechanism checks that fired: "
        + "; ".join(parts)
        + ". The mechanism that ran is not the one the accountant assumed, so its ε does not "
        "hold for this run; these checks watch the optimizer itself, so this holds whatever the "
        "audit sets."
    )


def _violations(checks: Checks) -> list[tuple[int, str, float, float, float]]:
    """(step, tag, lower, ceiling, eps) for each query/method above the (ε, δ) ceiling, and
    (step, "canaries/<method>", audited ε, accountant ε, accountant ε) for each one-run canary
    bound above the accountant's ε."""
    out = []
    canaries = checks.canary_methods()
    for r in checks.records:
        s = r["scalars"]
        ceiling = s.get(tags.CEILING_EPS_DELTA, math.nan)
        eps = r["epsilon"] if r["epsilon"] is not None else s.get(tags.EPSILON, math.nan)
        audited = {m: s.get(tags.canary_epsilon(m), math.nan) for m in canaries}
        found = [
            (r["step"], f"canaries/{m}", a, eps, eps)
            for m, a in audited.items()
            if not math.isnan(eps) and a > eps + TOL
        ]
        if not math.isnan(ceiling):
            found += [
                (r["step"], f"{q}/{m}", lower, ceiling, eps)
                for q in checks.queries()
                for m in checks.methods(q)
                if (lower := s.get(tags.lower(q, m), math.nan)) > ceiling + 1e-12
            ]
        out += found
        if r["dp_violation"] and not found and not tags.fired_checks(s):
            out.append((r["step"], "?", math.nan, ceiling, eps))
    return out


def _stop_step(record: dict[str, Any]) -> bool:
    said = record.get("stopping", {})
    flag = record["scalars"].get(tags.STOPPING_STOP, math.nan)
    return bool(said.get("stop")) or said.get("decision") == "stop" or flag >= 0.5


def stopping_text(checks: Checks) -> str | None:
    """Early stopping's budget and outcome in words (None: the run had no early stopping): the
    stop (its step, the figure's value, why) and the weights restored, or that it never fired
    and the highest value the figure reached, with its step.

    Examples:
        >>> from privmon.report import Report, checks_from_reports
        >>> from privmon.report.verdict import stopping_text
        >>> def check(step, lower):
        ...     figures = {"privacy/q/histogram/lower": lower, "privacy/stopping/threshold": 0.2,
        ...                "privacy/stopping/figure": lower, "privacy/stopping/stop": 0.0}
        ...     return Report(step=step, scalars=figures, run_id="3f2a9c")
        >>> print(stopping_text(checks_from_reports([check(100, 0.1), check(200, 0.15)])))
        Early stopping never fired over 2 checks (budget: privacy/stopping/figure ≤ 0.2000); the highest value of its figure was 0.1500, at step 200.
    """  # noqa: E501
    records = [r for r in checks.records if tags.STOPPING_THRESHOLD in r["scalars"]]
    if not records:
        return None
    said: dict[str, Any] = next((r["stopping"] for r in reversed(records) if r.get("stopping")), {})
    tag = said.get("tag", tags.STOPPING_FIGURE)
    use = said.get("use") or ("lower" if tag.endswith("/lower") else "value")
    threshold = said.get("threshold", records[-1]["scalars"][tags.STOPPING_THRESHOLD])
    budget = (
        budget_text(tag, threshold, use, said["patience"])
        if "patience" in said
        else f"{tag} ≤ {threshold:.4f}"
    )
    stop = next((r for r in records if _stop_step(r)), None)
    if stop is not None:
        value = stop["scalars"].get(tags.STOPPING_FIGURE, math.nan)
        wait = stop["scalars"].get(tags.STOPPING_WAIT, math.nan)
        text = (
            f"Early stopping stopped training at step {stop['step']} (budget: {budget}): "
            f"{tag} = {fmt(value)}, above {threshold:.4f} for {fmt(wait)} consecutive check(s)."
        )
        outcome = checks.outcome or {}
        restored = outcome.get("restored_step")
        if restored is None:  # read from event files: the outcome's sentence alone
            m = re.search(r"weights of step (\d+) were restored", outcome.get("sentence", ""))
            restored = int(m.group(1)) if m else None
        if restored is not None:
            text += f" The weights of step {restored} were restored."
        return text
    values = [(r["scalars"].get(tags.STOPPING_FIGURE, math.nan), r["step"]) for r in records]
    finite = [(v, -s) for v, s in values if math.isfinite(v)]
    what = "certified figure" if use == "lower" else "value of its figure"
    peak = (
        f"the highest {what} was {max(finite)[0]:.4f}, at step {-max(finite)[1]}"
        if finite
        else "its figure was never finite"
    )
    return f"Early stopping never fired over {len(records)} checks (budget: {budget}); {peak}."


def verdict(checks: Checks) -> Verdict:
    """The plain-language verdict of a run (rules in the module docstring); with early stopping
    its first detail says the budget and what it did (:func:`stopping_text`).

    Examples:
        >>> from privmon import epsilon_lower_bound
        >>> from privmon.report import Report, checks_from_reports, verdict
        >>> def check(step, lower):  # the figures a monitor's check reports, in brief
        ...     figures = {"privacy/loss/histogram/lower": lower,
        ...                "privacy/loss/histogram/epsilon_lower_bound": epsilon_lower_bound(lower)}
        ...     return Report(step=step, scalars=figures, run_id="3f2a9c")
        >>> result = verdict(checks_from_reports([check(100, 0.0), check(200, 0.15)]))
        >>> result.level, result.headline
        ('leakage', 'Leakage detected: certified advantage ≥ 0.150 at step 200.')
    """
    found = _verdict(checks)
    said = stopping_text(checks)
    if said is None:
        return found
    return Verdict(found.level, found.headline, (said, *found.details))


def _verdict(checks: Checks) -> Verdict:
    if not checks.records:
        return Verdict("empty", "No checks recorded: nothing to certify.")
    n = len(checks.records)
    hits = certificates(checks)
    best = max(hits, key=lambda h: (h[3], -h[0])) if hits else None
    leak_text = _leak_text(hits, best, n) if best is not None else ""
    violations, mechanism = _violations(checks), mechanism_causes(checks)
    if mechanism or violations:
        headline, details, only_canaries = _violation_text(mechanism, violations, n)
        if best is not None:
            details.append("Leakage detected. " + leak_text)
        if not only_canaries:
            details.append(EXCHANGEABILITY)
        return Verdict("violation", headline, tuple(details))
    if best is not None:
        headline = f"Leakage detected: certified advantage ≥ {best[3]:.3f} at step {best[0]}."
        level, details = "leakage", [leak_text]
    else:
        headline, level = "No measurable membership leakage.", "none"
        details = _no_leak_text(checks, n)
    return Verdict(level, headline, (*details, *_budget_text(checks, n)))


def _leak_text(hits: Sequence[Any], best: Any, n: int) -> str:
    """The largest certified advantage (``best`` of ``hits``) and where leakage was certified."""
    floor = certified_floor(hits)
    floor_note = (
        f" (the trivial floor at this run's prior is {floor:.3f}: an advantage up to it needs no "
        "leakage)"
        if floor is not None and floor > 1e-6
        else ""
    )
    hit_steps = sorted({h[0] for h in hits})
    step, q, m, lower, elb = best
    return (
        f"The largest certified advantage is {lower:.3f}, at step {step} (query {q!r}, {m} "
        f"estimator){floor_note}; leakage was certified at {len(hit_steps)} of {n} checks, "
        f"first at step {hit_steps[0]}. The certified bounds hold together over every check, "
        "query and method of the run at the monitor's confidence 1 − δ, so one is enough. "
        f"Were training ε-DP, ε would have to be at least {elb:.3g} (given exchangeable "
        "audit sets)."
    )


def _violation_text(
    mechanism: Sequence[Any], violations: Sequence[Any], n: int
) -> tuple[str, list[str], bool]:
    """(headline, details, whether every violation is the canaries') of a run with a DP
    violation: a mechanism check first (it names the assumption that failed), then the
    canaries' figure (it needs no assumption on the audit sets), then a certified bound."""
    details: list[str] = []
    headline = ""
    if mechanism:
        step, _, cause = min(mechanism, key=lambda m: m[0])
        headline = f"DP violation at step {step}: {cause_text(cause)}."
        details.append(_mechanism_text(mechanism, n))
    if not violations:
        return headline, details, True
    step, tag, lower, ceiling, eps = min(
        violations, key=lambda v: (not v[1].startswith("canaries/"), v[0])
    )
    if tag.startswith("canaries/"):
        what = (
            f"the one-run canary audit ({tag.split('/', 1)[1]}) certifies ε ≥ {lower:.3g}, "
            f"above the accountant's ε = {eps:.3g}"
        )
    elif tag != "?":
        what = (
            f"the certified lower bound on the membership advantage ({tag}: {lower:.3f}) "
            f"exceeds the ceiling {ceiling:.3f} that (ε = {eps:.3g}, δ)-DP allows"
        )
    else:
        what = "the monitor flagged a certified advantage above the (ε, δ)-DP ceiling"
    headline = headline or f"DP violation: at step {step} {what}."
    steps = sorted({v[0] for v in violations})
    only_canaries = all(v[1].startswith("canaries/") for v in violations)
    details.append(
        ("Besides, " + what + ": f" if mechanism else "F")
        + f"lagged at {len(steps)} of {n} checks (steps {_steps_text(steps)}). "
        "Something the DP claim rests on is false: either the DP implementation or its "
        "accounting is broken (e.g. less noise than the accountant was told)"
        + (
            ". The canaries' inclusion is randomised, so this holds whatever the audit sets."
            if only_canaries
            else ", or the audit sets are not exchangeable."
        )
    )
    return headline, details, only_canaries


def _no_leak_text(checks: Checks, n: int) -> list[str]:
    """The details of a run where no certified bound rose above the floor: the largest point
    estimate, what that does not prove, and the smallest advantage the last check detects."""
    estimates = [
        (v, r["step"], q, m)
        for r in checks.records
        for q in checks.queries()
        for m in checks.methods(q)
        if not math.isnan(v := r["scalars"].get(tags.value(q, m), math.nan))
    ]
    v_best = max(estimates, key=lambda e: e[0], default=None)  # the first of the largest
    text = (
        f"At none of the {n} checks (steps {checks.steps[0]}–{checks.records[-1]['step']}) did "
        "a certified lower bound on the optimal membership advantage rise above the trivial "
        "floor (0 at prior 0.5)."
    )
    if v_best is not None:
        text += (
            f" The largest point estimate was {v_best[0]:.3f} (step {v_best[1]}, query "
            f"{v_best[2]!r}, {v_best[3]})."
        )
    details = [
        text,
        "This is not a proof of privacy: it covers the queries audited, on the audit sets "
        "used, with the power these sample sizes give; a stronger query or more audit records "
        "may find leakage these did not.",
    ]
    last = checks.records[-1]["scalars"]
    detectable = [
        (q, last[tags.detectable(q)]) for q in checks.queries() if tags.detectable(q) in last
    ]
    if detectable:
        details.append(
            "At the last check's audit sizes and δ, the certificate detects in half the runs "
            "an advantage of at least "
            + ", ".join(f"{fmt(a, 3)} (query {q!r})" for q, a in detectable)
            + ": smaller leaks may go uncertified (more audit records, fewer checks or "
            "planned checks lower it)."
        )
    return details


def _budget_text(checks: Checks, n: int) -> list[str]:
    """What a run without a DP violation says of its DP budget: the ceiling held, the
    mechanism checks that ran, the largest one-run canary bound."""
    details = []
    has_eps = any(r["epsilon"] is not None for r in checks.records) or checks.has(tags.EPSILON)
    if has_eps:
        eps_last = checks.records[-1]["epsilon"]
        ceil = checks.records[-1]["scalars"].get(tags.CEILING_EPS_DELTA, math.nan)
        details.append(
            f"Consistent with the DP budget: no certified lower bound exceeded the (ε, δ) "
            f"ceiling (at the last check ε = {fmt(eps_last)}, ceiling {fmt(ceil)}). "
            + EXCHANGEABILITY
        )
    ran = {c[0] for t in checks.records[-1]["scalars"] if (c := tags.parse_dp_check(t))}
    if ran:
        details.append(
            f"DP mechanism checks ({', '.join(sorted(ran))}): none fired at any of the {n} checks."
        )
    audited = [
        (a, r["step"], m)
        for r in checks.records
        for m in checks.canary_methods()
        if not math.isnan(a := r["scalars"].get(tags.canary_epsilon(m), math.nan))
    ]
    if audited:
        top = max(audited)
        details.append(
            f"One-run canary audit: the largest audited ε lower bound was {fmt(top[0])} (step "
            f"{top[1]}, {top[2]})"
            + (", below the accountant's ε at every check." if has_eps else ".")
        )
    return details


def _steps_text(steps: Sequence[int], limit: int = 12) -> str:
    text = ", ".join(str(s) for s in steps[:limit])
    return text + (f", … ({len(steps)} in all)" if len(steps) > limit else "")
