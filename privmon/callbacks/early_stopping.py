"""Privacy-aware early stopping: stop when a privacy figure stays above its budget.

The decision is the pure function :func:`stopping_decision` (Lightning EarlyStopping style); the
class only keeps the counters across checks, reads its figure from each report and says each
decision (:class:`~privmon.report.stopping.StoppingDecision`) and the run's outcome
(:class:`~privmon.report.stopping.StoppingOutcome`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from privmon._shown import shown
from privmon._validation import check_int, check_threshold
from privmon.report import tags
from privmon.report.stopping import StoppingDecision, StoppingOutcome

__all__ = ["PrivacyEarlyStopping", "stopping_decision"]

USES = ("lower", "value")
_OPTIONAL = ("last_within", "highest_value", "highest_step", "stopped_value")


def stopping_decision(
    value: float, *, threshold: float, checks_seen: int, min_checks: int, wait: int, patience: int
) -> tuple[bool, int, str | None]:
    """One early-stopping decision, in a fixed order.

    Returns (stop, new_wait, reason). The checks, in order: a non-finite figure never stops and
    leaves the wait unchanged; a figure at or below the threshold resets the wait; above it the
    wait grows and training stops once it exceeds ``patience`` — but never before ``min_checks``
    checks have been seen.

    Examples:
        >>> from privmon.callbacks import stopping_decision
        >>> stopping_decision(0.1, threshold=0.2, checks_seen=1, min_checks=1, wait=0, patience=0)
        (False, 0, None)
        >>> stop, wait, reason = stopping_decision(
        ...     0.3, threshold=0.2, checks_seen=1, min_checks=1, wait=0, patience=0
        ... )
        >>> stop, wait
        (True, 1)
        >>> print(reason)
        privacy figure 0.3000 above the budget 0.2000 for 1 consecutive check(s) (patience 0)
    """
    if not math.isfinite(value):
        return False, wait, None
    if value <= threshold:
        return False, 0, None
    wait += 1
    if checks_seen < min_checks:
        return False, wait, None
    if wait > patience:
        return (
            True,
            wait,
            (
                f"privacy figure {value:.4f} above the budget {threshold:.4f} "
                f"for {wait} consecutive check(s) (patience {patience})"
            ),
        )
    return False, wait, None


class PrivacyEarlyStopping:
    """Stop training when ``metric`` stays above ``threshold``.

    Args:
        metric: the figure to watch: a full tag (``"privacy/loss/histogram/lower"``) or its
            query and method (``"loss/histogram"``), completed with ``use``.
        threshold: the budget: stop when the figure is above it; in [0, 1] (an advantage, an
            AUC, a risk), or in [0, inf) when the figure is an ε. Outside, a budget stops at
            the first check whatever leaks (below 0) or can never fire (above 1): refused.
        use: "lower" (certified over the run: stops only on proven leakage) or "value" (the
            debiased estimate); plug-in figures are refused (biased up, they stop on noise).
            "value" is an estimate, not a bound: it stops on noise wherever the threshold lies
            within the estimate's noise of the true advantage. At the prior's floor |2p − 1|
            (0 at p = ½), which every advantage figure is at least, a run that leaks nothing
            reads above the threshold at about every other check: the monitor warns there.
            Give "value" a threshold clear of the floor and some ``patience``, or use "lower".
        patience: checks above the budget tolerated before stopping (0: stop at the first).
        min_checks: never stop before this many checks.

    Examples:
        >>> from privmon import PrivacyEarlyStopping
        >>> stopping = PrivacyEarlyStopping("loss/histogram", 0.2, patience=1)
        >>> stopping.tag  # PrivacyMonitor(..., early_stopping=stopping) feeds it every report
        'privacy/loss/histogram/lower'
        >>> [stopping.update(step, {stopping.tag: lower}) for step, lower in [(1, 0.25), (2, 0.3)]]
        [False, True]
        >>> stopping.stopped_step, stopping.wait  # two checks above 0.2 in a row
        (2, 2)
        >>> print(stopping.decide(3, {stopping.tag: 0.1}).text(3))  # doctest: +NORMALIZE_WHITESPACE
        stop at step 3: privacy/loss/histogram/lower = 0.1000; budget privacy/loss/histogram/lower
        (certified lower bound) ≤ 0.2000, patience 1; training stopped at step 2
    """

    def __init__(
        self,
        metric: str,
        threshold: float,
        *,
        use: Literal["lower", "value"] = "lower",
        patience: int = 0,
        min_checks: int = 1,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty string, got {shown(metric)}")
        if use not in USES or metric.rsplit("/", 1)[-1] in tags.PLUGIN_FIELDS:
            raise ValueError(
                f"use must be one of {USES} and metric must not name a plug-in figure "
                f"{tags.PLUGIN_FIELDS}, got use={use!r}, metric={metric!r}: the plug-in + "
                "McDiarmid figure is biased up and is not an upper bound on the advantage"
            )
        bounds = tags.valid_range(tags.watched_tags(metric, use)[0])
        threshold = check_threshold(threshold, epsilon=bounds is not None and bounds[1] == math.inf)
        for name, v in (("patience", patience), ("min_checks", min_checks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self.metric, self.threshold, self.use = metric, threshold, use
        self.patience, self.min_checks = patience, min_checks
        self.wait = 0
        self.checks_seen = 0
        self.stopped_step: int | None = None
        self.reason: str | None = None
        self.last_within: int | None = None  # the last check whose figure was within the budget
        self.highest: tuple[float, int] | None = None  # the figure's highest value and its step
        self.stopped_value: float | None = None  # the figure at the stop
        self.decision: StoppingDecision | None = None  # the last check's

    @property
    def tag(self) -> str:
        """The full scalar tag watched, e.g. ``"privacy/loss/histogram/lower"``."""
        return tags.watched_tags(self.metric, self.use)[0]

    def figure(self, scalars: dict[str, float]) -> float:
        """The watched figure from a report's scalars (the tag, or ``privacy/<metric>``)."""
        for tag in tags.watched_tags(self.metric, self.use):
            if tag in scalars:
                return float(scalars[tag])
        raise KeyError(
            f"early stopping metric {self.tag!r} is not among the report's scalars; "
            f"available: {sorted(scalars)[:20]}"
        )

    def update(self, step: int, scalars: dict[str, float]) -> bool:
        """Feed one check's scalars; True when training should stop (stays True once stopped).
        The decision, with the figure, the budget and why, is then :attr:`decision`."""
        self.decision = self._decide(step, scalars)
        return self.decision.stop

    def decide(self, step: int, scalars: dict[str, float]) -> StoppingDecision:
        """Feed one check's scalars (:meth:`update`); the check's decision (``.stop``: training
        should stop, and stays stopped once it has), with the figure, the budget and why."""
        self.update(step, scalars)
        assert self.decision is not None
        return self.decision

    def _decide(self, step: int, scalars: dict[str, float]) -> StoppingDecision:
        value = self.figure(scalars)
        if self.stopped_step is None:
            self.checks_seen += 1
            stop, self.wait, reason = stopping_decision(
                value,
                threshold=self.threshold,
                checks_seen=self.checks_seen,
                min_checks=self.min_checks,
                wait=self.wait,
                patience=self.patience,
            )
            if stop:
                self.stopped_step, self.reason = int(step), f"step {step}: {reason}"
                self.stopped_value = value
            if math.isfinite(value) and value <= self.threshold:
                self.last_within = int(step)
            if math.isfinite(value) and (self.highest is None or value > self.highest[0]):
                self.highest = (value, int(step))
            why = reason or self._why_continue(value)
        else:
            why = f"training stopped at step {self.stopped_step}"
        return StoppingDecision(
            tag=self.tag,
            use=self.use,
            threshold=self.threshold,
            value=value,
            stop=self.stopped_step is not None,
            wait=self.wait,
            patience=self.patience,
            min_checks=self.min_checks,
            stopped_step=self.stopped_step,
            last_within=self.last_within,
            reason=why,
        )

    def _why_continue(self, value: float) -> str:
        if not math.isfinite(value):
            return "the figure is not finite: no decision, the wait unchanged"
        if value <= self.threshold:
            return "within the budget"
        if self.checks_seen < self.min_checks:
            return f"above the budget, but min_checks {self.min_checks} not yet seen"
        return f"above the budget for {self.wait} check(s), within the patience {self.patience}"

    def outcome(self, run_id: str, *, restored_step: int | None = None) -> StoppingOutcome:
        """What the budget did so far over the run: the stop (or none), the highest value the
        figure reached and its step, the restored weights' step (given by an adapter)."""
        peak, at = self.highest if self.highest is not None else (math.nan, None)
        return StoppingOutcome(
            run_id=run_id,
            tag=self.tag,
            use=self.use,
            threshold=self.threshold,
            patience=self.patience,
            checks=self.checks_seen,
            stopped_step=self.stopped_step,
            stopped_value=self.stopped_value,
            reason=self.reason,
            highest=peak,
            highest_step=at,
            restored_step=restored_step,
            stopped_wait=None if self.stopped_step is None else self.wait,
        )

    def state_dict(self) -> dict[str, Any]:
        """The configuration and the counters (checks seen, wait, where it stopped): a
        checkpoint for :meth:`load_state_dict`."""
        return {
            "metric": self.metric,
            "threshold": self.threshold,
            "use": self.use,
            "patience": self.patience,
            "min_checks": self.min_checks,
            "wait": self.wait,
            "checks_seen": self.checks_seen,
            "stopped_step": self.stopped_step,
            "reason": self.reason,
            **self._record(),
        }

    def _record(self) -> dict[str, Any]:
        """What the outcome needs (optional on load: a state saved before them lacks them)."""
        peak, at = self.highest if self.highest is not None else (None, None)
        return {
            "last_within": self.last_within,
            "highest_value": peak,
            "highest_step": at,
            "stopped_value": self.stopped_value,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters. ``metric``, ``threshold`` and ``use`` must match (another figure
        or budget would make the saved wait meaningless); ``patience`` and ``min_checks`` are
        this callback's own, so a resumed run may change them. Every field is checked before any
        is applied."""
        missing = [key for key in self.state_dict() if key not in state and key not in _OPTIONAL]
        if missing:
            raise ValueError(f"early-stopping state lacks {missing}")
        for key in ("metric", "threshold", "use"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"early-stopping state has {key}={state[key]!r}, this callback "
                    f"{getattr(self, key)!r}"
                )
        wait = check_int(state["wait"], name="early-stopping state wait")
        checks_seen = check_int(state["checks_seen"], name="early-stopping state checks_seen")
        stopped_step, reason = state["stopped_step"], state["reason"]
        if stopped_step is not None:
            stopped_step = check_int(stopped_step, name="early-stopping state stopped_step")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(
                f"early-stopping state reason must be None or a string, got {reason!r}"
            )
        record = {key: state.get(key) for key in _OPTIONAL}
        for key in ("last_within", "highest_step"):
            if record[key] is not None:
                record[key] = check_int(record[key], name=f"early-stopping state {key}")
        for key in ("highest_value", "stopped_value"):
            v = record[key]
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise ValueError(f"early-stopping state {key} must be None or a number, got {v!r}")
        self.wait, self.checks_seen = wait, checks_seen
        self.stopped_step, self.reason = stopped_step, reason
        self.last_within, self.stopped_value = record["last_within"], record["stopped_value"]
        self.highest = (
            None
            if record["highest_value"] is None or record["highest_step"] is None
            else (float(record["highest_value"]), record["highest_step"])
        )
