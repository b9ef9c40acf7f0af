"""Mechanism checks of DP-SGD inside an Opacus optimizer: at every private step, a test of each
assumption the accountant makes (clipping, noise, sampling, steps, nothing else touching the
weights) on what the step really did, each one a
:class:`~privmon.audit.MechanismCheck` that this module composes and feeds the
optimizer's events. The findings are :class:`~privmon.audit.MechanismFinding` records; the
derivations are on the docs' Theory page, *Mechanism checks*."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from privmon._digest import check_sealed, sealed
from privmon._validation import check_names
from privmon.audit import opacus_adapter as adapter
from privmon.audit.mechanism import MECHANISM_CHECKS, MechanismFinding
from privmon.audit.mechanism_check import (
    MechanismCheck,
    StepContext,
    stop_check,
    stopped_findings,
)
from privmon.audit.mechanism_clipping import ClippingCheck
from privmon.audit.mechanism_counts import SamplingCheck, StepsCheck
from privmon.audit.mechanism_ledger import LedgerCheck
from privmon.audit.mechanism_noise import NoiseCheck

__all__ = ["MechanismChecks"]


# The checks of :data:`~privmon.audit.MECHANISM_CHECKS`, by name.
_BUILT_IN: dict[str, type[MechanismCheck]] = {
    check.name: check
    for check in (ClippingCheck, NoiseCheck, SamplingCheck, StepsCheck, LedgerCheck)
}


def _chosen(checks: Any) -> list[MechanismCheck]:
    """``checks`` (names of built-in checks, in their order, then check objects, as given)."""
    items = [checks] if isinstance(checks, str) else checks
    if isinstance(items, Iterable):
        items = list(items)
        objects = [c for c in items if isinstance(c, MechanismCheck)]
        items = [c for c in items if not isinstance(c, MechanismCheck)]
    else:
        objects = []
    names = check_names(items, MECHANISM_CHECKS, name="checks")
    chosen = [_BUILT_IN[name]() for name in names] + objects
    seen = [c.name for c in chosen]
    for check in objects:
        if not check.name or "/" in check.name or seen.count(check.name) > 1:
            raise ValueError(
                f"checks: a MechanismCheck's name must be unique, without '/', got "
                f"{check.name!r} among {seen}"
            )
    return chosen


def _refuse_unsupported(context: StepContext, checks: list[MechanismCheck]) -> None:
    """Refuse the checks that cannot run on ``context.optimizer``, saying which of the others
    do run on it and with which configurations of Opacus the refused ones run."""
    found = adapter.opacus_family(context.optimizer)
    family, kind = found if found is not None else (None, "")
    reasons = [(c, c.refusal(context, family=family)) for c in checks]
    blocked = [(c, why) for c, why in reasons if why]
    if not blocked:
        return
    rest = tuple(c.name for c, why in reasons if not why)
    names = ", ".join(c.name for c, _ in blocked)
    why = "; ".join(f"{c.name}: {why}" for c, why in blocked)
    others = (
        f"Pass checks={rest!r} to run the others"
        if rest
        else f"None of the checks asked for runs on it (checks={tuple(c.name for c in checks)!r})"
    )
    if family is None:
        raise ValueError(
            f"on this optimizer, the mechanism checks {names} cannot run ({why}). {others}."
        )
    where = adapter.runs_with(lambda f: any(c.refusal(context, family=f) for c, _ in blocked))
    raise ValueError(
        f"optimizer is an Opacus {kind}, on which the mechanism checks {names} cannot run "
        f"({why}). {others}; {names} run with {where}."
    )


def _refuse_carried(optimizer: Any, canary_block: Any) -> None:
    """Refuse an optimizer that carries other mechanism checks, or (``canary_block`` None:
    these are no canaries' own) gradient canaries."""
    if adapter.attached(optimizer, "checks") is not None:
        raise ValueError(
            "optimizer already carries mechanism checks (a MechanismChecks, or "
            "GradientCanaries with checks on): detach() them before attaching others"
        )
    if canary_block is None and adapter.attached(optimizer, "canaries"):
        raise ValueError(
            "optimizer carries GradientCanaries: their checks= runs the mechanism checks "
            "(they know the canary block); detach() them or pass checks= to them"
        )


class MechanismChecks:
    """Tests of the assumptions the accountant makes, inside an Opacus ``DPOptimizer``.

    The accountant's ε holds for one mechanism: each step a batch drawn by Poisson sampling at
    rate q from N records, each record's gradient clipped to norm C, the clipped sum plus
    N(0, σ²C²) noise, T such steps, nothing else touching the weights. At every private step
    (one that reached the optimizer's ``add_noise``) the checks record what the step really did
    and :meth:`mechanism` turns it into one :class:`~privmon.audit.MechanismFinding` per test:

    - ``clipping`` (deterministic): a synthetic row of norm 100 C, equal on every clipped
      parameter, replayed through the optimizer's own ``clip_and_accumulate`` on scratch state,
      must contribute at most C (as the step read it after its noise), up to the rounding the
      parameters' dtype allows; and no non-finite per-sample gradient reached a noised update
      (``finite``: the step and the row of its batch where one first did);
    - ``noise``: the noise actually added (``p.grad − p.summed_grad`` right after ``add_noise``,
      up to 65,536 values per step, of the model and the canary block, where the gradients'
      dtype resolves it) against N(0, σ²C²) with the σ and C the accountant read (statistical,
      one-sided); and no step repeating another's noise (deterministic: a digest per step);
    - ``sampling`` (statistical): rows per step against Binomial(N, q t) (mean and dispersion),
      for every N that ``expected_batch_size`` allows;
    - ``steps`` (deterministic): private steps taken = steps the accountant counted (across a
      resume, through :meth:`state_dict`);
    - ``ledger`` (deterministic): each private step starts from the weights the one before
      left, and the weights at a check are those the last private step left (version counters
      and storage, no copy), and no optimizer step without noise changed a
      value (told by a copy of the parameters with a gradient, taken before such a step only).

    The checks use no random numbers and never change the gradients, the optimizer's state or
    the weights: training is bit-identical with and without them. A check one of whose hooks
    raises inside the step stops there (logged once; its tests undecided from then on, said in
    its findings) and the step goes on. Each can be switched off by
    name; a check of your own joins them as an object (``checks=``). Refused where a check
    cannot run (ghost clipping without ``module``: clipping; FSDP2 without it: clipping and
    sampling), saying which run there (:meth:`runnable`) and where the refused ones run; flat,
    per-layer and adaptive clipping run on one process, flat and per-layer under DDP too, ghost
    clipping on one process, under DDP and under FSDP2 (each rank tests its own shard: its
    noise, its batch, its weights; the monitor's exchange combines the ranks' findings). Use as
    a context manager (or call :meth:`detach`). :class:`~privmon.audit.GradientCanaries`
    creates one (its ``checks=``): use either.

    Args:
        optimizer: the ``DPOptimizer`` that ``PrivacyEngine.make_private`` returned.
        checks: which of :data:`~privmon.audit.MECHANISM_CHECKS` to run (empty: none), by
            name; and further checks of your own, as
            :class:`~privmon.audit.MechanismCheck` objects (run after the
            built-in ones, their findings after theirs, their state in :meth:`state_dict`).
        canary_block: a parameter of the optimizer that is no model parameter and sees only
            noise (GradientCanaries' block): its noise joins the noise test, and the clipping
            probe and the row count leave it out.
        module: under ghost clipping (``grad_sample_mode="ghost"`` or ``"ghost_fsdp"``), the
            model ``make_private`` returned: it computes the clipping coefficients in the
            loss's backward pass, which the clipping check probes and counts (without it, the
            clipping check is refused there; under FSDP2 the sampling check too: the model
            keeps the per-sample norms). Only ghost clipping takes it.

    Examples:
        >>> import torch
        >>> from opacus import PrivacyEngine
        >>> from privmon.audit import MechanismChecks
        >>> _ = torch.manual_seed(0)
        >>> data = torch.utils.data.TensorDataset(torch.randn(640, 4), torch.randint(0, 2, (640,)))
        >>> model = torch.nn.Linear(4, 2)
        >>> engine = PrivacyEngine()
        >>> model, optimizer, loader = engine.make_private(
        ...     module=model,
        ...     optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...     data_loader=torch.utils.data.DataLoader(data, batch_size=64),
        ...     noise_multiplier=1.0,
        ...     max_grad_norm=1.0,
        ... )
        >>> with MechanismChecks(optimizer) as checks:
        ...     for x, y in loader:  # one epoch: 10 steps
        ...         optimizer.zero_grad()
        ...         torch.nn.functional.cross_entropy(model(x), y).backward()
        ...         optimizer.step()
        ...     findings = checks.mechanism()
        >>> [f"{f.check}/{f.test}" for f in findings if f.kind == "statistical"]
        ['noise/variance', 'sampling/mean', 'sampling/dispersion']
        >>> any(f.fired for f in findings), all(f.p_value > 1e-3 for f in findings if f.p_value)
        (False, True)
        >>> print(findings[-2].evidence)
        steps: the accountant counted 10 noised steps, 10 were taken
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        checks: Iterable[str | MechanismCheck] = MECHANISM_CHECKS,
        canary_block: torch.nn.Parameter | None = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        self._optimizer = adapter.check_dp_optimizer(optimizer, who="MechanismChecks")
        self._checks = _chosen(checks)
        found = adapter.opacus_family(optimizer)
        ghost = found is not None and found[0] in adapter.CLIPS_IN_BACKWARD
        if module is not None and not ghost:
            raise ValueError(
                "module is read under ghost clipping only (it clips in the loss's backward "
                "pass there); this optimizer clips in its own step: leave module out"
            )
        # distributed Opacus: noise added on rank 0 (FSDP: on each rank's own shard), each rank
        # samples its shard of the dataset
        rank, world = adapter.rank_and_world(optimizer)
        self._context = StepContext(
            optimizer=optimizer,
            block=canary_block,
            module=None if module is None else adapter.check_ghost_module(module, optimizer),
            rank=rank,
            world=world,
            sharded=found is not None and found[0] is adapter.FSDP,
            sample_rate=adapter.hook_sample_rate(optimizer),
        )
        _refuse_unsupported(self._context, self._checks)
        if self._checks:
            _refuse_carried(optimizer, canary_block)
        self._noised = False  # add_noise came back within the current pre_step
        self._frozen: tuple[MechanismFinding, ...] | None = None  # the findings at detach
        self._hooks: list[adapter.Hook] = []
        if self._checks:
            self._hooks = adapter.install(
                optimizer,
                {
                    "add_noise": self._add_noise,
                    "pre_step": self._pre_step,
                    # ghost clipping clips in the backward pass; its step accumulates the sums
                    **(
                        {"accumulate": self._accumulate}
                        if ghost
                        else {"clip_and_accumulate": self._clip_and_accumulate}
                    ),
                },
            )
            for check in self._checks:
                check.attach(self._context)
            adapter.claim(optimizer, "checks", self)

    @staticmethod
    def runnable(optimizer: Any) -> tuple[str, ...]:
        """The built-in checks (of :data:`~privmon.audit.MECHANISM_CHECKS`) that run on
        ``optimizer``: ``MechanismChecks(optimizer, checks=MechanismChecks.runnable(optimizer))``
        is never refused for its family.

        Examples:
            >>> import torch
            >>> from opacus.optimizers import DPOptimizer
            >>> from privmon.audit import MechanismChecks
            >>> params = torch.nn.Linear(2, 2).parameters()
            >>> flat = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0,
            ...                    max_grad_norm=1.0, expected_batch_size=4)
            >>> MechanismChecks.runnable(flat)
            ('clipping', 'noise', 'sampling', 'steps', 'ledger')
        """
        found = adapter.opacus_family(optimizer)
        family = found[0] if found is not None else None
        return tuple(
            name for name, check in _BUILT_IN.items()
            if not check().refusal(StepContext(optimizer=optimizer), family=family)
        )  # fmt: skip

    # -- the optimizer's step: the checks' events ----------------------------------------
    def _clip_and_accumulate(self, original: Any) -> None:
        """Opacus' clipping; then the checks hear how many rows it clipped (not the probe's)."""
        self._clipping(original, adapter.rows_to_clip)

    def _accumulate(self, original: Any) -> None:
        """Ghost clipping's sum of the step's clipped gradient; then the checks hear how many
        rows its backward pass clipped."""
        opt, module = self._context.optimizer, self._context.module
        self._clipping(original, lambda params: adapter.ghost_rows(opt, params, module))

    def _clipping(self, original: Any, rows_of: Any) -> None:
        context = self._context
        if context.probing:
            original()
            return
        try:
            counted = rows_of(context.params)
        except Exception as error:  # what every check hears of the call: none can go on
            for check in self._checks:
                stop_check(check.name, context, "clipping", error)
            counted = None
        done = False
        try:
            original()
            done = True
        finally:
            if counted is not None:
                rows, fresh = counted
                self._tell(
                    "clipping", lambda c: c.clipped(context, rows=rows if done else 0, fresh=fresh)
                )

    def _add_noise(self, original: Any) -> None:
        """The optimizer's noise; then the checks read it (before ``scale_grad``)."""
        self._noised = False
        original()
        self._noised = True
        self._tell("noise", lambda c: c.noised(self._context))

    def _pre_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Opacus' ``pre_step``; once a step reached the noise and came back, it is counted and
        the checks hear of it (with the σ and C the accountant read)."""
        context = self._context
        self._noised = False
        block = context.block
        context.params = [p for p in self._optimizer.params if p is not block]
        result = original(*args, **kwargs)
        noised, self._noised = self._noised, False
        if noised:
            context.steps += 1
            self._tell("step", lambda c: c.private_step(context))
        return result

    def _tell(self, event: str, call: Callable[[MechanismCheck], None]) -> None:
        """Every running check hears ``event`` (``call``); one that raises stops
        (:func:`~privmon.audit.mechanism_check.stop_check`), and the step goes on."""
        for check in self._checks:
            if check.name in self._context.stopped:
                continue
            try:
                call(check)
            except Exception as error:
                stop_check(check.name, self._context, event, error)

    # -- findings --------------------------------------------------------------------------
    def mechanism(self, accountant: Any = None) -> tuple[MechanismFinding, ...]:
        """One finding per enabled test, in the order of the checks and their tests, over the
        run so far.

        Args:
            accountant: the accountant whose ε is reported (an Opacus accountant or a
                ``PrivacyEngine``); default the one the optimizer's step hook counts with.

        After :meth:`detach`, the findings of the moment it was called.
        """
        if self._frozen is not None:
            return self._frozen
        context, found = self._context, []
        for check in self._checks:
            if check.name not in context.stopped:
                try:
                    found += check.findings(context, accountant=accountant)
                    continue
                except Exception as error:
                    stop_check(check.name, context, "findings", error)
            found += stopped_findings(check, context.stopped[check.name])
        return tuple(found)

    @property
    def statistical_tests(self) -> tuple[tuple[str, str], ...]:
        """The (check, test) pairs that give p-values, in order (constant for the object)."""
        return tuple(
            (c.name, test) for c in self._checks for test, kind in c.tests if kind == "statistical"
        )

    @property
    def checks(self) -> tuple[str, ...]:
        """The enabled checks' names: those of :data:`~privmon.audit.MECHANISM_CHECKS` in its
        order, then those of the check objects given."""
        return tuple(c.name for c in self._checks)

    @property
    def steps(self) -> int:
        """Private steps counted (those before a resume included, after loading its state)."""
        return self._context.steps

    @property
    def attached(self) -> bool:
        """True until :meth:`detach`."""
        return self._frozen is None

    # -- detaching and checkpoints -----------------------------------------------------------
    def detach(self) -> None:
        """Restore the optimizer's methods and hooks; the findings stay readable, frozen at this
        moment. Calling it again does nothing.

        Raises:
            RuntimeError: a method the checks wrapped was wrapped again by someone else since
                (detach that first).
        """
        if self._frozen is not None:
            return
        frozen = self.mechanism()
        adapter.uninstall(self._optimizer, self._hooks, "mechanism checks")
        for check in self._checks:
            check.detach()
        if self._checks:
            adapter.release(self._optimizer, "checks")
        self._frozen = frozen

    def __enter__(self) -> MechanismChecks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def state_dict(self) -> dict[str, Any]:
        """What resumes the checks after a checkpoint: the private steps taken and each
        check's state by name (:meth:`MechanismCheck.state_dict`: the accountant's count when
        the checks were first attached, so that a resume whose accountant lost its state is
        seen; the noise statistics and the steps' digests, 8 bytes a step; the row counts; the
        probe's worst case; the steps taken without noise) and the checks stopped (a hook of
        theirs raised: why), sealed with the digest of all of it. The ledger restarts at the
        next private step."""
        return sealed(
            {
                "steps": self._context.steps,
                "checks": {c.name: c.state_dict() for c in self._checks},
                "stopped": dict(self._context.stopped),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            ValueError: ``state`` is damaged (its content no longer matches its digest) or
                carries no digest, lacks a field, was saved by checks of another
                configuration, or by a privmon before the checks kept a state each (its
                ``checks`` is a list of names: such a state cannot be loaded).
        """
        check_sealed(state, what="MechanismChecks state")
        missing = sorted({"steps", "checks"} - set(state))
        if missing:
            raise ValueError(f"state is not a MechanismChecks state_dict: it lacks {missing}")
        saved = state["checks"]
        if not isinstance(saved, dict):
            raise ValueError(
                "state was saved by a privmon before each mechanism check kept a state of its "
                f"own (its checks are the list {list(saved)!r}); this privmon cannot load it: "
                "resume with the privmon that saved it, or start the checks afresh"
            )
        if tuple(saved) != self.checks:
            raise ValueError(
                f"state was saved by checks={tuple(saved)!r}; these have checks={self.checks!r}"
            )
        for check in self._checks:
            check.load_state_dict(saved[check.name])
        self._context.steps = int(state["steps"])
        self._context.stopped = dict(state.get("stopped", {}))  # none before checks could stop
