"""Early stopping as the sinks and the report say it: the decision each check took
(:class:`StoppingDecision`, on :attr:`privmon.report.Report.stopping`) and what the budget did
over the run (:class:`StoppingOutcome`: the stop, a restore of earlier weights, or a run that
never stopped and the highest figure it reached), each with its sentence and its numbers, read
back from the JSON lines and the event files as plain dicts."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from privmon.report import tags

__all__ = [
    "StoppingDecision",
    "StoppingOutcome",
    "budget_text",
    "decision_from_dict",
    "parse_decision_text",
]

_TEXT = re.compile(r"^(stop|continue) at step \d+: (.+?) = \S+; budget .*?≤ (\S+), patience (\d+)")


def _num(v: float) -> str:
    return "NaN" if not math.isfinite(v) else f"{v:.4f}"


def budget_text(tag: str, threshold: float, use: str, patience: int) -> str:
    """The budget in words: ``privacy/q/histogram/lower (certified lower bound) ≤ 0.1000,
    patience 1``."""
    what = "certified lower bound" if use == "lower" else "advantage estimate"
    if tags.parse_advantage(tag) is None:
        what = "figure"
    return f"{tag} ({what}) ≤ {threshold:.4f}, patience {patience}"


@dataclass(frozen=True)
class StoppingDecision:
    """One check's early-stopping decision, taken before the report is written, so every sink
    writes it beside the figures.

    ``tag``: the figure watched (its ``use``: "lower" or "value"); ``value``: its value at this
    check (NaN: not finite, which never stops); ``threshold``: the budget; ``stop``: training
    stops (at this check, or ``stopped_step``, an earlier one); ``wait``: consecutive checks
    above the budget so far, stopping once it exceeds ``patience`` (never before ``min_checks``
    checks); ``last_within``: the step of the last check whose figure was within the budget
    (None: none yet); ``reason``: the decision in one sentence.

    Examples:
        >>> from privmon.report.stopping import StoppingDecision
        >>> d = StoppingDecision(tag="privacy/q/histogram/lower", use="lower", threshold=0.1,
        ...                      value=0.2, stop=True, wait=2, patience=1, min_checks=1,
        ...                      stopped_step=300, last_within=100, reason="above the budget")
        >>> d.scalars()["privacy/stopping/stop"], d.word
        (1.0, 'stop')
    """

    tag: str
    use: str
    threshold: float
    value: float
    stop: bool
    wait: int
    patience: int
    min_checks: int
    stopped_step: int | None
    last_within: int | None
    reason: str

    @property
    def word(self) -> str:
        """``"stop"`` or ``"continue"``."""
        return "stop" if self.stop else "continue"

    def scalars(self) -> dict[str, float]:
        """The decision's numbers, added to the check's scalars (every numeric logger gets them):
        the threshold, the watched figure, the stop flag (1 from the stop on) and the wait."""
        return {
            tags.STOPPING_THRESHOLD: float(self.threshold),
            tags.STOPPING_FIGURE: float(self.value),
            tags.STOPPING_STOP: float(self.stop),
            tags.STOPPING_WAIT: float(self.wait),
        }

    def text(self, step: int) -> str:
        """The decision in words for a text log: ``stop at step 300: <tag> = 0.2000 …``."""
        return (
            f"{self.word} at step {step}: {self.tag} = {_num(self.value)}; budget "
            f"{budget_text(self.tag, self.threshold, self.use, self.patience)}; {self.reason}"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (the JSON lines' ``stopping``)."""
        out = dataclasses.asdict(self)
        out["decision"] = self.word
        return out


def decision_from_dict(d: dict[str, Any]) -> StoppingDecision:
    """A :class:`StoppingDecision` from :meth:`StoppingDecision.to_json` (NaN for a null
    value)."""
    fields = {f.name for f in dataclasses.fields(StoppingDecision)}
    kw = {k: v for k, v in d.items() if k in fields}
    if kw.get("value") is None:
        kw["value"] = math.nan
    return StoppingDecision(**kw)


