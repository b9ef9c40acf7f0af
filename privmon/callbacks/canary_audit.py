"""The canaries' audit at a check: each canaries object's one-run ε lower bounds beside the
accountant's ε, and its DP mechanism checks' findings (:mod:`~privmon.callbacks.mechanism_audit`).

The monitor's ``canaries=`` is one object or a sequence of them (:class:`CanaryAudits`). An
object with ``scores()`` (``(in_scores, out_scores)``, higher = included:
:class:`~privmon.audit.GradientCanaries`, :class:`~privmon.audit.InputCanaries` bound to a query)
gives each method of :data:`CANARY_METHODS` an ε lower bound (:func:`privmon.audit.one_run_epsilon`;
Steinke et al., Mahloujifar et al.) at the share of the run's confidence budget the check allots
it: an audited ε above the accountant's is a DP violation, whatever the audit sets (the
canaries' inclusion is randomised by design). An object with ``mechanism()`` gives the findings of
the checks of each assumption of the accountant; ``statistical_tests`` (read once, here) are the
p-values it gives, each deciding at its share of the alarm's level (``dp_alarm_delta``).
Derivations: Theory, *One-run ε lower bounds* and *Spending the run's confidence budget*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from privmon.audit.one_run import one_run_epsilon
from privmon.report import tags
from privmon.report.build import CANARIES, CanaryFigures

__all__ = ["CANARY_METHODS", "CanaryAudits", "CanarySource", "canary_figures", "check_canaries"]

CANARY_METHODS: tuple[Literal["fdp", "steinke"], ...] = ("fdp", "steinke")
"""The one-run bounds a check reports: f-DP (μ-GDP, then ε at δ) and Steinke et al.'s."""

# an audited ε above the accountant's by less than this is rounding, not a violation
_TOLERANCE = 1e-9


def check_canaries(canaries: Any) -> Any:
    """Return ``canaries`` after checking it has a ``scores()`` method (called without
    arguments: bind :class:`~privmon.audit.InputCanaries` to a query first) or a
    ``mechanism()`` method."""
    has = [callable(getattr(canaries, m, None)) for m in ("scores", "mechanism")]
    if not any(has):
        raise ValueError(
            "canaries must have a scores() method returning (in_scores, out_scores), or a "
            "mechanism() method returning the DP mechanism checks' findings: a "
            "privmon.audit.GradientCanaries, or privmon.audit.InputCanaries(records, query=...), "
            f"got {type(canaries).__name__}"
        )
    return canaries


def _statistical_tests(canaries: Any) -> tuple[tuple[str, str], ...]:
    """The (check, test) pairs of ``canaries.statistical_tests`` (none without it), checked."""
    declared = getattr(canaries, "statistical_tests", ())
    try:
        pairs = tuple(tuple(pair) for pair in declared)
    except TypeError:
        pairs = ((),)
    names = [x for pair in pairs for x in pair]
    if (
        any(len(pair) != 2 for pair in pairs)
        or not all(isinstance(x, str) and x and "/" not in x for x in names)
        or len(set(pairs)) < len(pairs)
    ):
        raise ValueError(
            f"canaries {type(canaries).__name__}: statistical_tests must be distinct (check, "
            f"test) pairs of names without '/', got {declared!r}"
        )
    return pairs


@dataclass(frozen=True)
class CanarySource:
    """One canaries object of a monitor, as read at construction."""

    canaries: Any
    name: str
    """Its name among several (:func:`privmon.report.tags.canary_source`)."""
    tag_source: str | None
    """The name its one-run bounds' tags carry: None for the only object with ``scores()``."""
    scores: bool
    """Whether it has ``scores()``: its one-run bounds."""
    mechanism: bool
    """Whether it has ``mechanism()``: its DP mechanism checks."""
    statistical_tests: tuple[tuple[str, str], ...]
    """The (check, test) pairs whose p-values ``mechanism()`` gives."""

    @property
    def key(self) -> str:
        """Its one-run bounds' entry among a check's failures."""
        return CANARIES if self.tag_source is None else f"{CANARIES}/{self.tag_source}"


def _runs_mechanism_checks(obj: Any) -> bool:
    """Whether ``obj.mechanism()`` can report anything: not when the object names its checks
    (:class:`~privmon.audit.MechanismChecks`' ``checks``, or those of the
    :class:`~privmon.audit.GradientCanaries`' ``mechanism_checks``) and none is enabled."""
    if not callable(getattr(obj, "mechanism", None)):
        return False
    named = getattr(getattr(obj, "mechanism_checks", obj), "checks", None)
    return named is None or bool(named)


