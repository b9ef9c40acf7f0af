"""PrivacyMonitor: audit a model's membership leakage while it trains.

One check: save every RNG and the state of every module involved (modes, buffers, gradients;
:mod:`~privmon._training_guard`); run the member and non-member batches through each query
under ``torch.no_grad()`` with the modules in eval mode, each query's output checked
(:mod:`~privmon.callbacks.collection`); restore everything; estimate the optimal
advantage per query and method, AUC and TPR at low FPR, per-record risk; read ε from the Opacus
accountant and compare with the ceilings; hand one immutable :class:`~privmon.report.Report` to
the sinks and to early stopping.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import math
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from privmon._process_group import rank_and_world
from privmon._training_guard import audit_view, begin_check, end_check, warn_if_shuffled
from privmon._validation import (
    check_audit_set,
    check_has_methods,
    check_int,
    check_open_unit,
    check_subset,
)
from privmon.bounds import epsilon_from_opacus, epsilon_lower_bound, tanh_bound
from privmon.callbacks.canary_audit import (
    CANARY_METHODS,
    CanaryFigures,
    canary_figures,
    check_canaries,
)
from privmon.callbacks.collection import collect_scores
from privmon.callbacks.distributed import (
    StepDisagreement,
    agree,
    agree_on_outcomes,
    agree_on_schedule,
    agree_on_scores,
    gather_scores,
)
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.history import ReportHistory
from privmon.callbacks.records import RankedRecords, RecordTracker
from privmon.callbacks.traps import Traps, finite_rows
from privmon.estimators.analysis import QueryResult, analyse
from privmon.estimators.certificate import audit_records_needed, detectable_advantage
from privmon.estimators.estimates import describe_error
from privmon.estimators.methods import METHODS, applicable_methods
from privmon.estimators.spending import check_delta
from privmon.queries import CallableQuery
from privmon.queries.batches import count_records
from privmon.report import Report, tags
from privmon.sinks.base import Sink

__all__ = ["PrivacyMonitor", "PrivacyViolationWarning", "Sink"]

logger = logging.getLogger("privmon")

_CANARIES = "canaries"  # the canary audit's entry among a check's outcomes and failures


class PrivacyViolationWarning(UserWarning):
    """A certified lower bound on the measured advantage exceeds the DP ceiling."""


def _as_queries(given: list[Any]) -> list[Any]:
    """The monitor's queries: :mod:`privmon.queries` queries as they are, any other callable
    ``batch -> scores`` wrapped in a :class:`~privmon.queries.CallableQuery` named by its
    ``__name__`` (lambdas: ``query``, ``query_1``, …)."""
    if not given:
        raise ValueError("query must be a query or a non-empty sequence of queries")
    out, unnamed = [], 0
    for q in given:
        if isinstance(q, nn.Module) and not isinstance(getattr(q, "name", None), str):
            raise ValueError(
                f"query is a model ({type(q).__name__}), not a query: pass what an attacker "
                "observes of it, e.g. privmon.queries.LossQuery(model), another privmon.queries "
                "query, or a function batch -> scores"
            )
        if not callable(q):
            raise ValueError(
                f"query {q!r} is not callable: pass a privmon.queries query (e.g. "
                "privmon.queries.LossQuery(model)) or any function batch -> scores"
            )
        if isinstance(getattr(q, "name", None), str):
            out.append(q)
            continue
        name = getattr(q, "__name__", "<lambda>")
        if name == "<lambda>" or not isinstance(name, str):
            name = "query" if unnamed == 0 else f"query_{unnamed}"
            unnamed += 1
        out.append(CallableQuery(q, name=name))
    return out


def _check_epsilon_readable(accountant: Any, *, delta: float) -> None:
    """Read ε once at construction: an accountant that answers with something other than a
    number is refused now rather than at every check. One that cannot answer before training
    (it raises) is left for the checks to read."""
    try:
        epsilon_from_opacus(accountant, delta=delta)
    except ValueError as err:
        raise ValueError(f"accountant: {err}") from None
    except Exception:  # e.g. no step accounted yet: the first check reads it
        logger.debug("privmon: the accountant gave no ε before training", exc_info=True)


def _violation_message(step: int, tag: str, lower: float, ceiling: float, eps: float) -> str:
    return (
        f"privmon: at step {step} the certified lower bound on the membership advantage "
        f"({tag}: {lower:.4f}) exceeds the ceiling {ceiling:.4f} that (ε={eps:.3f}, δ)-DP allows. "
        "Something the DP claim rests on is false: either the DP implementation or its "
        "accounting is broken (e.g. less noise than the accountant was told), or the members "
        "and non-members are not drawn from the same distribution — the ceiling assumes they are "
        "exchangeable, and a shifted held-out set looks like leakage."
    )


def _check_stopping_threshold(stopping: PrivacyEarlyStopping, prior: float) -> None:
    """Refuse a budget on an advantage figure in [0, |2p − 1|): every figure is at least |2p − 1|
    (the advantage of guessing the likelier class, MACE eq. 7 at prior p), so it would stop
    training at the first check whatever leaks — a budget set on the scale of prior ½. (A
    negative one says "stop at the first check" on purpose, at any prior.)"""
    floor = abs(2 * prior - 1)
    if tags.is_advantage_estimate(stopping.tag) and 0 <= stopping.threshold < floor:
        raise ValueError(
            f"early_stopping's threshold {stopping.threshold:g} on {stopping.tag} is below "
            f"|2·prior − 1| = {floor:.4g}, the advantage of always guessing the likelier class "
            f"at prior {prior:g}: every advantage figure is at least that, so training would "
            f"stop at the first check whatever leaks; give a threshold in [{floor:.4g}, 1)"
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


def _expected_records(data: Any, max_batches: int | None) -> int | None:
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


@functools.lru_cache(maxsize=256)
def _detectable(
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


class PrivacyMonitor:
    """Watch a model's membership leakage during training.

    Args:
        query: a :mod:`privmon.queries` query, any callable ``batch -> scores`` (named by its
            ``__name__``; lambdas ``query``, ``query_1``, …), or a sequence of them (names must
            differ); a model is refused (pass ``LossQuery(model)``). List the modules a plain
            function runs in ``modules`` so a check can protect their state. Each query's
            output is checked at every batch: one row per record, one trailing shape.
        members: iterable of batches of training records (the audit member set; keep its order
            fixed — per-record indices refer to the order it yields). Under torch.distributed,
            this rank's shard, which may be empty.
        nonmembers: iterable of batches of held-out records, drawn from the same distribution,
            never the members themselves (the same object is refused; shared records warn).
        every_n_steps: ``step(global_step)`` runs a check when global_step is a multiple of it.
        prior: P(member) of the membership experiment, in (0, 1).
        methods: estimators per query, from ("histogram", "kde"); KDE is skipped for discrete
            queries.
        modules: modules the check must protect besides those the queries declare.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` or a log directory.
        sinks: further sinks (e.g. :class:`privmon.sinks.JsonlSink`): one, a sequence or None.
        accountant: an Opacus PrivacyEngine or accountant; ε at ``delta`` is read every check.
        delta: the DP δ at which ε is read, in (0, 1).
        canaries: a one-run DP audit beside the accountant: a
            :class:`~privmon.audit.GradientCanaries` in the Opacus optimizer, an
            :class:`~privmon.audit.InputCanaries` bound to a query (``query=``), or any object
            whose ``scores()`` returns ``(in_scores, out_scores)``. Each check reports
            ``privacy/canaries/<method>/epsilon_lower_bound`` for the f-DP and Steinke et al.
            bounds (:mod:`~privmon.callbacks.canary_audit`), certified over the run like every
            other figure, and an audited ε above the accountant's ε is a DP violation
            (``dp_violation``, :class:`PrivacyViolationWarning`) — one that, unlike the
            advantage against the ceiling, needs no assumption on the audit sets.
        interval_delta: the run's confidence budget, in (0, 1). Every figure called certified
            (``…/lower``, the ε lower bounds, the canaries' ε, ``dp_violation``, early stopping
            on ``"lower"``) holds simultaneously over all checks, queries and methods of the run
            with probability ≥ 1 − interval_delta: check k certifies at its share δ_k of it
            (:mod:`privmon.estimators.spending`, Σ δ_k ≤ interval_delta), split evenly over its
            queries and methods (and the canaries' two bounds). ``…/lower_check`` is the bound
            at interval_delta for one pre-chosen check only; the plug-in interval uses
            interval_delta too.
        planned_checks: the number of checks the run is expected to have, if known: the budget
            is then spent evenly over them (90 %) and the rest over any checks beyond — tighter
            certificates than the default sequence for unknown run lengths. Optional: the
            Lightning, Hugging Face and Ignite adapters set it from the trainer's length
            (:meth:`plan`) when it is not given; a value given here is never changed.
        early_stopping: a :class:`PrivacyEarlyStopping`. When it watches a certified lower bound
            (``use="lower"``) that no advantage could push above its threshold at these audit
            sizes, a ``UserWarning`` says so and how many records would reach it.
        max_batches: audit at most this many batches of each set per check: the first ones the
            set yields, the same records at every check when its order is fixed (a list, a
            DataLoader with ``shuffle=False``). Every figure then describes those records only,
            and the certified ones hold for them (a fixed subset keeps the certificate valid: the
            records are chosen before any score is seen); a shuffling loader audits another
            subset at every check. Fewer records detect less (:meth:`detectable_advantage`).
        top_k: how many most-exposed member indices to report per query.
        strict: re-raise exceptions from a check instead of logging and skipping it. Under
            torch.distributed a failure on one rank then raises on every rank (the others raise
            :class:`~privmon.callbacks.distributed.RankFailure` naming the rank and the stage).
    """

    def __init__(
        self,
        query: Any,
        members: Iterable[Any],
        nonmembers: Iterable[Any],
        *,
        every_n_steps: int = 100,
        prior: float = 0.5,
        methods: Sequence[str] = ("histogram", "kde"),
        modules: nn.Module | Sequence[nn.Module] | None = None,
        writer: Any = None,
        sinks: Sink | Sequence[Sink] | None = (),
        accountant: Any = None,
        delta: float = 1e-5,
        canaries: Any = None,
        interval_delta: float = 0.05,
        planned_checks: int | None = None,
        early_stopping: PrivacyEarlyStopping | None = None,
        max_batches: int | None = None,
        top_k: int = 10,
        strict: bool = False,
    ) -> None:
        queries = _as_queries(list(query) if isinstance(query, (list, tuple)) else [query])
        names = [q.name for q in queries]
        if len(set(names)) != len(names):
            raise ValueError(f"query names must be unique, got {names}")
        if members is nonmembers:
            raise ValueError(
                "members and nonmembers are the same object: every figure would read no leak. "
                "Pass training records as members and held-out records as nonmembers"
            )
        # under torch.distributed a rank's shard may be empty: it contributes no records
        sharded = rank_and_world()[1] > 1
        for data, name in ((members, "members"), (nonmembers, "nonmembers")):
            check_audit_set(data, name=name, allow_empty=sharded)
        warn_if_shuffled(members, name="members")
        modules = (modules,) if isinstance(modules, nn.Module) else tuple(modules or ())
        for module in modules:
            if not isinstance(module, nn.Module):
                raise ValueError(
                    f"modules must be torch.nn.Module objects, got a {type(module).__name__}"
                )
        every_n_steps = check_int(every_n_steps, name="every_n_steps", minimum=1)
        methods = check_subset(methods, METHODS, name="methods")
        if max_batches is not None:
            max_batches = check_int(max_batches, name="max_batches", minimum=1)
        if planned_checks is not None:
            planned_checks = check_int(planned_checks, name="planned_checks", minimum=1)
        top_k = check_int(top_k, name="top_k")
        if early_stopping is not None and not isinstance(early_stopping, PrivacyEarlyStopping):
            raise ValueError("early_stopping must be a PrivacyEarlyStopping or None")
        if accountant is not None and not callable(getattr(accountant, "get_epsilon", None)):
            raise ValueError(
                "accountant must be an Opacus PrivacyEngine or accountant "
                "(an object with get_epsilon(delta))"
            )
        self.queries = queries
        self.members, self.nonmembers = members, nonmembers
        self.every_n_steps = every_n_steps
        self.prior = check_open_unit(prior, name="prior")
        if early_stopping is not None:
            _check_stopping_threshold(early_stopping, self.prior)
        self.methods = methods
        self.modules = modules
        self._audit_sets = (audit_view(members), audit_view(nonmembers))
        if sinks is None:
            given: Sequence[Sink] = ()
        elif callable(getattr(sinks, "write", None)):  # a single sink
            given = (cast(Sink, sinks),)
        else:
            given = cast("Sequence[Sink]", sinks)
        self.sinks: list[Sink] = [
            check_has_methods(
                sink, "write", "close", name="sinks", expected="sinks with write() and close()"
            )
            for sink in given
        ]
        if writer is not None:
            from privmon.sinks.tensorboard import TensorBoardSink

            self.sinks.insert(0, TensorBoardSink(writer))
        self.accountant = accountant
        self.canaries = None if canaries is None else check_canaries(canaries)
        self.delta = check_open_unit(delta, name="delta")
        if accountant is not None:
            _check_epsilon_readable(accountant, delta=self.delta)
        self.interval_delta = check_open_unit(interval_delta, name="interval_delta")
        self.early_stopping = early_stopping
        self.max_batches = max_batches
        self.top_k = top_k
        self.strict = strict
        self.history = ReportHistory()
        self.records = RecordTracker()
        self.n_failed = 0
        self.planned_checks = planned_checks
        self._user_planned = planned_checks is not None  # never changed by plan()
        self._planned_steps: int | None = None  # the run length plan() was given
        self.n_certified_checks = 0  # checks that spent a share of interval_delta
        self._last_step: int | None = None
        # one id per run, on every line and event it writes; a resumed run keeps its id
        self.run_id = uuid.uuid4().hex
        self._stop = False
        self._traps = Traps()  # silent traps said out loud, once each
        self._schedule_agreed = False  # under torch.distributed: at the first step()
        # query -> (members, non-members, dimensions) of its last check's finite scores
        self._audit_sizes: dict[str, tuple[int, int, int]] = {}
        # before any check: the records the loaders will yield (one process only: a rank's
        # shard is not the audit set)
        self._expected_sizes: tuple[int, int] | None = None
        if not sharded:
            expected = [_expected_records(data, max_batches) for data in (members, nonmembers)]
            if expected[0] and expected[1]:
                self._expected_sizes = (expected[0], expected[1])
        self._say_what_can_be_certified(1, first=True)

    # -- training-loop API ------------------------------------------------------------------
    def step(self, global_step: int) -> bool:
        """Run a check when one is due — ``global_step`` a multiple of ``every_n_steps`` and past
        the last checked step — ; True when training should stop. Under torch.distributed the
        ranks decide together: at the first call they agree on ``every_n_steps`` (on a mismatch
        every rank takes rank 0's, said loudly; ``strict``: raises), and a step one rank has
        already checked (its state restored alone) is skipped on all of them, so no rank waits
        in a check the others never enter."""
        fresh = self._last_step is None and self.n_failed == 0 and self.n_certified_checks == 0
        self._traps.saw_step(global_step, every_n_steps=self.every_n_steps, fresh=fresh)
        if not self._schedule_agreed and rank_and_world()[1] > 1:
            self.every_n_steps = agree_on_schedule(self.every_n_steps, strict=self.strict)
            self._schedule_agreed = True
            if self._planned_steps is not None:  # the plan follows the agreed schedule
                self.plan(total_steps=self._planned_steps)
        if global_step % self.every_n_steps != 0:
            return self._stop
        checked = self._last_step is not None and global_step <= self._last_step
        if rank_and_world()[1] > 1:
            (checked,) = agree(None, stage="deciding on a check", flags=[checked])
        if checked:
            if self._last_step is not None and global_step < self._last_step:
                self._traps.behind(global_step, self._last_step)  # once: a loop repeats it
            return self._stop
        self.check(global_step)
        return self._stop

    def plan(self, *, total_steps: int) -> int | None:
        """Plan the run's checks from its length: ``planned_checks`` becomes
        ``total_steps // every_n_steps``, the checks :meth:`step` runs in global steps 1 to
        ``total_steps`` (:mod:`privmon.estimators.spending`: each certifies at 0.9 δ / that
        number instead of the sequence for runs of unknown length). The Lightning, Hugging Face
        and Ignite adapters call it before training with the trainer's length.

        A ``planned_checks`` given at construction is never changed (a schedule with another
        count is said, once). Once a check has spent part of ``interval_delta`` the plan in
        force is kept — spending δ another way mid-run would break the run-level guarantee —
        and a schedule with another count is said, once; a resumed run keeps the plan its saved
        state was measured under (:meth:`load_state_dict`). A run stopped before its planned
        length (early stopping, a crash) leaves part of δ unspent: its certificates stay valid.

        Args:
            total_steps: the global step training ends at (>= 1).

        Returns:
            The planned checks now in force (None: the sequence for unknown lengths).
        """
        total_steps = check_int(total_steps, name="total_steps", minimum=1)
        planned = total_steps // self.every_n_steps
        self._planned_steps = total_steps
        if planned == self.planned_checks:
            return planned
        schedule = (
            f"the trainer's schedule has {planned} checks ({total_steps} steps, every_n_steps="
            f"{self.every_n_steps})"
        )
        if planned == 0:
            self._traps.say(
                "no check due",
                f"privmon: no check is due in this run: every_n_steps={self.every_n_steps} is "
                f"above its {total_steps} steps; lower every_n_steps",
                stacklevel=2,
            )
            if not self._user_planned and self.n_certified_checks == 0:
                self.planned_checks = None  # an earlier plan() no longer describes the run
        elif self._user_planned:
            self._traps.say(
                "plan differs",
                f"privmon: planned_checks={self.planned_checks} is kept, but {schedule}: "
                + (
                    f"checks after check {self.planned_checks} certify at a far smaller share of "
                    "interval_delta"
                    if planned > cast(int, self.planned_checks)
                    else "every check certifies at a smaller share of interval_delta than "
                    "the schedule needs"
                ),
                stacklevel=2,
            )
        elif self.n_certified_checks > 0:
            kept = (
                "the sequence for runs of unknown length"
                if self.planned_checks is None
                else f"planned_checks={self.planned_checks}"
            )
            self._traps.say(
                "plan kept",
                f"privmon: {schedule}, but {self.n_certified_checks} check(s) of this run "
                f"already certified under {kept}, which is kept: spending interval_delta "
                "another way mid-run would break the run-level guarantee",
                stacklevel=2,
            )
        else:
            self.planned_checks = planned
            logger.info("privmon: %s: planned_checks=%d", schedule, planned)
        return self.planned_checks

    def detectable_advantage(
        self,
        query: str | None = None,
        *,
        check: int | None = None,
        threshold: float | None = None,
        power: float = 0.5,
    ) -> float:
        """The smallest advantage that check number ``check`` certifies for ``query``: a true
        optimal advantage this large gets a certified lower bound (``…/lower``) above
        ``threshold`` with probability ``power``, at the check's share of ``interval_delta``
        per figure and the query's audit sizes (:func:`privmon.detectable_advantage`, for a
        rule as good as the optimal one). Each report carries it for its own check as
        ``privacy/<query>/detectable``; a smaller leak may go uncertified.

        The audit sizes are the query's records with finite scores at its last check, and
        before any check the records the loaders will yield (capped by ``max_batches``), for
        scores of 1-2 dimensions (above, a few % more is needed).

        Args:
            query: the query's name; may be omitted when one query is monitored.
            check: the check's number in the run (1, 2, …); default the next check.
            threshold: the figure the bound must exceed, in [|2p − 1|, 1); default the floor
                |2p − 1|: any certified leakage.
            power: the probability of exceeding it, in (0, 1); 0.5: in half the runs.

        Returns:
            The advantage, in (threshold, 1], or ``math.inf`` when none reaches the threshold.

        Raises:
            ValueError: on a bad argument, or when the audit sizes are unknown (loaders without
                a length, before the first check).
        """
        names = [q.name for q in self.queries]
        if query is None:
            if len(names) > 1:
                raise ValueError(f"query must name one of the monitored queries {names}")
            query = names[0]
        if query not in names:
            raise ValueError(f"query must be one of {names}, got {query!r}")
        k = (
            self.n_certified_checks + 1
            if check is None
            else check_int(check, name="check", minimum=1)
        )
        sizes = self._sizes(query)
        if sizes is None:
            raise ValueError(
                "the audit sizes are unknown until the first check: the member or non-member "
                "set has no length (an iterable dataset, a custom batch sampler)"
            )
        n1, n2, dim = sizes
        return _detectable(
            n1,
            n2,
            delta=self._certify_delta(k),
            prior=self.prior,
            dim=dim,
            threshold=threshold,
            power=check_open_unit(power, name="power"),
        )

    @property
    def should_stop(self) -> bool:
        """True once early stopping has fired (what the last :meth:`step` returned)."""
        return self._stop

    @property
    def last_report(self) -> Report | None:
        """The latest successful check's report (None before the first)."""
        return self.history[-1] if self.history else None

    def check(self, global_step: int) -> Report | None:
        """Run one check now. Returns its report, or None when it failed (logged, skipped; the
        first failure of a run with no successful check also warns).

        One check runs at a time in a process: a call while another is running (from another
        thread, or from inside a query) is refused — counted in ``n_failed``, logged, None
        (``strict``: a RuntimeError) — rather than let the two save and restore each other's
        eval mode, gradients and RNGs."""
        global_step = check_int(global_step, name="global_step")  # numpy ints too, as int
        if not begin_check():
            self.n_failed += 1
            message = (
                f"privmon: the check at step {global_step} is refused: another check is running "
                "in this process (check() called from two threads, or from inside a query)"
            )
            if self.strict:
                raise RuntimeError(message)
            logger.error(message)
            return None
        try:
            return self._check_and_act(global_step)
        finally:
            end_check()

    def _check_and_act(self, global_step: int) -> Report | None:
        """:meth:`check` holding the check lock: the check, then the sinks and early stopping."""
        self._last_step = global_step
        try:
            report = self._check(global_step)
        except Exception as err:
            self.n_failed += 1
            if self.strict:
                raise
            logger.exception(
                "privmon: the privacy check at step %s failed and was skipped", global_step
            )
            if not self.history:
                self._traps.check_failed(global_step, describe_error(err))
            return None
        self.history.append(report)
        self._say_what_can_be_certified(self.n_certified_checks, first=len(self.history) == 1)
        stop, error = False, None
        try:
            if rank_and_world()[0] == 0:  # every rank holds the same report; one writes it
                for sink in self.sinks:
                    self._guarded(sink.write, report, what=f"sink {sink!r}", step=global_step)
            if self.early_stopping is not None and len(self.history) == 1:
                self._check_stopping_metric(self.early_stopping, report)
            stop = self.early_stopping is not None and bool(
                self._guarded(
                    self.early_stopping.update,
                    global_step,
                    report.scalars,
                    what="early stopping",
                    step=global_step,
                )
            )
        except Exception as err:  # strict: raised on this rank, so it raises on all of them
            error = err
        # all ranks stop together when any says stop
        (stop,) = agree(error, stage="writing the report or early stopping", flags=[stop])
        if stop:
            if not self._stop:
                reason = getattr(self.early_stopping, "reason", None) or "another rank said stop"
                logger.warning("privmon: early stopping at step %s — %s", global_step, reason)
            self._stop = True
        return report

    def _check_stopping_metric(self, stopping: PrivacyEarlyStopping, report: Report) -> None:
        """At the first report, say loudly when early stopping watches a figure no report has
        (a typo in the metric would otherwise switch the privacy budget off, check after check):
        an error with ``strict``, else an error log and a warning."""
        try:
            stopping.figure(report.scalars)
        except KeyError as err:
            message = f"privmon: early stopping can never fire: {err.args[0]}"
            if self.strict:
                raise ValueError(message) from None
            logger.error(message)
            warnings.warn(message, UserWarning, stacklevel=4)

    def _guarded(self, fn: Any, *args: Any, what: str, step: int | None = None) -> Any:
        """Run a sink, a release or the stopping rule; a failure is logged (re-raised when
        strict)."""
        try:
            return fn(*args)
        except Exception:
            if self.strict:
                raise
            logger.exception("privmon: %s failed at step %s", what, step)
            return None

    def top_records(
        self, k: int = 10, *, query: str | None = None, by: str = "max"
    ) -> RankedRecords:
        """The k most exposed member records across checks: (index, risk), highest first.

        ``by``: "max" (highest risk any check measured), "last" or "mean". ``query`` may be
        omitted when one query is monitored. Indices refer to the members' iteration order.
        ``.tied_beyond`` on the result: how many records left out share the last one's risk
        (then index, not risk, decided which of them made the list).
        """
        return self.records.top(k, query=query, by=by)

    def export_records(self, path: Any, *, query: str | None = None) -> str:
        """CSV of every member record's index and risks (never the record itself)."""
        return self.records.to_csv(path, query=query)

    def close(self) -> None:
        """Close every sink; one that raises is logged and the others are still closed. A run
        that ran no check at all is said out loud (``step(epoch)`` instead of the global step)."""
        checked = bool(self.history) or self.n_failed > 0
        self._traps.at_close(checked=checked, every_n_steps=self.every_n_steps)
        for sink in self.sinks:
            self._guarded(sink.close, what=f"closing sink {sink!r}")

    # -- one check ----------------------------------------------------------------------------
    def _modules(self) -> list[nn.Module]:
        mods: list[nn.Module] = []
        for q in self.queries:
            mods.extend(getattr(q, "modules", ()))
        mods.extend(self.modules)
        return mods

    def _device(self) -> torch.device:
        for root in self._modules():
            for t in list(root.parameters()) + list(root.buffers()):
                return t.device
        return torch.device("cpu")

    def _collect(
        self,
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str], float]:
        """Scores of every query on members and non-members, the training state untouched; the
        queries left out (name -> why: the others are still scored); and the seconds spent in
        the queries themselves (the forward passes). The first check also compares the two
        sets' records by content: identical sets fail this check and every later one,
        overlapping ones warn."""
        if self._traps.identical is not None:
            raise ValueError(self._traps.identical)
        collected = collect_scores(
            self.queries,
            self._audit_sets,
            roots=self._modules(),
            device=self._device(),
            max_batches=self.max_batches,
            strict=self.strict,
            digests=not self._traps.overlap_checked,
            allow_empty=rank_and_world()[1] > 1,  # a rank's empty shard contributes nothing
        )
        self._traps.check_overlap(collected.digests)
        if self._traps.identical is not None:
            raise ValueError(self._traps.identical)
        return collected.scores, collected.failed, collected.forward

    def _gathered_scores(
        self, step: int
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str], float]:
        """:meth:`_collect` on this process; under torch.distributed every rank's scores, in
        rank order.

        Before any scores move, ranks agree that every one of them collected its shard, at the
        same step, with the same settings, and on each query's dtype and trailing shape
        (:func:`~privmon.callbacks.distributed.agree_on_scores`): a failure or a disagreement
        skips the check, or that query, on every rank instead of leaving the others waiting in a
        collective or mixing scores of different steps.
        """
        _, world = rank_and_world()
        if world == 1:
            return self._collect()
        local: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        failed: dict[str, str] = {}
        forward, error = 0.0, None
        try:
            local, failed, forward = self._collect()
        except Exception as err:
            error = err
        settings = repr(
            {
                **self._config(),
                "every_n_steps": self.every_n_steps,  # ranks that differ never meet in a check
                "top_k": self.top_k,
                "delta": None if self.accountant is None else self.delta,
                "kinds": [
                    (getattr(q, "discrete", False), getattr(q, "higher_is_member", None))
                    for q in self.queries
                ],
            }
        )
        try:
            agreed = agree_on_scores(
                step,
                names=[q.name for q in self.queries],
                settings=settings,
                spent=self.n_certified_checks,
                error=error,
                scores=local,
                failed=failed,
                strict=self.strict,
            )
        except StepDisagreement as err:
            # a rank behind must not then enter, alone, the check the others have already left
            self._last_step = max(err.steps)
            raise
        self.n_certified_checks = agreed.spent
        failed.update(agreed.left_out)
        return gather_scores(local, agreed), failed, forward

    def _certify_delta(self, k: int) -> float:
        """The δ check ``k`` certifies each of its figures at: its share of the run's δ, split
        evenly over its certified figures, so that every figure called certified holds over the
        whole run (union bound)."""
        share = check_delta(k, delta=self.interval_delta, planned_checks=self.planned_checks)
        return share / self._figures_per_check()

    def _sizes(self, query: str) -> tuple[int, int, int] | None:
        """(members, non-members, dimensions) of ``query``'s audit: its last check's, else the
        loaders' expected records for 1-D scores; None when unknown."""
        if query in self._audit_sizes:
            return self._audit_sizes[query]
        if self._expected_sizes is None:
            return None
        return (*self._expected_sizes, 1)

    def _say_what_can_be_certified(self, k: int, *, first: bool) -> None:
        """Log what check ``k`` can certify per query (``first``: at construction and at the
        first check), and warn once when early stopping watches a certified lower bound whose
        threshold no advantage reaches at check ``k``. Unknown sizes say nothing; a failure
        here is logged, never raised."""
        try:
            stopping = self.early_stopping
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
            delta = self._certify_delta(k)
            if first:
                parts = []
                for q in self.queries:
                    sizes = self._sizes(q.name)
                    if sizes is not None:
                        n1, n2, dim = sizes
                        a = _detectable(n1, n2, delta=delta, prior=self.prior, dim=dim)
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

    def _warn_if_out_of_reach(
        self, k: int, delta: float, threshold: float, query: str, tag: str
    ) -> None:
        """Warn once when no advantage gets ``tag`` (a certified lower bound of ``query``) above
        early stopping's ``threshold`` in half the runs at check ``k``, with the records per
        class that would let an advantage a little above it do so."""
        sizes = self._sizes(query)
        floor = abs(2 * self.prior - 1)
        if sizes is None or threshold < floor:  # below the floor: any certified leak trips it
            return
        n1, n2, dim = sizes
        if threshold < 1 and math.isfinite(
            _detectable(n1, n2, delta=delta, prior=self.prior, dim=dim, threshold=threshold)
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
        self._traps.say(
            "out of reach",
            f"privmon: early stopping on {tag} > {threshold:g} cannot fire at check {k}: with "
            f"{n1} members and {n2} non-members and δ = {delta:.3g} per certified figure, not "
            f"even an advantage of 1 gets a certified lower bound above {threshold:g} in half "
            f"the runs. {remedy}",
            stacklevel=4,
        )

    def _figures_per_check(self) -> int:
        """Certified figures per check: one per query and method it applies to, and one per
        canary bound."""
        canaries = 0 if self.canaries is None else len(CANARY_METHODS)
        return canaries + sum(
            len(applicable_methods(self.methods, discrete=getattr(q, "discrete", False)))
            for q in self.queries
        )

    def _audit_canaries(self, canaries: Any, step: int, eps: float | None, significance: float):
        """The canaries' figures at this check, or the error (a string) when their scores or
        bounds failed (logged; re-raised when strict)."""
        try:
            in_scores, out_scores = canaries.scores()
            return canary_figures(
                in_scores,
                out_scores,
                delta=self.delta,
                significance=significance,
                epsilon=eps,
                step=step,
            )
        except Exception as err:
            if self.strict:
                raise
            logger.exception("privmon: the canary audit failed at step %s", step)
            return describe_error(err)

    def _analyse(self, q: Any, mem: torch.Tensor, non: torch.Tensor, lower_delta: float):
        """One query's figures, or the error (a string) when its analysis failed (logged;
        re-raised when strict)."""
        try:
            result = analyse(
                mem,
                non,
                methods=self.methods,
                prior=self.prior,
                delta=self.interval_delta,
                certify_delta=lower_delta,
                discrete=getattr(q, "discrete", False),
                higher_is_member=getattr(q, "higher_is_member", None),
                top_k=self.top_k,
                name=q.name,
                errors="raise" if self.strict else "skip",
            )
        except Exception as err:
            if self.strict:
                raise
            logger.exception("privmon: the analysis of query %r failed", q.name)
            return describe_error(err)
        for what, error in result.failures.items():
            logger.error("privmon: %s of query %r failed: %s", what, q.name, error)
        return result

    def _check(self, step: int) -> Report:
        t0 = time.perf_counter()
        scores, failed, t_query = self._gathered_scores(step)
        # Each stage below runs on every rank alone and may fail on one only: ranks agree on its
        # outcome before going on, so a failure skips the check (or the query) on all of them
        # and none is left waiting in a later collective.
        eps, analysed, error = None, {}, None
        canaries: CanaryFigures | str = "not computed"
        try:
            if self.accountant is not None:
                eps = float(epsilon_from_opacus(self.accountant, delta=self.delta))
            lower_delta = self._certify_delta(self.n_certified_checks + 1)
            for q in self.queries:
                if q.name not in failed:
                    analysed[q.name] = self._analyse(q, *scores[q.name], lower_delta)
            if self.canaries is not None:
                canaries = self._audit_canaries(self.canaries, step, eps, lower_delta)
        except Exception as err:
            error = err
        # what failed on this rank ("" for nothing), per query still in, and the canaries
        outcomes = dict.fromkeys((q.name for q in self.queries if q.name not in failed), "")
        for name, result in analysed.items():
            outcomes[name] = (
                result
                if isinstance(result, str)
                else "; ".join(f"{what}: {e}" for what, e in result.failures.items())
            )
        if self.canaries is not None:
            outcomes[_CANARIES] = canaries if isinstance(canaries, str) else ""
        failed.update(agree_on_outcomes(error, outcomes, stage="reading ε or the analysis"))
        self.n_certified_checks += 1
        results: dict[str, QueryResult] = {}
        try:
            scalars: dict[str, float] = {}
            failures: dict[str, str] = {}
            ceilings: dict[str, float] = {}
            if eps is not None:
                if not math.isnan(eps):  # ε = inf gives the trivial ceiling 1
                    ceilings[tags.CEILING_TANH] = float(tanh_bound(eps, prior=self.prior))
                    ceilings[tags.CEILING_EPS_DELTA] = float(
                        tanh_bound(eps, prior=self.prior, delta=self.delta)
                    )
                scalars[tags.EPSILON] = eps
                scalars.update(ceilings)
            scalars[tags.CERTIFY_DELTA] = lower_delta
            messages: list[str] = []
            violation = False
            for q in self.queries:
                result = failed.get(q.name) or analysed[q.name]
                if isinstance(result, str):
                    failures[q.name] = result
                    continue
                results[q.name] = result
                n1, n2 = (finite_rows(side) for side in scores[q.name])
                self._audit_sizes[q.name] = (n1, n2, result.dim)
                self._traps.check_direction(
                    step,
                    q.name,
                    higher_is_member=getattr(q, "higher_is_member", None),
                    auc=result.roc.get("auc"),
                    scores=scores[q.name],
                )
                failures.update({f"{q.name}/{what}": e for what, e in result.failures.items()})
                scalars.update(
                    {tags.query_figure(q.name, k): v for k, v in result.scalars().items()}
                )
                # the smallest advantage this check certifies in half the runs
                scalars[tags.detectable(q.name)] = _detectable(
                    n1, n2, delta=lower_delta, prior=self.prior, dim=result.dim
                )
                # ε implied by each certified lower bound, in one call
                eps_bounds = epsilon_lower_bound(
                    np.array([est.lower for est in result.estimates.values()]), prior=self.prior
                )
                for method, eps_bound in zip(result.estimates, eps_bounds.tolist(), strict=True):
                    scalars[tags.epsilon_lower_bound(q.name, method)] = eps_bound
                for method, est in result.estimates.items():
                    tag = f"{q.name}/{method}"
                    if (
                        eps is not None
                        and tags.CEILING_EPS_DELTA in ceilings
                        and est.lower > ceilings[tags.CEILING_EPS_DELTA] + 1e-12
                    ):
                        violation = True
                        ceiling = ceilings[tags.CEILING_EPS_DELTA]
                        msg = _violation_message(step, tag, est.lower, ceiling, eps)
                        messages.append(msg)
                        logger.warning(msg)
                        warnings.warn(msg, PrivacyViolationWarning, stacklevel=3)
            if self.canaries is not None:
                if _CANARIES in failed or isinstance(canaries, str):
                    failures[_CANARIES] = failed.get(_CANARIES) or str(canaries)
                else:
                    scalars.update(canaries.scalars)
                    violation = violation or canaries.violation
                    for msg in canaries.messages:
                        messages.append(msg)
                        logger.warning(msg)
                        warnings.warn(msg, PrivacyViolationWarning, stacklevel=3)
            if not results:
                raise RuntimeError(f"every query's analysis failed: {failures}")
            if eps is not None:
                scalars[tags.DP_VIOLATION] = float(violation)
            report = Report(
                step=step,
                scalars=scalars,
                queries=results,
                epsilon=eps,
                dp_violation=violation,
                messages=tuple(messages),
                failures=failures,
                seconds=time.perf_counter() - t0,
                query_seconds=t_query,
                run_id=self.run_id,
            )
        except Exception as err:
            error = err
        agree(error, stage="building the report")
        for name, result in results.items():  # state changes once every rank has its report
            if result.member_risk is not None:
                self.records.update(name, step, result.member_risk)
        return report

    # -- persistence --------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        """What a saved state was measured under; a state loads only into the same setup."""
        return {
            "queries": [q.name for q in self.queries],
            "methods": list(self.methods),
            "prior": self.prior,
            "interval_delta": self.interval_delta,
            "planned_checks": self.planned_checks,
            "canaries": self.canaries is not None,  # they take a share of every check's δ
        }

    def _check_config(self, config: Any) -> None:
        """Refuse a saved setup that differs from this monitor's: naming the fields that differ,
        or those a newer privmon saved that this one does not know. A field the saved setup
        lacks (saved by an older privmon) is not compared; states saved before the setup was
        kept have none. ``planned_checks`` is compared only when this monitor was given one."""
        if config is None:
            return
        if not isinstance(config, dict):
            raise ValueError(f"state config must be a dict, got {type(config).__name__}")
        mine = self._config()
        if not self._user_planned:  # a plan not given by the user: the saved run's plan goes on
            del mine["planned_checks"]
        unknown = sorted(set(config) - set(mine) - {"planned_checks"})
        if unknown:
            raise ValueError(
                "state was saved by a newer privmon, with setup fields this one does not know "
                f"({', '.join(unknown)}): resume it with that version"
            )
        diff = {k: (config[k], v) for k, v in mine.items() if k in config and config[k] != v}
        if diff:
            raise ValueError(
                "state was saved by a monitor with another setup (saved, this monitor): "
                + ", ".join(f"{k}: {a!r} != {b!r}" for k, (a, b) in diff.items())
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs — the setup it was measured under, the history's
        figures, counters, early stopping's and the record tracker's state — as tensors and
        plain containers (loads with ``torch.load(..., weights_only=True)``)."""
        return {
            "config": self._config(),
            "run_id": self.run_id,
            "history": self.history.state_dict(),
            "last_step": self._last_step,
            "stop": self._stop,
            "n_failed": self.n_failed,
            "n_certified_checks": self.n_certified_checks,
            "early_stopping": None
            if self.early_stopping is None
            else self.early_stopping.state_dict(),
            "records": self.records.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. The state must come from a monitor with the same
        queries, methods, prior, ``interval_delta`` and — when this monitor was given one —
        ``planned_checks`` (the run's confidence budget goes on where it stopped; a newer
        privmon's setup fields are refused by name); a monitor given no ``planned_checks`` takes
        the saved run's plan, which :meth:`plan` then keeps once the state has checks;
        every field is checked before any is applied, and against the others (``last_step``
        against the checks kept), so a state that does not fit raises a ValueError naming the
        field and changes nothing. A certified-check count above the checks the state ran
        loads with a warning (looser bounds from then on)."""
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        required = ("history", "last_step", "stop", "n_failed", "records", "early_stopping")
        missing = [key for key in required if key not in state]
        if missing:
            raise ValueError(f"state lacks {missing}: is it a PrivacyMonitor.state_dict()?")
        self._check_config(state.get("config"))
        planned = self.planned_checks
        if not self._user_planned and isinstance(state.get("config"), dict):
            planned = state["config"].get("planned_checks", planned)
            if planned is not None:
                planned = check_int(planned, name="state config planned_checks", minimum=1)
        history = ReportHistory.from_state_dict(state["history"])
        if not isinstance(state["stop"], bool):
            raise ValueError(f"state stop must be True or False, got {state['stop']!r}")
        n_failed = check_int(state["n_failed"], name="state n_failed")
        last_step = _checked_last_step(state["last_step"], history, n_failed)
        # a resumed run goes on spending where it stopped (older states: one per kept check)
        n_certified = check_int(
            state.get("n_certified_checks", len(history)), name="state n_certified_checks"
        )
        if n_certified < len(history):
            raise ValueError(
                f"state n_certified_checks ({n_certified}) is below its {len(history)} checks"
            )
        es = state["early_stopping"]
        if (es is None) != (self.early_stopping is None):
            raise ValueError("state_dict and monitor disagree on whether early stopping is set")
        if self.early_stopping is not None:
            copy.deepcopy(self.early_stopping).load_state_dict(es)  # raises on a bad field
        records = RecordTracker()
        records.load_state_dict(state["records"])
        run_id = state.get("run_id", self.run_id)  # states saved before run ids: a new one
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
            warnings.warn(message, UserWarning, stacklevel=2)
        # every field checked: apply them all
        if self.early_stopping is not None:
            self.early_stopping.load_state_dict(es)
        self.history, self.records = history, records
        self._last_step, self._stop = last_step, state["stop"]
        self.n_failed, self.n_certified_checks = n_failed, n_certified
        self.run_id = run_id
        self.planned_checks = planned
