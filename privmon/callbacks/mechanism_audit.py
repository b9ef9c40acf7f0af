"""The DP mechanism checks at a check: each canaries object's findings (``mechanism()``: one
:class:`~privmon.audit.mechanism.MechanismFinding` per test), every rank's combined under
torch.distributed, and decided: a deterministic test fires when ``fired``, a statistical one when
its p-value is below the check's alarm level — its share of the monitor's ``dp_alarm_delta``,
spent over the checks as ``interval_delta`` is and split over the check's statistical tests
(:meth:`~privmon.callbacks.budget.CertificationBudget.alarm_level`), so that any false alarm of
these tests over the whole run has probability ≤ ``dp_alarm_delta``. A statistical test without
a p-value (NaN or None) is undecided, as is every test of a check that stopped (one of its hooks
raised inside the training step): never a DP violation, never silent — logged and said in the
report's failures (``dp_checks/<check>/<test>``), the check's fired flag NaN. Theory, *Spending
the run's confidence budget*.

Ranks: every rank's findings travel to rank 0 in the check's one exchange and are combined
there, so every rank reports the same outcome: a deterministic test fires when
it fired on any rank; a statistical test's p-value is the Bonferroni-adjusted minimum
min(1, k · min_r p_r) over the k ranks that gave one, which is below δ with probability ≤ δ
under the null whatever the ranks' dependence — so a fault on any rank is seen and the budget
holds without a share per rank; the ranks that gave none are said as undecided. A deterministic
test that fired on no rank and is undecided on one (its check stopped) is undecided. A rank whose
``mechanism()`` failed is said in the failures; the others' findings still count.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

from privmon._failure import Failure
from privmon.audit.mechanism import MechanismFinding
from privmon.callbacks.canary_audit import CanarySource
from privmon.report import tags
from privmon.report.build import CanaryFigures
from privmon.report.formatting import cause_text

__all__ = [
    "ASSUMPTIONS",
    "DP_CHECKS",
    "agreed_findings",
    "decide_findings",
    "findings_of",
    "mechanism_figures",
]

logger = logging.getLogger("privmon")

DP_CHECKS = "dp_checks"
"""The mechanism checks' entry among a check's failures (``dp_checks/<canaries' name>``)."""

ASSUMPTIONS = {
    "clipping": "each record's gradient clipped to C",
    "noise": "fresh N(0, σ²C²) noise at every step",
    "sampling": "Poisson batches at rate q from N records",
    "steps": "every noised step counted",
    "ledger": "no update of the weights but the private steps",
}
"""What the accountant assumes that each of privmon's mechanism checks tests."""

Local = dict[str, "tuple[MechanismFinding, ...] | Failure"]


def _finding(found: Any) -> MechanismFinding:
    """``found`` as a :class:`MechanismFinding`, every field checked (a ValueError says which)."""
    check, test = getattr(found, "check", None), getattr(found, "test", None)
    kind, p = getattr(found, "kind", None), getattr(found, "p_value", None)
    if not (isinstance(check, str) and isinstance(test, str)) or not all(
        x and "/" not in x for x in (check, test)
    ):
        raise ValueError(f"a finding's check and test must be names without '/', got {found!r}")
    if kind not in ("deterministic", "statistical"):
        raise ValueError(f"a finding's kind must be deterministic or statistical, got {found!r}")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))):
        raise ValueError(f"a finding's p_value must be a number or None, got {found!r}")
    return MechanismFinding(
        check=check,
        test=test,
        kind=kind,
        fired=bool(getattr(found, "fired", False)),
        p_value=None if p is None else float(p),
        evidence=str(getattr(found, "evidence", "")),
        undecided=bool(getattr(found, "undecided", False)),
    )


def _declared(
    source: CanarySource, found: Sequence[MechanismFinding], *, said: set[Any]
) -> tuple[MechanismFinding, ...]:
    """``found`` without the statistical findings ``source``'s ``statistical_tests`` do not
    declare (they had no share of the budget), each said once (``said`` remembers)."""
    kept = []
    for f in found:
        pair = (f.check, f.test)
        if f.kind == "statistical" and pair not in source.statistical_tests:
            if (source.name, pair) not in said:
                said.add((source.name, pair))
                logger.error(
                    "privmon: the canaries %r gave a p-value for %s/%s, which their "
                    "statistical_tests %s do not declare: it has no share of the run's "
                    "confidence budget and is left out",
                    source.name,
                    *pair,
                    list(source.statistical_tests),
                )
            continue
        kept.append(f)
    return tuple(kept)