def parse_decision_text(text: str) -> dict[str, Any]:
    """What :meth:`StoppingDecision.text` wrote, read back from an event file: the decision,
    the figure's tag, the threshold and the patience (``{}`` for another text).

    Examples:
        >>> from privmon.report.stopping import parse_decision_text
        >>> parse_decision_text("stop at step 3: privacy/q/kde/lower = 0.3000; budget privacy/q/"
        ...                     "kde/lower (certified lower bound) ≤ 0.2000, patience 1; …")
        {'decision': 'stop', 'tag': 'privacy/q/kde/lower', 'threshold': 0.2, 'patience': 1}
    """
    m = _TEXT.match(text)
    if m is None:
        return {}
    return {
        "decision": m.group(1),
        "tag": m.group(2),
        "threshold": float(m.group(3)),
        "patience": int(m.group(4)),
    }


@dataclass(frozen=True)
class StoppingOutcome:
    """What the budget did over a run: said by ``monitor.close()`` (console and sinks), and when
    an adapter restored earlier weights (``monitor.say_restored``).

    ``stopped_step``, ``stopped_value``, ``stopped_wait``, ``reason``: the stop (None: the
    budget never stopped the run; the wait: the consecutive checks above the budget);
    ``highest`` at ``highest_step``: the highest value the watched figure reached (NaN, None: no
    finite value); ``restored_step``: the check whose weights were restored after the stop
    (None: none were); ``checks``: the checks early stopping saw.

    Examples:
        >>> from privmon.report.stopping import StoppingOutcome
        >>> o = StoppingOutcome(run_id="3f2a", tag="privacy/q/histogram/lower", use="lower",
        ...                     threshold=0.15, patience=1, checks=60, stopped_step=None,
        ...                     stopped_value=None, reason=None, highest=0.12, highest_step=2650)
        >>> print(o.sentence())  # doctest: +NORMALIZE_WHITESPACE
        Early stopping never fired over 60 checks: budget privacy/q/histogram/lower
        (certified lower bound) ≤ 0.1500, patience 1; the highest certified figure was 0.1200,
        at step 2650.
    """

    run_id: str
    tag: str
    use: str
    threshold: float
    patience: int
    checks: int
    stopped_step: int | None
    stopped_value: float | None
    reason: str | None
    highest: float
    highest_step: int | None
    restored_step: int | None = None
    stopped_wait: int | None = None

    def sentence(self) -> str:
        """The outcome in one or two sentences (the console's, the sinks' and the verdict's)."""
        budget = budget_text(self.tag, self.threshold, self.use, self.patience)
        what = "certified figure" if self.use == "lower" else "figure (an estimate, not a bound)"
        if self.highest_step is not None and math.isfinite(self.highest):
            peak = f"the highest {what} was {self.highest:.4f}, at step {self.highest_step}"
        else:
            peak = "the figure was never finite"
        if self.stopped_step is None:
            return f"Early stopping never fired over {self.checks} checks: budget {budget}; {peak}."
        value = "" if self.stopped_value is None else f" = {self.stopped_value:.4f}"
        waited = (
            "" if self.stopped_wait is None else f" for {self.stopped_wait} consecutive check(s)"
        )
        text = (
            f"Early stopping stopped training at step {self.stopped_step}: {self.tag}{value}, "
            f"above the budget{waited} (budget {budget})."
        )
        if self.restored_step is not None:
            text += f" The weights of step {self.restored_step} were restored."
        return text

    def scalars(self) -> dict[str, float]:
        """The outcome's numbers for numeric loggers: stopped (0/1), the stop's step, and the
        highest figure and its step (NaN where none)."""
        nan = math.nan
        return {
            tags.STOPPING_STOPPED: float(self.stopped_step is not None),
            tags.STOPPING_STOPPED_STEP: nan if self.stopped_step is None else self.stopped_step,
            tags.STOPPING_HIGHEST: self.highest,
            tags.STOPPING_HIGHEST_STEP: nan if self.highest_step is None else self.highest_step,
            tags.STOPPING_RESTORED_STEP: nan if self.restored_step is None else self.restored_step,
        }

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field and the sentence (a JSON line of its own)."""
        return {**dataclasses.asdict(self), "sentence": self.sentence()}
