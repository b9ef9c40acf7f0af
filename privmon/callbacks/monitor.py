"""PrivacyMonitor: audit a model's membership leakage while it trains. A check collects the
scores (:mod:`~privmon.callbacks.check_scores`) and, under torch.distributed, exchanges every
rank's once (:mod:`~privmon.callbacks.check_exchange`); rank 0 analyses them
(:mod:`~privmon.callbacks.check_analysis`), builds the report (:mod:`~privmon.report.build`),
decides on early stopping and publishes it; one broadcast shares the outcome, which every rank
applies (:mod:`~privmon.callbacks.check_outcome`). Budget: :mod:`~privmon.callbacks.budget`."""

from __future__ import annotations

import logging
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, cast

from torch import nn

from privmon._process_group import from_rank_0, rank_and_world
from privmon._training_guard import begin_check, end_check, warn_if_shuffled
from privmon._validation import check_int, check_open_unit, check_subset
from privmon.callbacks import arguments
from privmon.callbacks import state as saved
from privmon.callbacks.budget import CertificationBudget
from privmon.callbacks.canary_audit import CanaryAudits
from privmon.callbacks.check_exchange import exchange
from privmon.callbacks.check_outcome import CheckParts, Outcome, conclude, take_stopping
from privmon.callbacks.check_scores import CheckScores
from privmon.callbacks.distributed import StepDisagreement, agree_on_schedule
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.history import ReportHistory
from privmon.callbacks.loss_tracking import LossTracing
from privmon.callbacks.publishing import call_or_log, say_outcome, stopped
from privmon.callbacks.records import RankedRecords, RecordTracker
from privmon.callbacks.traps import Traps
from privmon.callbacks.user_frame import stacklevel_to_user
from privmon.estimators.estimates import describe_error
from privmon.estimators.methods import METHODS, registered_methods
from privmon.report import Report
from privmon.report.stopping import StoppingOutcome
from privmon.sinks.base import Sink

__all__ = ["PrivacyMonitor", "PrivacyViolationWarning", "Sink"]

logger = logging.getLogger("privmon")


class PrivacyViolationWarning(UserWarning):
    """A DP violation: a DP mechanism check fired, a canary audit's ε lower bound exceeds the
    accountant's ε, or a certified lower bound on the measured advantage exceeds the DP
    ceiling; the message names the cause and its evidence (``report.dp_causes``).

    Examples:
        >>> from privmon import PrivacyViolationWarning
        >>> issubclass(PrivacyViolationWarning, UserWarning)  # filter it with ``warnings``
        True
    """


