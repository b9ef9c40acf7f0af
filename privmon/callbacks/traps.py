"""The traps a run falls into without a word, said out loud: each as a ``UserWarning`` and a
line in the ``privmon`` log, once per monitor.

- member and non-member sets that share records (identical sets are refused: every figure
  would read "no leak"), found by content digests of the records the first check audits;
- a run that closes with no check (``step(epoch)`` instead of the global step);
- every check failing (a broken query, a model in another dtype): said at the first failure;
- members scoring as non-members on a query that knows its direction (sets swapped?);
- early stopping watching a figure the reports do not have;
- a new monitor first called past its first due step (a resumed run that did not load the
  monitor's state restarts the run's confidence budget);
- steps that come before the last checked one (no check until they pass it);
- a check called while another runs (refused).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from privmon._failure import Failure
from privmon.callbacks.user_frame import stacklevel_to_user

__all__ = ["SWAP_Z", "Traps", "audit_overlap", "finite_rows", "swapped_sets_alarm"]

logger = logging.getLogger("privmon")

SWAP_Z = 4.0
"""How many null standard deviations below ½ an AUC must lie for :func:`swapped_sets_alarm`."""


def swapped_sets_alarm(auc: float, n_members: int, n_nonmembers: int) -> bool:
    """True when an AUC, oriented by the query's known direction, lies more than
    :data:`SWAP_Z` standard deviations below ½ under the null of exchangeable sets: the
    Mann–Whitney variance (n₁ + n₂ + 1) / (12 n₁ n₂) without ties (ties only shrink it, so
    the alarm is conservative for discrete scores). False rate per check under the null: about
    3e-5 (normal tail; ``benchmarks/swapped_sets.py`` measures it with its power)."""
    if n_members < 1 or n_nonmembers < 1 or not math.isfinite(auc):
        return False
    sd = math.sqrt((n_members + n_nonmembers + 1) / (12.0 * n_members * n_nonmembers))
    return auc < 0.5 - SWAP_Z * sd


def audit_overlap(members: list[bytes], nonmembers: list[bytes]) -> tuple[int, bool]:
    """How many non-member records also appear among the members (by digest), and whether the
    two sets hold exactly the same records."""
    member_set = set(members)
    shared = sum(d in member_set for d in nonmembers)
    identical = len(members) == len(nonmembers) and member_set == set(nonmembers)
    return shared, identical


def finite_rows(scores: torch.Tensor) -> int:
    """How many records (rows) of ``scores`` hold only finite values: those an analysis keeps."""
    return int(torch.isfinite(scores.reshape(scores.shape[0], -1)).all(dim=1).sum())


class Traps:
    """The traps one monitor watches for, and what it has already said (each trap once)."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self.steps_seen = 0
        self.first_step: int | None = None
        self.last_step_seen: int | None = None
        self.overlap_checked = False
        self.identical: str | None = None  # the error every check raises once sets matched
        self.stopping_checked = False  # early stopping's figure, at the first report of queries

    def warn_once(self, key: str, message: str) -> None:
        """Warn (``UserWarning``, pointing at the user's line) and log ``message`` unless the
        trap ``key`` was said."""
        if key in self._said:
            return
        self._said.add(key)
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=stacklevel_to_user())

    def saw_step(self, step: int, *, every_n_steps: int, fresh: bool) -> None:
        """Count a ``step()`` call; the first one of a ``fresh`` monitor (no check run or
        loaded) past its first due step suggests a resumed run that did not load its state."""
        if self.first_step is None:
            self.first_step = step
            if fresh and step > every_n_steps:
                self.warn_once(
                    "resumed",
                    f"privmon: the first step this monitor sees is {step}, past every_n_steps="
                    f"{every_n_steps}: if the run resumes from a checkpoint, call "
                    "monitor.load_state_dict(saved) before it goes on — a new monitor restarts "
                    "the run's confidence budget (interval_delta), and its certified figures "
                    "then hold for each part of the run, not for the whole run",
                )
        self.steps_seen += 1
        self.last_step_seen = step

    def step_before_last_check(self, step: int, last: int | None) -> None:
        """A due step before the last checked one (``last``): no check until the steps pass it
        (said once: a training loop repeats it)."""
        if last is None or step >= last:
            return
        self.warn_once(
            "behind",
            f"privmon: step {step} comes before the last checked step {last}: no check until the "
            "steps pass it (was training restarted without monitor.load_state_dict, or the "
            "state loaded from another run?)",
        )

    def at_close(self, *, checked: bool, every_n_steps: int) -> None:
        """At ``close()``: say so when the run ran no check at all."""
        if checked:
            return
        if self.first_step is None:
            seen = "neither step() nor check() was called"
        else:
            seen = (
                f"step() was called {self.steps_seen} times, with steps {self.first_step} to "
                f"{self.last_step_seen}, and none was a multiple of every_n_steps="
                f"{every_n_steps}: pass step() the global step (batches so far), not the epoch, "
                "or lower every_n_steps"
            )
        message = f"privmon: the run closes with no privacy check: {seen}"
        self.warn_once("no check", message)

    def check_refused(self, step: int, *, strict: bool) -> None:
        """A check called while another runs in the process (two threads, or from inside a
        query): a RuntimeError when ``strict``, else an error in the log."""
        message = (
            f"privmon: the check at step {step} is refused: another check is running "
            "in this process (check() called from two threads, or from inside a query)"
        )
        if strict:
            raise RuntimeError(message)
        logger.error(message)

    def check_failed(self, step: int, error: str) -> None:
        """The first failed check of a run none of whose checks has succeeded yet."""
        self.warn_once(
            "failing",
            f"privmon: the privacy check at step {step} failed and was skipped ({error}). "
            "Training goes on, but a run whose every check fails measures nothing "
            "(last_report stays None): the traceback is in the 'privmon' log; pass strict=True "
            "to raise the error where it happens",
        )

    def check_directions(
        self,
        step: int,
        queries: Sequence[Any],
        results: Mapping[str, Any],
        scores: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Say so when a query of known direction (``higher_is_member``) ranks members below
        non-members far beyond chance (:func:`swapped_sets_alarm`): by the AUC of its figures in
        ``results`` (a query's figures, or why it failed) and its ``scores``' finite rows."""
        for q in queries:
            higher_is_member = getattr(q, "higher_is_member", None)
            result = results[q.name]
            auc = None if isinstance(result, Failure) else result.roc.get("auc")
            if higher_is_member is None or auc is None:
                continue
            n1, n2 = (finite_rows(s) for s in scores[q.name])
            if not swapped_sets_alarm(auc, n1, n2):
                continue
            direction = "higher" if higher_is_member else "lower"
            self.warn_once(
                "swapped",
                f"privmon: query {q.name!r} ranks members below non-members: AUC {auc:.3f} at "
                f"step {step}, far below 0.5 for {n1} members and {n2} non-members, although "
                f"{direction} scores mean member for it. Are members and nonmembers swapped? (A "
                "held-out set from another distribution, easier than the training records, does "
                "this too.)",
            )

    def queries_failed(self, step: int, failures: Mapping[str, str]) -> None:
        """The first check whose every query failed, whose report holds the canaries' figures
        only (they need no audit set)."""
        why = "; ".join(f"{k}: {e}" for k, e in failures.items())
        self.warn_once(
            "queries failed",
            f"privmon: every query failed at step {step} ({why}): "
            "its report holds only the canaries' figures (their DP alarm still holds); the "
            "tracebacks are in the 'privmon' log",
        )

    def check_stopping_figure(self, stopping: Any, scalars: dict[str, float], *, strict: bool):
        """At the first report, say loudly when early stopping (``stopping``) watches a figure
        the report's ``scalars`` lack: a typo in the metric would otherwise switch the privacy
        budget off, check after check. An error with ``strict``, else an error log and a
        warning."""
        self.stopping_checked = True
        try:
            stopping.figure(scalars)
        except KeyError as err:
            message = f"privmon: early stopping can never fire: {err.args[0]}"
            if strict:
                raise ValueError(message) from None
            logger.error(message)
            warnings.warn(message, UserWarning, stacklevel=stacklevel_to_user())

    def check_overlap(self, digests: tuple[list[bytes], list[bytes]] | None) -> None:
        """At the first check that digested its records: refuse identical sets (every later
        check raises too), warn when they share records."""
        if digests is None:
            return
        self.overlap_checked = True
        members, nonmembers = digests
        shared, identical = audit_overlap(members, nonmembers)
        if identical:
            self.identical = (
                f"privmon: members and nonmembers hold the same {len(members)} records "
                "(matched by content): every figure would read no leak. Pass training records "
                "as members and held-out records as nonmembers"
            )
        elif shared:
            self.warn_once(
                "overlap",
                f"privmon: {shared} of the {len(nonmembers)} non-member records also appear "
                f"among the {len(members)} members (matched by content: input and label): the "
                "audit compares the sets with themselves in part, which biases every figure "
                "towards no leak. Audit with disjoint sets",
            )
