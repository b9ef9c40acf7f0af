"""What the DP mechanism checks found at a check: one finding per test of one assumption the
accountant makes (Poisson batches at rate q from N records, each per-sample gradient clipped to
C, the sum plus N(0, σ²C²) noise, T steps, nothing else touching the weights). The hooks of
:class:`~privmon.audit.GradientCanaries` collect the evidence; the monitor decides the
statistical findings at its share of the alarm's own level (``dp_alarm_delta``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["MECHANISM_CHECKS", "MechanismFinding"]

MECHANISM_CHECKS: tuple[str, ...] = ("clipping", "noise", "sampling", "steps", "ledger")
"""The mechanism checks, each switchable off by name (``GradientCanaries(checks=...)``)."""


@dataclass(frozen=True)
class MechanismFinding:
    """One test of one assumption of the accountant, over the run so far.

    ``check`` is one of :data:`MECHANISM_CHECKS`; ``test`` names the test within it (e.g.
    ``"probe"``, ``"variance"``, ``"repeat"``, ``"mean"``, ``"dispersion"``, ``"count"``,
    ``"weights"``). A ``"deterministic"`` test never fails on a correct run: ``fired`` is its
    outcome and ``p_value`` is None. A ``"statistical"`` test gives the p-value of "the
    mechanism is as accounted" (``fired`` is False: the caller decides at its level).
    ``evidence`` is the sentence to show when it fires, e.g. "clipping: a row of norm 100
    contributed 100.0, above C = 1.0". ``undecided``: the test could not be decided (its
    check stopped when one of its hooks raised; ``evidence`` says why): it neither fired nor
    passed.

    Examples:
        >>> from privmon.audit import MechanismFinding
        >>> finding = MechanismFinding(
        ...     "steps", "count", "deterministic", True, None,
        ...     "steps: the accountant counted 200 noised steps, 400 were taken",
        ... )
        >>> finding.fired, finding.evidence.split(":")[0]
        (True, 'steps')
    """

    check: str
    test: str
    kind: Literal["deterministic", "statistical"]
    fired: bool
    p_value: float | None
    evidence: str
    undecided: bool = False