class PrivacyMonitor:
    """Watch a model's membership leakage during training.

    Args:
        query: a :mod:`privmon.queries` query, any callable ``batch -> scores`` (named by its
            ``__name__``), or a sequence of them with distinct names; not a model.
        members: iterable of batches of training records, in a fixed order (per-record indices
            refer to it); under torch.distributed this rank's shard, which may be empty.
        nonmembers: iterable of batches of held-out records from the same distribution, never
            the members themselves (the same object is refused; shared records warn).
        every_n_steps: ``step(global_step)`` runs a check when global_step is a multiple of it.
        prior: P(member) of the membership experiment, in (0, 1).
        methods: estimators per query, of :func:`~privmon.estimators.methods.registered_methods`
            (the built-in ones, and any :func:`~privmon.estimators.register_method` added).
        modules: modules a check must protect besides those the queries declare.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` or a log directory.
        sinks: further sinks (e.g. :class:`privmon.sinks.JsonlSink`): one, a sequence or None.
        accountant: an Opacus PrivacyEngine or accountant; ε at ``delta`` is read every check.
        delta: the DP δ at which ε is read, in (0, 1).
        canaries: one-run DP audits and DP mechanism checks, one object or a list: objects whose
            ``scores()`` gives ``(in_scores, out_scores)`` (ε lower bounds, e.g.
            :class:`~privmon.audit.GradientCanaries`) or ``mechanism()`` the checks' findings.
        interval_delta: the run's confidence budget, in (0, 1): every certified figure of the
            run holds together with probability ≥ 1 − interval_delta (``…/lower_check``: one check).
        dp_alarm_delta: the DP alarm's own level, in (0, 1), which the mechanism checks'
            statistical tests spend as interval_delta is: P(a false alarm in the run) ≤ it.
        planned_checks: the checks the run is expected to have, if known: the budget is then
            spent evenly over them (see :meth:`plan`); a value given here is never changed.
        early_stopping: a :class:`PrivacyEarlyStopping`, decided at each check before the sinks
            write it; a threshold out of the certificate's reach at these audit sizes warns.
        max_batches: audit at most the first this many batches of each set at each check (the
            same records every time when the sets' order is fixed).
        top_k: how many most-exposed member indices to report per query.
        strict: re-raise exceptions from a check (on every rank) instead of logging them.
        run_id: the run's id (:attr:`run_id`); None: a fresh one. Another run in the writer
            folder or JsonlSink file warns, unless this one resumes it under its id.
        loss_traces: a :class:`~privmon.callbacks.LossTracing`: per-record loss traces, LT-IQR.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon import PrivacyMonitor
        >>> from privmon.queries import LossQuery
        >>> _ = torch.manual_seed(0)
        >>> gen = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(400, 20, generator=gen), torch.randint(0, 2, (400,), generator=gen)
        >>> model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        >>> members, held_out = [(x[:200], y[:200])], [(x[200:], y[200:])]  # one batch each
        >>> monitor = PrivacyMonitor(LossQuery(model), members, held_out, every_n_steps=50)
        >>> for step in range(1, 101):  # train on the 200 members
        ...     optimizer.zero_grad()
        ...     nn.functional.cross_entropy(model(x[:200]), y[:200]).backward()
        ...     optimizer.step()
        ...     stop = monitor.step(step)  # a check at steps 50 and 100
        >>> monitor.close()
        >>> round(monitor.last_report.scalars["privacy/loss/histogram/lower"], 3)
        0.618
    """

    def __init__(
        self,
        query: Any,
        members: Iterable[Any],
        nonmembers: Iterable[Any],
        *,
        every_n_steps: int = 100,
        prior: float = 0.5,
        methods: Sequence[str] = METHODS,
        modules: nn.Module | Sequence[nn.Module] | None = None,
        writer: Any = None,
        sinks: Sink | Sequence[Sink] | None = (),
        accountant: Any = None,
        delta: float = 1e-5,
        canaries: Any = None,
        interval_delta: float = 0.05,
        dp_alarm_delta: float = 1e-4,
        planned_checks: int | None = None,
        early_stopping: PrivacyEarlyStopping | None = None,
        max_batches: int | None = None,
        top_k: int = 10,
        strict: bool = False,
        run_id: str | None = None,
        loss_traces: LossTracing | None = None,
    ) -> None:
        self.queries = arguments.as_queries(query)
        arguments.check_audit_sets(members, nonmembers, sharded=rank_and_world()[1] > 1)
        warn_if_shuffled(members, name="members")  # per-record indices follow its order
        self.modules = arguments.as_modules(modules)
        self.every_n_steps = check_int(every_n_steps, name="every_n_steps", minimum=1)
        self.methods = check_subset(methods, registered_methods(), name="methods")
        max_batches = arguments.optional_count(max_batches, name="max_batches")
        planned_checks = arguments.optional_count(planned_checks, name="planned_checks")
        self.top_k = check_int(top_k, name="top_k")
        arguments.check_accountant(accountant)
        self.members, self.nonmembers = members, nonmembers
        self.prior = check_open_unit(prior, name="prior")
        arguments.check_early_stopping(early_stopping, self.prior)
        # one id per run, on every line and event it writes; a resumed run keeps its id
        self.run_id = uuid.uuid4().hex if run_id is None else run_id
        self.sinks: list[Sink] = arguments.as_sinks(sinks, writer)
        self._other_runs = arguments.OtherRuns(self.sinks)  # said at the first write
        self.accountant = accountant
        self._audits = CanaryAudits(canaries)
        self.canaries = canaries if self._audits else None
        self.delta = check_open_unit(delta, name="delta")
        if accountant is not None:
            arguments.check_epsilon_readable(accountant, delta=self.delta)
        self.interval_delta = check_open_unit(interval_delta, name="interval_delta")
        self.dp_alarm_delta = check_open_unit(dp_alarm_delta, name="dp_alarm_delta")
        self.early_stopping, self.max_batches, self.strict = early_stopping, max_batches, strict
        self.history, self.records = ReportHistory(), RecordTracker()
        self.loss_traces = arguments.check_loss_tracing(loss_traces, self.queries)
        self.n_failed, self._stop = 0, False
        self._restored: int | None = None  # the step whose weights an adapter restored
        self._last_step: int | None = None
        self._traps, self._schedule_agreed = Traps(), False  # traps said once; schedule at step 1
        self._scores = CheckScores(
            self.queries, members, nonmembers, modules=self.modules, max_batches=max_batches,
            strict=strict, traps=self._traps,
        )  # fmt: skip
        self._budget = CertificationBudget(
            queries=self.queries, methods=self.methods, prior=self.prior, max_batches=max_batches,
            canary_figures=self._audits.figures_per_check, interval_delta=self.interval_delta,
            alarm_tests=self._audits.alarm_tests, alarm_delta=self.dp_alarm_delta,
            planned_checks=planned_checks, audit_sets=(members, nonmembers), traps=self._traps,
        )  # fmt: skip
        self._budget.say_what_can_be_certified(1, first=True, stopping=early_stopping)

    @property
    def planned_checks(self) -> int | None:
        """The checks the run's budget is spent over (None: the sequence for unknown lengths)."""
        return self._budget.planned_checks

    @property
    def n_certified_checks(self) -> int:
        """The checks that spent a share of ``interval_delta``."""
        return self._budget.spent

    @property
    def run_id(self) -> str:
        """The run's id on every line and event it writes (fresh unless given; rank 0's on every
        rank once a check ran; kept by :meth:`state_dict`): a non-empty string, not ``"latest"``."""
        return self._run_id

    @run_id.setter
    def run_id(self, value: str) -> None:
        self._run_id = arguments.check_run_id(value)

    def step(self, global_step: int) -> bool:
        """Run a check when one is due (``global_step`` a multiple of ``every_n_steps``, past the
        last checked step); True when training should stop. Under torch.distributed the ranks
        first agree on ``every_n_steps`` (rank 0's) and all skip a step one rank has checked."""
        global_step = check_int(global_step, name="global_step")  # numpy ints too, as int
        fresh = self._last_step is None and self.n_failed == 0 and self.n_certified_checks == 0
        self._traps.saw_step(global_step, every_n_steps=self.every_n_steps, fresh=fresh)
        if not self._schedule_agreed and rank_and_world()[1] > 1:
            self.every_n_steps = agree_on_schedule(self.every_n_steps, strict=self.strict)
            self._schedule_agreed = True
            if self._budget.planned_steps is not None:  # the plan follows the agreed schedule
                self.plan(total_steps=self._budget.planned_steps)
        if global_step % self.every_n_steps != 0:
            return self._stop
        checked = self._last_step is not None and global_step <= self._last_step
        if checked and rank_and_world()[1] == 1:
            self._traps.step_before_last_check(global_step, self._last_step)
        else:  # under torch.distributed the ranks skip together, in the check's one exchange
            self._locked_check(global_step, checked=checked)
        return self._stop

    def record_losses(self, indices: Any, losses: Any, *, step: int) -> None:
        """Trace a training batch's per-sample losses (copied detached): ``losses[i]`` is record
        ``indices[i]``'s at ``step`` (:meth:`privmon.callbacks.LossTracing.record`)."""
        arguments.traces_for_losses(self.loss_traces).record(indices, losses, step=step)

    def plan(self, *, total_steps: int) -> int | None:
        """Plan the checks from the run's length (adapters call it): ``planned_checks`` =
        ``total_steps // every_n_steps``, unless one was given or a check ran (another is said).
        Returns the planned checks in force (None: the sequence for unknown lengths)."""
        return self._budget.plan(total_steps=total_steps, every_n_steps=self.every_n_steps)

    def detectable_advantage(
        self,
        query: str | None = None,
        *,
        check: int | None = None,
        threshold: float | None = None,
        power: float = 0.5,
    ) -> float:
        """The smallest advantage check ``check`` (default the next) certifies for ``query`` (omit
        it for one) above ``threshold`` with probability ``power`` at its audit sizes
        (:func:`privmon.detectable_advantage`); reports carry it as ``detectable``."""
        return self._budget.detectable_advantage(
            query, check=check, threshold=threshold, power=power
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
        """Run one check now: its report, or None when it failed (logged; the run's first failure
        warns) or another check runs in the process (refused, counted in ``n_failed``)."""
        return self._locked_check(check_int(global_step, name="global_step"), checked=False)

    def top_records(
        self, k: int = 10, *, query: str | None = None, by: str = "max"
    ) -> RankedRecords:
        """The k most exposed member records across checks, (index in the members' order,
        membership posterior), likeliest first, ``by`` "max" (any check's), "last" or "mean"
        (``query`` omitted for one query); ``.tied_beyond``: more records of the last posterior.

        Examples:
            >>> import torch
            >>> from privmon import PrivacyMonitor
            >>> scores = torch.randn(200, generator=torch.Generator().manual_seed(0))
            >>> scores[180:] += 3  # members 80-99 stand out
            >>> monitor = PrivacyMonitor(lambda b: b, [scores[100:]], [scores[:100]], top_k=5)
            >>> _ = monitor.check(1)  # (member index, posterior), likeliest members first:
            >>> [index for index, _ in monitor.top_records(3)]
            [97, 81, 96]
        """
        return self.records.top(k, query=query, by=by)

    @property
    def stopping_outcome(self) -> StoppingOutcome | None:
        """What the budget did so far (None without early stopping): the stop, or the highest
        figure reached, and the restored weights' step :meth:`say_restored` was told."""
        if self.early_stopping is None:
            return None
        return self.early_stopping.outcome(self.run_id, restored_step=self._restored)

    def say_restored(self, *, step: int) -> None:
        """An adapter restored, after the stop, the weights of the check at ``step`` (the last
        within the budget): said on the console, to every sink and in the HTML report's verdict."""
        self._restored = check_int(step, name="step")
        say_outcome(self.stopping_outcome, self.sinks, strict=self.strict, step=self._last_step)

    def export_records(self, path: Any, *, query: str | None = None) -> str:
        """CSV of every member record's index and membership posteriors (never the record)."""
        return self.records.to_csv(path, query=query)

    def close(self) -> None:
        """Say the budget's outcome (:attr:`stopping_outcome`, with early stopping: the stop, or
        that it never fired and the highest figure reached) on the console and to every sink,
        then close them (one that raises is logged); a run without any check is said."""
        checked = bool(self.history) or self.n_failed > 0
        self._traps.at_close(checked=checked, every_n_steps=self.every_n_steps)
        say_outcome(self.stopping_outcome, self.sinks, strict=self.strict, step=self._last_step)
        for sink in self.sinks:
            call_or_log(sink.close, what=f"closing sink {sink!r}", strict=self.strict)

    # -- one check: collect -> one exchange -> (rank 0) analyse, report, decide, publish -> apply
    def _locked_check(self, step: int, *, checked: bool) -> Report | None:
        """:meth:`check` holding the check lock (``checked``: this rank checked ``step``)."""
        if not begin_check():
            self.n_failed += 1
            self._traps.check_refused(step, strict=self.strict)
            return None
        try:
            return self._check_and_act(step, checked=checked)
        finally:
            end_check()

    def _check_and_act(self, step: int, *, checked: bool) -> Report | None:
        """Collect this rank's part, exchange it (None: a rank had checked ``step``, every rank
        skips it), conclude on rank 0 and apply the outcome on every rank."""
        t0 = time.perf_counter()
        try:
            exchanged = exchange(
                step, checked=checked, scores=self._scores, audits=self._audits,
                accountant=self.accountant, spent=self._budget.spent, settings=self._settings(),
                strict=self.strict, traces=self.loss_traces,
            )  # fmt: skip
        except Exception as err:
            # a rank behind must not then enter, alone, the check the others have already left
            self._last_step = max(err.steps) if isinstance(err, StepDisagreement) else step
            return self._failed(step, err)
        if exchanged is None:
            self._traps.step_before_last_check(step, self._last_step)
            return None
        rank, world = rank_and_world()
        outcome, own = (None, None)
        if rank == 0:
            outcome, own = conclude(
                step, *exchanged, parts=self._parts(), first=not self.history, t0=t0, world=world
            )
        return self._apply(step, cast(Outcome, from_rank_0(outcome, world)), own)

    def _parts(self) -> CheckParts:
        """What rank 0's conclusion of a check reads of this monitor."""
        return CheckParts(
            queries=self.queries, methods=self.methods, prior=self.prior,
            interval_delta=self.interval_delta, top_k=self.top_k, accountant=self.accountant,
            delta=self.delta, audits=self._audits, budget=self._budget, traps=self._traps,
            early_stopping=self.early_stopping, sinks=self.sinks, other_runs=self._other_runs,
            run_id=self.run_id, strict=self.strict, say=_say_violations, traces=self.loss_traces,
        )  # fmt: skip

    def _apply(self, step: int, outcome: Outcome, own: Exception | None) -> Report | None:
        """The outcome, on every rank: the budget, the history and records, early stopping's
        state and the stop; a failure raised (rank 0 its own error, the others a RankFailure)
        or, when the check itself failed, logged (``strict``: raised)."""
        self._last_step, report = step, outcome.report
        self._budget.spent, self._budget.audit_sizes = outcome.spent, dict(outcome.audit_sizes)
        error = own or (None if outcome.failure is None else outcome.failure.error())
        if report is None:
            return self._failed(step, cast(Exception, error))
        self.history.append(report)
        for name, result in report.queries.items():
            if result.member_posterior is not None:
                self.records.update(name, step, result.member_posterior)
        elsewhere = rank_and_world()[0] != 0  # rank 0 decided and warned
        if elsewhere:  # the run's id is rank 0's, which its reports carry and its sinks write
            self.run_id = report.run_id
            take_stopping(self.early_stopping, outcome.stopping)
        self._stop = stopped(outcome.stop, self._stop, self.early_stopping, report.step)
        if error is not None and self.strict:  # early stopping or a sink, after the check
            raise error
        if error is not None:  # the check's report stands on every rank
            logger.error("privmon: at step %s: %s", step, describe_error(error), exc_info=own)
        if elsewhere:  # last: a warnings filter raising here leaves the state the others' too
            _say_violations(report)
        return report

    def _failed(self, step: int, error: Exception) -> Report | None:
        """A check that failed: counted, logged (the run's first failure warns), or raised."""
        self.n_failed += 1
        if self.strict:
            raise error
        logger.error("privmon: the check at step %s failed and was skipped", step, exc_info=error)
        if not self.history:
            self._traps.check_failed(step, describe_error(error))
        return None

    def _settings(self) -> str:
        """Whatever changes the figures: the ranks' must be the same."""
        return saved.settings(
            self._setup(), every_n_steps=self.every_n_steps, top_k=self.top_k, queries=self.queries,
            delta=None if self.accountant is None else self.delta, stopping=self.early_stopping,
            traces=self.loss_traces,
        )  # fmt: skip

    def _setup(self) -> dict[str, Any]:
        """What a saved state was measured under (:func:`~privmon.callbacks.state.setup`)."""
        return saved.setup(
            queries=[q.name for q in self.queries], methods=self.methods, prior=self.prior,
            interval_delta=self.interval_delta, dp_alarm_delta=self.dp_alarm_delta,
            planned_checks=self.planned_checks, canaries=self._audits.setup,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: a flat, versioned dict of tensors and plain values
        (:mod:`~privmon.callbacks.state`; ``torch.load(..., weights_only=True)`` reads it)."""
        return saved.state_dict(
            self._setup(), run_id=self.run_id, last_step=self._last_step, stop=self._stop,
            n_failed=self.n_failed, n_certified_checks=self.n_certified_checks,
            history=self.history, early_stopping=self.early_stopping, records=self.records,
            loss_traces=self.loss_traces,
        )  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a monitor with the same setup (queries, methods,
        prior, both δ, ``planned_checks`` if given); every field is checked first."""
        run = saved.read_state(
            state, measured_under=self._setup(), user_planned=self._budget.user_planned,
            early_stopping=self.early_stopping, loss_traces=self.loss_traces,
        )  # fmt: skip
        if self.early_stopping is not None and run.early_stopping is not None:  # both, or neither
            self.early_stopping.load_state_dict(run.early_stopping)
        if self.loss_traces is not None and run.loss_traces is not None:  # both, or neither
            self.loss_traces.load_state_dict(run.loss_traces)
        self.history, self.records = run.history, run.records
        self._traps.stopping_checked = bool(self.history)  # checked at the run's first report
        self._last_step, self._stop = run.last_step, run.stop
        self.n_failed, self._budget.spent = run.n_failed, run.n_certified_checks
        self.run_id = run.run_id
        self._budget.planned_checks = run.planned_checks


def _say_violations(report: Report) -> None:
    """Each DP-violation message of ``report`` in the log and as a warning at the user's line."""
    for message in report.messages:
        logger.warning(message)
        warnings.warn(message, PrivacyViolationWarning, stacklevel=stacklevel_to_user())