class CanaryAudits:
    """A monitor's canaries: ``canaries`` None, one object, or a list / tuple of them, each with
    ``scores()`` and / or ``mechanism()`` (a ValueError names the one without). Objects with
    ``scores()`` need distinct names when there are several of them (an object's ``name``, else
    its kind: :func:`privmon.report.tags.canary_source`)."""

    def __init__(self, canaries: Any) -> None:
        if canaries is None:
            given: list[Any] = []
        elif isinstance(canaries, (list, tuple)) and not any(
            callable(getattr(canaries, m, None)) for m in ("scores", "mechanism")
        ):
            given = list(canaries)
        else:
            given = [canaries]
        for obj in given:
            check_canaries(obj)
        names = [tags.canary_source(obj) for obj in given]
        if any(not n or "/" in n for n in names) or len(set(names)) < len(names):
            raise ValueError(
                f"canaries must have distinct names without '/' (its name attribute, else its "
                f"kind: gradient, records, input, mechanism), got {names}: set a distinct "
                "name on each object"
            )
        self.said: set[object] = set()  # what was said once (mechanism_audit.findings_of)
        with_scores = [callable(getattr(obj, "scores", None)) for obj in given]
        several = sum(with_scores) > 1
        runs_checks = [_runs_mechanism_checks(obj) for obj in given]
        self.sources = tuple(
            CanarySource(
                canaries=obj,
                name=name,
                tag_source=name if several else None,
                scores=scored,
                mechanism=runs,
                statistical_tests=_statistical_tests(obj) if runs else (),
            )
            for obj, name, scored, runs in zip(given, names, with_scores, runs_checks, strict=True)
        )

    def __bool__(self) -> bool:
        return bool(self.sources)

    @property
    def figures_per_check(self) -> int:
        """The certified figures the canaries add to each check (shares of ``interval_delta``):
        the one-run bounds of each object with ``scores()``."""
        return sum(len(CANARY_METHODS) * s.scores for s in self.sources)

    @property
    def alarm_tests(self) -> int:
        """The statistical tests of the objects with ``mechanism()``, at each check: each takes
        a share of the alarm's own level (``dp_alarm_delta``), not of ``interval_delta``."""
        return sum(len(s.statistical_tests) for s in self.sources)

    @property
    def setup(self) -> bool | list[str]:
        """What a saved state records of them (the ranks of a torch.distributed run compare
        it too): whether there are canaries, as before several objects and mechanism checks
        were allowed, when there is at most one object and it has ``scores()`` only; else each
        object's name with its certified figures."""
        if len(self.sources) <= 1 and not any(s.mechanism for s in self.sources):
            return bool(self.sources)
        return [
            f"{s.name}: "
            + ", ".join([*CANARY_METHODS] * s.scores + [f"{c}/{t}" for c, t in s.statistical_tests])
            + (" (mechanism)" if s.mechanism else "")
            for s in self.sources
        ]


def canary_figures(
    in_scores: Any,
    out_scores: Any,
    *,
    delta: float,
    significance: float,
    epsilon: float | None,
    step: int,
    source: str | None = None,
) -> CanaryFigures:
    """Each :data:`CANARY_METHODS` bound of the canaries' scores at ``significance`` (the share
    of the run's confidence budget this check gives each method), compared with the
    accountant's ``epsilon`` (None without an accountant) at ``delta``; ``source``: the
    canaries' name in the tags when the monitor has several."""
    scalars: dict[str, float] = {}
    messages: list[str] = []
    causes: list[str] = []
    violation = False
    for method in CANARY_METHODS:
        audit = one_run_epsilon(
            in_scores, out_scores, delta=delta, significance=significance, method=method
        )
        scalars[tags.canary_epsilon(method, source)] = audit.epsilon
        scalars[tags.canary_count(source)] = float(audit.n_canaries + audit.n_selection)
        if epsilon is not None and not math.isnan(epsilon):
            if audit.epsilon > epsilon + _TOLERANCE:
                violation = True
                label = method if source is None else f"{source}/{method}"
                messages.append(
                    f"privmon: DP violation at step {step}: the one-run canary audit ({label}) "
                    f"certifies ε ≥ {audit.epsilon:.3g} at δ = {delta:g}, above the accountant's "
                    f"ε = {epsilon:.3g}: the DP implementation or its accounting is broken (noise "
                    "dropped or applied in the wrong place, a sampling rate the accountant was not "
                    "told, …)"
                )
                causes.append(
                    f"canaries/{label}: the one-run audit certifies ε ≥ {audit.epsilon:.3g} at "
                    f"δ = {delta:g}, above the accountant's ε = {epsilon:.3g}"
                )
    return CanaryFigures(scalars, violation, tuple(messages), tuple(causes))
