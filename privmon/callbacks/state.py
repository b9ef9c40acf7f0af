"""A monitor's saved state: one flat, versioned dict of tensors and plain values (loads with
``torch.load(..., weights_only=True)``), checked whole before any of it is applied.

Fields (:data:`STATE_VERSION` 3): ``state_version``; the setup the figures were measured under
(:data:`SETUP_FIELDS`: ``queries``, ``methods``, ``prior``, ``interval_delta``, ``dp_alarm_delta``,
``planned_checks``, ``canaries``); the run (``run_id``, ``last_step``, ``stop``, ``n_failed``,
``n_certified_checks``); and the states of the history, early stopping, the record tracker and
the loss traces (``history``, ``early_stopping``, ``records``, ``loss_traces``); and
``digest``, over all of them: a state whose content changed (a damaged file) is refused. A
state of another version — version 2, saved before the DP alarm had its own level (its
mechanism checks spent ``interval_delta``) and before states carried loss traces, version 1,
saved before states carried a digest, and one saved before states carried a version — is
refused with a ValueError naming both versions.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from typing import Any

from privmon._digest import DIGEST_KEY, check_sealed, sealed
from privmon._validation import check_int
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.history import ReportHistory
from privmon.callbacks.loss_tracking import LossTracing
from privmon.callbacks.records import RecordTracker

__all__ = [
    "SETUP_FIELDS",
    "STATE_VERSION",
    "SavedRun",
    "read_state",
    "settings",
    "setup",
    "state_dict",
]

logger = logging.getLogger("privmon")

STATE_VERSION = 3
"""The version of the saved state's fields this privmon writes and reads."""

SETUP_FIELDS = (
    "queries",
    "methods",
    "prior",
    "interval_delta",
    "dp_alarm_delta",
    "planned_checks",
    "canaries",
)
"""What a state's figures were measured under: a state loads only into the same setup."""

_SAVED_BEFORE = {  # what an older version lacks
    1: " (saved before states carried a digest)",
    2: " (saved before the DP alarm had its own level, dp_alarm_delta: its statistical tests "
    "spent interval_delta, so its figures were decided otherwise; and before states carried "
    "loss traces)",
}
_RUN_FIELDS = ("run_id", "last_step", "stop", "n_failed", "n_certified_checks")
_PARTS = ("history", "early_stopping", "records", "loss_traces")
_FIELDS = ("state_version", *SETUP_FIELDS, *_RUN_FIELDS, *_PARTS, DIGEST_KEY)


def setup(
    *,
    queries: list[str],
    methods: tuple[str, ...],
    prior: float,
    interval_delta: float,
    dp_alarm_delta: float,
    planned_checks: int | None,
    canaries: bool | list[str],
) -> dict[str, Any]:
    """The :data:`SETUP_FIELDS` of a monitor (``canaries``: whether it audits canaries, which
    take a share of every check's δ; with several canaries objects or mechanism checks, each
    object's name and certified figures and statistical tests:
    :attr:`~privmon.callbacks.canary_audit.CanaryAudits.setup`)."""
    return {
        "queries": queries,
        "methods": list(methods),
        "prior": prior,
        "interval_delta": interval_delta,
        "dp_alarm_delta": dp_alarm_delta,
        "planned_checks": planned_checks,
        "canaries": canaries,
    }