def findings_of(
    sources: Sequence[CanarySource], *, accountant: Any, step: int, strict: bool, said: set[Any]
) -> Local:
    """Per canaries object with ``mechanism()`` (by name): its findings on this rank (given the
    monitor's ``accountant``, a PrivacyEngine's own accountant), or why they failed (logged;
    re-raised when strict). A statistical finding its ``statistical_tests`` does not declare had
    no share of the budget: it is dropped, said once (``said`` remembers)."""
    out: Local = {}
    accountant = getattr(accountant, "accountant", accountant)  # a PrivacyEngine's
    for source in sources:
        if not source.mechanism:
            continue
        try:
            found = tuple(map(_finding, source.canaries.mechanism(accountant=accountant)))
        except Exception as err:
            if strict:
                raise
            logger.exception(
                "privmon: the DP mechanism checks of the canaries %r failed at step %s",
                source.name,
                step,
            )
            out[source.name] = Failure.of(err)
            continue
        out[source.name] = _declared(source, found, said=said)
    return out


def _p(f: MechanismFinding) -> float:
    """A finding's p-value, NaN for none."""
    return math.nan if f.p_value is None else f.p_value


def _combined(found: Sequence[tuple[str, MechanismFinding]], *, adjust: bool) -> MechanismFinding:
    """One test's findings from several places (``(where, finding)``, ``where`` "" or " (rank
    r)"): fired anywhere; the smallest p-value, times their number when ``adjust``."""
    first = found[0][1]
    if first.kind == "deterministic":  # fired anywhere; else undecided where one is
        fired = [(w, f) for w, f in found if f.fired and not f.undecided]
        unknown = [(w, f) for w, f in found if f.undecided]
        where, shown = (fired or unknown or found)[0]
        return MechanismFinding(
            first.check, first.test, first.kind, bool(fired), None, shown.evidence + where,
            undecided=not fired and bool(unknown),
        )  # fmt: skip
    with_p = [(p, w, f) for w, f in found if not math.isnan(p := _p(f))]
    if not with_p:
        return MechanismFinding(first.check, first.test, first.kind, False, None, first.evidence)
    p, where, shown = min(with_p, key=lambda x: x[0])
    p = min(1.0, p * len(with_p)) if adjust else p
    return MechanismFinding(first.check, first.test, first.kind, False, p, shown.evidence + where)


def _say_partly_undecided(
    found: Sequence[tuple[str, MechanismFinding]], failures: dict[str, Failure]
) -> None:
    """Into ``failures``: the places (``where`` of ``found``, as :func:`_combined`'s) whose
    statistical test gave no p-value while others gave one — decided on those; a test no place
    decided is :func:`decide_findings`' to say."""
    first = found[0][1]
    missing = [w.strip(" ()") for w, f in found if math.isnan(_p(f))]
    if first.kind != "statistical" or not missing or len(missing) == len(found):
        return
    key = f"{DP_CHECKS}/{first.check}/{first.test}"
    said = (
        f"the {first.test} test of the {first.check} check gave no p-value on "
        f"{', '.join(missing)}: decided on the others' alone"
    )
    earlier = failures.get(key)
    failures[key] = Failure(said if earlier is None else f"{earlier.reason}; {said}")


def _by_test(found: Iterable[tuple[str, MechanismFinding]]) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = {}
    for where, f in found:
        out.setdefault((f.check, f.test), []).append((where, f))
    return out


def agreed_findings(ranks: Sequence[Local]) -> tuple[list[MechanismFinding], dict[str, Failure]]:
    """Every rank's findings (``ranks``: each rank's :func:`findings_of`, in rank order; one
    for one process), combined as the module docstring says; and per canaries object whose
    ``mechanism()`` failed on some rank, why (``dp_checks/<name>``); and per statistical test
    that some ranks or objects gave no p-value for, which (``dp_checks/<check>/<test>``)."""
    several = len(ranks) > 1
    per_source: list[tuple[str, MechanismFinding]] = []  # (the object, its finding)
    failures: dict[str, Failure] = {}
    for name in ranks[0]:
        errors, where = [], []
        for r, found in enumerate(ranks):
            mine = found[name]
            if isinstance(mine, Failure):
                errors.append(mine.on_rank(r).reason if several else mine.reason)
            else:
                where += [(f" (rank {r})" if several else "", f) for f in mine]
        if errors:
            failures[f"{DP_CHECKS}/{name}"] = Failure("; ".join(errors))
        for fs in _by_test(where).values():
            per_source.append((f"canaries {name!r}", _combined(fs, adjust=True)))
            _say_partly_undecided(fs, failures)
    combined = []  # several objects: each of their tests had its own share of the budget
    for fs in _by_test(per_source).values():
        combined.append(_combined([("", f) for _, f in fs], adjust=False))
        _say_partly_undecided(fs, failures)
    return combined, failures


