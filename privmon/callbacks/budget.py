"""The run's confidence budget, and what it can certify.

Check k certifies each of its figures at its share δ_k of ``interval_delta``
(:mod:`privmon.estimators.spending`: evenly over the planned checks when the run's length is known,
else the sequence for runs of unknown length), split evenly over its certified figures — one per
query and method it applies to, one per canary bound of each canaries object — so that every figure
called certified holds over the whole run (union bound). The statistical tests of the DP mechanism
checks spend the alarm's own level, ``dp_alarm_delta``, the same way: its share at check k, split
evenly over the check's statistical tests (:meth:`CertificationBudget.alarm_level`), so that a false
"DP violation" from any of them over the whole run has probability at most ``dp_alarm_delta``. What
that share detects at a query's audit sizes
(:func:`~privmon.estimators.certificate.detectable_advantage`) is said at construction and at the
first check, with a warning when early stopping watches a bound that cannot reach its threshold, and
once when a run outlives its planned checks.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch.utils.data import DataLoader

from privmon._failure import Failure
from privmon._process_group import rank_and_world
from privmon._validation import check_int, check_open_unit
from privmon.callbacks.traps import Traps, finite_rows
from privmon.estimators.certificate import audit_records_needed, detectable_advantage
from privmon.estimators.methods import applicable_methods
from privmon.estimators.spending import OVERFLOW_SHARE, check_delta
from privmon.queries.batches import count_records
from privmon.report import tags

__all__ = ["CertificationBudget", "detectable", "expected_records"]

logger = logging.getLogger("privmon")


@functools.lru_cache(maxsize=256)
def detectable(
    n_members: int,
    n_nonmembers: int,
    *,
    delta: float,
    prior: float,
    dim: int,
    threshold: float | None = None,
    power: float = 0.5,
) -> float:
    """:func:`~privmon.estimators.certificate.detectable_advantage`, kept: a run with planned
    checks asks the same question at every check (the split bound's search takes seconds at
    100 000 records)."""
    return detectable_advantage(
        n_members,
        n_nonmembers,
        delta=delta,
        prior=prior,
        threshold=threshold,
        power=power,
        dim=dim,
    )


def expected_records(data: Any, max_batches: int | None) -> int | None:
    """How many records a check will audit of an audit set, known before it runs: a DataLoader's
    sampler length (its full batches only with ``drop_last``; at most ``max_batches`` batches),
    or the rows of a sequence of batches; None when that is unknown (an iterable dataset, a
    custom batch sampler, batches whose rows cannot be read)."""
    if isinstance(data, DataLoader):
        if data.batch_size is None:  # a custom batch sampler: batch sizes unknown
            return None
        try:
            records, batches = len(cast(Any, data.sampler)), len(data)
        except TypeError:  # an iterable dataset
            return None
        if max_batches is not None:
            batches = min(batches, max_batches)
        full = batches * data.batch_size
        return full if data.drop_last else min(records, full)
    if isinstance(data, Sequence):
        counts = [count_records(batch) for batch in itertools.islice(data, max_batches)]
        return None if any(c is None for c in counts) else sum(cast(list[int], counts))
    return None


class CertificationBudget:
    """How a monitor spends ``interval_delta`` (and the alarm's ``dp_alarm_delta``) over its
    checks, and what each check can certify.

    Args:
        queries: the monitor's queries (their ``name`` and ``discrete``).
        methods: the advantage estimators of each query.
        canary_figures: the canaries' certified figures per check, their ε bounds (0: none).
        alarm_tests: the statistical tests of the DP mechanism checks per check (0: none).
        prior: P(member).
        interval_delta: the run's confidence budget.
        alarm_delta: the alarm's level over the run, spent by the statistical tests.
        planned_checks: the checks the run is expected to have (None: unknown).
        audit_sets: the members and non-members, whose records a check will audit are known
            before any check when they have a length (:func:`expected_records`; not under
            torch.distributed, where a rank's shard is not the audit set).
        max_batches: at most this many batches of each set per check.
        traps: where the warnings said once go.
    """

    def __init__(
        self,
        *,
        queries: Sequence[Any],
        methods: Sequence[str],
        canary_figures: int,
        alarm_tests: int,
        prior: float,
        interval_delta: float,
        alarm_delta: float,
        planned_checks: int | None,
        audit_sets: tuple[Any, Any],
        max_batches: int | None,
        traps: Traps,
    ) -> None:
        self.queries, self.methods, self.canary_figures = queries, methods, canary_figures
        self.prior, self.interval_delta = prior, interval_delta
        self.alarm_tests, self.alarm_delta = alarm_tests, alarm_delta
        self.planned_checks = planned_checks
        self.user_planned = planned_checks is not None  # never changed by plan()
        self.planned_steps: int | None = None  # the run length plan() was given
        self.spent = 0  # checks that spent a share of interval_delta
        # query -> (members, non-members, dimensions) of its last check's finite scores
        self.audit_sizes: dict[str, tuple[int, int, int]] = {}
        # before any check: the records the loaders will yield (one process only)
        self.expected_sizes: tuple[int, int] | None = None
        if rank_and_world()[1] == 1:
            n1, n2 = (expected_records(data, max_batches) for data in audit_sets)
            if n1 and n2:
                self.expected_sizes = (n1, n2)
        self._traps = traps

    def figures_per_check(self) -> int:
        """Certified figures per check: one per query and method it applies to, and the
        canaries' bounds."""
        return self.canary_figures + sum(
            len(applicable_methods(self.methods, discrete=getattr(q, "discrete", False)))
            for q in self.queries
        )

    def certify_delta(self, k: int) -> float:
        """The δ check ``k`` certifies each of its figures at."""
        share = check_delta(k, delta=self.interval_delta, planned_checks=self.planned_checks)
        return share / self.figures_per_check()

    def alarm_level(self, k: int) -> float:
        """The level each statistical test of the DP mechanism checks fires at, at check ``k``:
        the check's share of ``alarm_delta``, spent as ``interval_delta`` is, split evenly over
        its statistical tests."""
        share = check_delta(k, delta=self.alarm_delta, planned_checks=self.planned_checks)
        return share / max(self.alarm_tests, 1)

    def sizes(self, query: str) -> tuple[int, int, int] | None:
        """(members, non-members, dimensions) of ``query``'s audit: its last check's, else the
        loaders' expected records for 1-D scores; None when unknown."""
        if query in self.audit_sizes:
            return self.audit_sizes[query]
        if self.expected_sizes is None:
            return None
        return (*self.expected_sizes, 1)

    def audited(
        self,
        results: Mapping[str, Any],
        scores: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        delta: float,
    ) -> dict[str, float]:
        """After a check: keep the audit sizes of each query it analysed (``results``: a query's
        figures, or why it failed) — its records with finite ``scores``, its dimensions — and
        return, per such query, the smallest advantage certified in half the runs at
        ``delta``."""
        out = {}
        for name, result in results.items():
            if isinstance(result, Failure):
                continue
            n1, n2 = (finite_rows(side) for side in scores[name])
            self.audit_sizes[name] = (n1, n2, result.dim)
            out[name] = detectable(n1, n2, delta=delta, prior=self.prior, dim=result.dim)
        return out

    def plan(self, *, total_steps: int, every_n_steps: int) -> int | None:
        """:meth:`privmon.PrivacyMonitor.plan`: the checks planned for a run of ``total_steps``
        steps, one every ``every_n_steps``."""
        total_steps = check_int(total_steps, name="total_steps", minimum=1)
        planned = total_steps // every_n_steps
        self.planned_steps = total_steps
        if planned == self.planned_checks:
            return planned
        schedule = (
            f"the trainer's schedule has {planned} checks ({total_steps} steps, every_n_steps="
            f"{every_n_steps})"
        )
        if planned == 0:
            self._traps.warn_once(
                "no check due",
                f"privmon: no check is due in this run: every_n_steps={every_n_steps} is "
                f"above its {total_steps} steps; lower every_n_steps",
            )
            if not self.user_planned and self.spent == 0:
                self.planned_checks = None  # an earlier plan() no longer describes the run
        elif self.user_planned:
            self._traps.warn_once(
                "plan differs",
                f"privmon: planned_checks={self.planned_checks} is kept, but {schedule}: "
                + (
                    f"checks after check {self.planned_checks} certify at a far smaller share of "
                    "interval_delta"
                    if planned > cast(int, self.planned_checks)
                    else "every check certifies at a smaller share of interval_delta than "
                    "the schedule needs"
                ),
            )
        elif self.spent > 0:
            kept = (
                "the sequence for runs of unknown length"
                if self.planned_checks is None
                else f"planned_checks={self.planned_checks}"
            )
            self._traps.warn_once(
                "plan kept",
                f"privmon: {schedule}, but {self.spent} check(s) of this run "
                f"already certified under {kept}, which is kept: spending interval_delta "
                "another way mid-run would break the run-level guarantee",
            )
        else:
            self.planned_checks = planned
            logger.info("privmon: %s: planned_checks=%d", schedule, planned)
        return self.planned_checks

    def detectable_advantage(
        self, query: str | None, *, check: int | None, threshold: float | None, power: float
    ) -> float:
        """:meth:`privmon.PrivacyMonitor.detectable_advantage`."""
        names = [q.name for q in self.queries]
        if query is None:
            if len(names) > 1:
                raise ValueError(f"query must name one of the monitored queries {names}")
            query = names[0]
        if query not in names:
            raise ValueError(f"query must be one of {names}, got {query!r}")
        k = self.spent + 1 if check is None else check_int(check, name="check", minimum=1)
        sizes = self.sizes(query)
        if sizes is None:
            raise ValueError(
                "the audit sizes are unknown until the first check: the member or non-member "
                "set has no length (an iterable dataset, a custom batch sampler)"
            )
        n1, n2, dim = sizes
        return detectable(
            n1,
            n2,
            delta=self.certify_delta(k),
            prior=self.prior,
            dim=dim,
            threshold=threshold,
            power=check_open_unit(power, name="power"),
        )

    def say_what_can_be_certified(self, k: int, *, first: bool, stopping: Any) -> None:
        """Log what check ``k`` can certify per query (``first``: at construction and at the
        first check); warn once when check ``k`` is past the planned checks, and once when early
        stopping (``stopping``, or None) watches a certified lower bound whose threshold no
        advantage reaches at check ``k``. Unknown sizes
        say nothing; a failure here is logged, never raised."""
        try:
            watched: tuple[str, str] | None = None  # (query, tag) early stopping reads
            if stopping is not None:
                read = tags.watched_tags(stopping.metric, stopping.use)
                watched = next(
                    (
                        (q.name, tags.lower(q.name, m))
                        for q in self.queries
                        for m in self.methods
                        if tags.lower(q.name, m) in read
                    ),
                    None,
                )
            delta = self.certify_delta(k)
            self._warn_if_past_plan(k, delta)
            if first:
                parts = []
                for q in self.queries:
                    sizes = self.sizes(q.name)
                    if sizes is not None:
                        n1, n2, dim = sizes
                        a = detectable(n1, n2, delta=delta, prior=self.prior, dim=dim)
                        parts.append(
                            f"{q.name!r} ({n1} members, {n2} non-members, {dim}-D): {a:.3f}"
                        )
                if parts:
                    logger.info(
                        "privmon: the smallest advantage check %d certifies in half the runs "
                        "(δ = %.3g per certified figure, planned_checks=%s): %s",
                        k,
                        delta,
                        self.planned_checks,
                        "; ".join(parts),
                    )
            if watched is not None and stopping is not None:
                self._warn_if_out_of_reach(k, delta, stopping.threshold, *watched)
        except Exception:
            logger.exception("privmon: computing what check %s can certify failed", k)

    def _warn_if_past_plan(self, k: int, delta: float) -> None:
        """Warn once when check ``k`` is past the planned checks: from it on, each check
        certifies at a share of the 10 % of ``interval_delta`` the plan kept for checks beyond
        it, far less than a planned check's."""
        planned = self.planned_checks
        if planned is None or k <= planned:
            return
        ratio = self.certify_delta(planned) / delta
        self._traps.warn_once(
            "past plan",
            f"privmon: check {k} is past planned_checks={planned}: the plan spent "
            f"{1 - OVERFLOW_SHARE:.0%} of interval_delta over {planned} checks, so check {k} "
            f"certifies each figure at δ = {delta:.3g}, {ratio:.1f}× smaller than a planned "
            "check's, and every later check at less still: its lower bounds are looser and "
            "early stopping fires later. Give planned_checks the run's number of checks, or "
            "call monitor.plan(total_steps=...) before training",
        )

    def _warn_if_out_of_reach(
        self, k: int, delta: float, threshold: float, query: str, tag: str
    ) -> None:
        """Warn once when no advantage gets ``tag`` (a certified lower bound of ``query``) above
        early stopping's ``threshold`` in half the runs at check ``k``, with the records per
        class that would let an advantage a little above it do so."""
        sizes = self.sizes(query)
        floor = abs(2 * self.prior - 1)
        if sizes is None or threshold < floor:  # below the floor: any certified leak trips it
            return
        n1, n2, dim = sizes
        if threshold < 1 and math.isfinite(
            detectable(n1, n2, delta=delta, prior=self.prior, dim=dim, threshold=threshold)
        ):
            return
        reach = ""
        if threshold < 1:
            target = min(threshold + 0.1, (1 + threshold) / 2)
            try:
                needed = audit_records_needed(
                    target, delta=delta, prior=self.prior, threshold=threshold, dim=dim
                )
                reach = f"About {needed} records per class would let a true advantage of "
                reach += f"{target:.3g} cross it in half the runs (privmon.audit_records_needed); "
            except ValueError as err:  # beyond the records it searches
                reach = f"{str(err).capitalize()}; "
        if threshold >= 1:
            remedy = "an advantage is at most 1: lower the threshold"
        else:
            remedy = (
                f"{reach or 'Or: '}lower the threshold, add audit records, certify fewer "
                "figures per check (one method) or raise interval_delta"
            )
        self._traps.warn_once(
            "out of reach",
            f"privmon: early stopping on {tag} > {threshold:g} cannot fire at check {k}: with "
            f"{n1} members and {n2} non-members and δ = {delta:.3g} per certified figure, not "
            f"even an advantage of 1 gets a certified lower bound above {threshold:g} in half "
            f"the runs. {remedy}",
        )