def settings(
    measured_under: dict[str, Any],
    *,
    every_n_steps: int,
    top_k: int,
    delta: float | None,
    queries: list[Any],
    stopping: PrivacyEarlyStopping | None,
    traces: LossTracing | None = None,
) -> str:
    """Whatever changes a check's figures, which the ranks of a torch.distributed run compare
    before any scores move: the setup (:func:`setup`), the schedule (ranks that differ never
    meet in a check), ``top_k``, the DP δ (None without an accountant), each query's kind and
    early stopping's budget (rank 0 decides, and every rank takes its decision and state) and
    the loss traces' setup (rank 0 merges the ranks' traces)."""
    return repr(
        {
            **measured_under,
            "every_n_steps": every_n_steps,
            "top_k": top_k,
            "delta": delta,
            "early_stopping": None
            if stopping is None
            else (
                stopping.metric,
                stopping.use,
                stopping.threshold,
                stopping.patience,
                stopping.min_checks,
            ),
            "loss_traces": None if traces is None else traces.setup(),
            "kinds": [
                (getattr(q, "discrete", False), getattr(q, "higher_is_member", None))
                for q in queries
            ],
        }
    )


def state_dict(
    measured_under: dict[str, Any],
    *,
    run_id: str,
    last_step: int | None,
    stop: bool,
    n_failed: int,
    n_certified_checks: int,
    history: ReportHistory,
    early_stopping: PrivacyEarlyStopping | None,
    records: RecordTracker,
    loss_traces: LossTracing | None = None,
) -> dict[str, Any]:
    """The saved state of a monitor set up as ``measured_under`` (:func:`setup`), sealed
    with the digest of its content."""
    return sealed(
        {
            "state_version": STATE_VERSION,
            **measured_under,
            "run_id": run_id,
            "last_step": last_step,
            "stop": stop,
            "n_failed": n_failed,
            "n_certified_checks": n_certified_checks,
            "history": history.state_dict(),
            "early_stopping": None if early_stopping is None else early_stopping.state_dict(),
            "records": records.state_dict(),
            "loss_traces": None if loss_traces is None else loss_traces.state_dict(),
        }
    )


@dataclass(frozen=True)
class SavedRun:
    """A saved state's run, every field checked: what a monitor applies to resume it."""

    run_id: str
    planned_checks: int | None
    last_step: int | None
    stop: bool
    n_failed: int
    n_certified_checks: int
    history: ReportHistory
    records: RecordTracker
    early_stopping: dict[str, Any] | None
    loss_traces: dict[str, Any] | None = None


def _checked_whole(state: Any) -> dict[str, Any]:
    """``state`` after checking its version, its digest (any changed byte) and its fields."""
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    version = state.get("state_version")
    if version != STATE_VERSION:
        saved = (
            "no state_version (saved by a privmon before states carried one)"
            if version is None
            else f"state_version {version!r}"
            + _SAVED_BEFORE.get(version if isinstance(version, int) else -1, "")
        )
        raise ValueError(
            f"state has {saved}; this privmon reads state_version {STATE_VERSION} only: resume "
            "it with the privmon that saved it, or start the run's monitoring afresh"
        )
    check_sealed(state, what="state")
    unknown = sorted(set(state) - set(_FIELDS))
    if unknown:
        raise ValueError(
            "state was saved by a newer privmon, with fields this one does not know "
            f"({', '.join(unknown)}): resume it with that version"
        )
    missing = [key for key in _FIELDS if key not in state]
    if missing:
        raise ValueError(f"state lacks {missing}: is it a PrivacyMonitor.state_dict()?")
    return state


def _checked_setup(state: dict[str, Any], mine: dict[str, Any], *, user_planned: bool) -> None:
    """Refuse a saved setup that differs from this monitor's, naming the fields that differ;
    ``planned_checks`` is compared only when this monitor was given one."""
    if not user_planned:  # a plan not given by the user: the saved run's plan goes on
        mine = {k: v for k, v in mine.items() if k != "planned_checks"}
    diff = {k: (state[k], v) for k, v in mine.items() if state[k] != v}
    if diff:
        raise ValueError(
            "state was saved by a monitor with another setup (saved, this monitor): "
            + ", ".join(f"{k}: {a!r} != {b!r}" for k, (a, b) in diff.items())
        )