def _cause(f: MechanismFinding, alarm_delta: float) -> str:
    """What a test that fired says: its evidence, naming its check first; a statistical test's
    p-value beside the level it fired at."""
    cause = f.evidence or f"the {f.test} test failed"
    if not cause.startswith(f"{f.check}: "):  # the cause names its check first
        cause = f"{f.check}: {cause}"
    if f.kind == "statistical":
        cause += (
            f" ({f.test} test: p = {f.p_value:.3g}, below the alarm level of each statistical "
            f"test, {alarm_delta:.3g}: this check's share of dp_alarm_delta)"
        )
    return cause


def _undecided(f: MechanismFinding, *, step: int) -> Failure:
    """A test undecided at the check at ``step`` (its check stopped, or a statistical test
    gave no p-value): said."""
    if f.undecided:
        said = f"the {f.test} test of the {f.check} check is undecided at step {step}"
    else:
        said = (
            f"the {f.test} test of the {f.check} check gave no p-value (NaN or none) at step "
            f"{step}: undecided, not a DP violation"
        )
    if f.evidence:
        said += f"; its evidence: {f.evidence}"
    logger.warning("privmon: %s", said)
    return Failure(said)


def decide_findings(
    findings: Sequence[MechanismFinding], *, alarm_delta: float, step: int
) -> tuple[CanaryFigures, dict[str, Failure]]:
    """The figures of the combined ``findings`` at the check's alarm level per statistical
    test (``alarm_delta``): per check a 0/1 flag (any of its tests fired) and its tests'
    p-values, the level (:data:`~privmon.report.tags.DP_ALARM_DELTA`) when a test is
    statistical; the cause and the message of each test that fired. An undecided test (its
    check stopped, or a statistical test without a p-value) fires not, and is logged and
    returned among the failures (``dp_checks/<check>/<test>``), never a DP violation; a check
    none of whose tests was decided has a NaN flag."""
    fired: dict[str, bool] = {}
    decided: set[str] = set()  # the checks with a test decided
    p_values: dict[str, dict[str, float]] = {}
    causes: list[tuple[str, str]] = []  # (check, cause)
    undecided: dict[str, Failure] = {}
    for f in findings:
        p = _p(f) if f.kind == "statistical" else None
        if p is not None:
            p_values.setdefault(f.check, {})[f.test] = p
        hit = not f.undecided and (f.fired if p is None else p < alarm_delta)
        if f.undecided or (p is not None and math.isnan(p)):
            undecided[f"{DP_CHECKS}/{f.check}/{f.test}"] = _undecided(f, step=step)
        else:
            decided.add(f.check)
        fired[f.check] = fired.get(f.check, False) or hit
        if hit:
            causes.append((f.check, _cause(f, alarm_delta)))
    scalars: dict[str, float] = {tags.DP_ALARM_DELTA: alarm_delta} if p_values else {}
    for check, hit in fired.items():  # NaN: none of its tests was decided
        scalars[tags.dp_check_fired(check)] = float(hit) if check in decided else math.nan
        for test, p in p_values.get(check, {}).items():
            scalars[tags.dp_check_p_value(check, test)] = p
    messages = tuple(
        f"privmon: DP violation at step {step}: {cause_text(cause)}. The mechanism that ran is "
        "not the one the accountant assumed"
        + (f" ({ASSUMPTIONS[check]})" if check in ASSUMPTIONS else "")
        + ", so its ε does not hold for this run"
        for check, cause in causes
    )
    figures = CanaryFigures(scalars, bool(causes), messages, tuple(c for _, c in causes))
    return figures, undecided


def mechanism_figures(
    ranks: Sequence[Local], *, alarm_delta: float, step: int
) -> tuple[CanaryFigures | None, dict[str, Failure]]:
    """:func:`agreed_findings` then :func:`decide_findings` at ``alarm_delta``: the mechanism
    checks' figures (None when no object gave any) and the failures (undecided tests
    included)."""
    findings, failures = agreed_findings(ranks)
    if not findings:
        return None, failures
    figures, undecided = decide_findings(findings, alarm_delta=alarm_delta, step=step)
    return figures, {**failures, **undecided}