def _checked_last_step(last_step: Any, history: ReportHistory, n_failed: int) -> int | None:
    """A saved ``last_step``, checked against the checks the state ran: every check sets it,
    so it is None only before the first check kept, and equals the last kept check's step
    when no check failed (a larger one would switch monitoring off until the steps pass it)."""
    if last_step is None:
        if history:
            raise ValueError(f"state last_step is None, but the state holds {len(history)} checks")
        return None
    last_step = check_int(last_step, name="state last_step")
    if not history and not n_failed:
        raise ValueError(f"state last_step is {last_step}, but the state ran no check")
    if history and not n_failed and last_step != int(history.steps[-1]):
        raise ValueError(
            f"state last_step ({last_step}) differs from its last check's step "
            f"({int(history.steps[-1])}), although no check failed"
        )
    return last_step


def _checked_parts(
    state: dict[str, Any],
    early_stopping: PrivacyEarlyStopping | None,
    loss_traces: LossTracing | None,
) -> tuple[Any, Any]:
    """The saved states of early stopping and of the loss traces, each checked by loading it
    into a copy of the monitor's (both present, or neither)."""
    for key, mine, what in (
        ("early_stopping", early_stopping, "early stopping is set"),
        ("loss_traces", loss_traces, "loss traces are kept"),
    ):
        if (state[key] is None) != (mine is None):
            raise ValueError(f"state_dict and monitor disagree on whether {what}")
        if mine is not None:
            copy.deepcopy(mine).load_state_dict(state[key])  # raises on a bad field
    return state["early_stopping"], state["loss_traces"]


def read_state(
    state: Any,
    *,
    measured_under: dict[str, Any],
    user_planned: bool,
    early_stopping: PrivacyEarlyStopping | None,
    loss_traces: LossTracing | None = None,
) -> SavedRun:
    """Every field of ``state`` checked, on its own and against the others, for a monitor set
    up as ``measured_under`` (:func:`setup`; ``user_planned``: its ``planned_checks`` was given,
    else the saved plan is taken) with ``early_stopping`` and ``loss_traces``: a ValueError
    names the first field
    that does not fit. A certified-check count above the checks the state ran warns (looser
    bounds from then on)."""
    state = _checked_whole(state)
    _checked_setup(state, measured_under, user_planned=user_planned)
    planned = measured_under["planned_checks"]
    if not user_planned:
        planned = state["planned_checks"]
        if planned is not None:
            planned = check_int(planned, name="state planned_checks", minimum=1)
    history = ReportHistory.from_state_dict(state["history"])
    if not isinstance(state["stop"], bool):
        raise ValueError(f"state stop must be True or False, got {state['stop']!r}")
    n_failed = check_int(state["n_failed"], name="state n_failed")
    last_step = _checked_last_step(state["last_step"], history, n_failed)
    # a resumed run goes on spending where it stopped
    n_certified = check_int(state["n_certified_checks"], name="state n_certified_checks")
    if n_certified < len(history):
        raise ValueError(
            f"state n_certified_checks ({n_certified}) is below its {len(history)} checks"
        )
    es, traces = _checked_parts(state, early_stopping, loss_traces)
    records = RecordTracker()
    records.load_state_dict(state["records"])
    run_id = state["run_id"]
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"state run_id must be a non-empty string, got {run_id!r}")
    if n_certified > len(history) + n_failed:
        # a rank that went on from another rank's count gets here; a crafted count too
        message = (
            f"privmon: the state's n_certified_checks ({n_certified}) exceeds the "
            f"{len(history) + n_failed} checks it ran: every later check certifies at a "
            "smaller share of interval_delta, so its lower bounds are looser (still valid). "
            "Expected only after a torch.distributed run whose ranks restored different states"
        )
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=3)
    return SavedRun(
        run_id=run_id,
        planned_checks=planned,
        last_step=last_step,
        stop=state["stop"],
        n_failed=n_failed,
        n_certified_checks=n_certified,
        history=history,
        records=records,
        early_stopping=es,
        loss_traces=traces,
    )
