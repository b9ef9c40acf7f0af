"""Gradient canaries for one-run DP audits: Dirac canaries inside an Opacus optimizer. Input
canaries, for any model, are in :mod:`~privmon.audit.input_canaries`.

A one-run audit (Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run",
Algorithm 1) includes each of m canaries with probability ½, trains once, scores every canary and
turns how well the scores tell the included canaries from the others into a lower bound on ε
(:func:`privmon.audit.one_run_epsilon`). This module makes and scores the white-box canaries
(higher = included): :class:`GradientCanaries`, DP-SGD's own mechanism, audited exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from privmon._digest import check_sealed, sealed
from privmon._validation import check_int, check_names
from privmon.audit import opacus_adapter as adapter
from privmon.audit.mechanism import MECHANISM_CHECKS, MechanismFinding
from privmon.audit.mechanism_checks import MechanismChecks
from privmon.audit.one_run import inclusion_bits

__all__ = ["GradientCanaries"]

logger = logging.getLogger("privmon")


class GradientCanaries:
    """Dirac gradient canaries inside an Opacus ``DPOptimizer``, for a one-run audit of DP-SGD.

    Nasr et al., "Tight Auditing of Differentially Private Machine Learning": canary i is a
    gradient that is zero except coordinate i of a dedicated parameter block, where it equals the
    clipping bound C (``optimizer.max_grad_norm``, read at every step). Each canary is included
    with probability ½ (seeded, :attr:`included`); at every logical step each included canary is
    sampled like a record (Poisson, at the optimizer's sampling rate) and added to the summed
    clipped gradient before the optimizer's own ``add_noise``. It thus passes through exactly the
    noise and the scaling a record does, and an optimizer that adds less noise than the
    accountant assumes is caught: the audited ε exceeds the accountant's. :meth:`scores` gives
    each canary's coordinate of the block's gradient summed over the steps, as the update rule
    received it (higher = included), for :func:`privmon.audit.one_run_epsilon`: no learning rate
    or update rule enters (under SGD with one constant lr, the same order and bounds as the
    block's update). Only steps whose noise was added count (:attr:`steps`); a step that raised
    inside the optimizer leaves no trace.

    The block (``n_canaries`` zeros on the first parameter's device and dtype) joins the optimizer
    as a param group of its own with the first group's hyperparameters: create the canaries before
    any LR scheduler (one bound earlier, ``ReduceLROnPlateau`` included, is refused), and load an
    optimizer state saved without them before attaching them (a ValueError names the block
    otherwise). The model's training is unchanged in
    distribution, not bit for bit: Opacus draws ``n_canaries`` more normals per step from its
    noise source (with ``noise_multiplier=0`` the weights are bit-identical). The canaries' own
    random numbers come from a generator seeded with ``seed``. ``optimizer.state_dict()`` holds
    the block's group: a checkpoint loads into an optimizer carrying the same canaries
    (:meth:`state_dict`). Under distributed Opacus (``DistributedDPOptimizer``, which adds the
    noise on rank 0 and sums the ranks' gradients) the canaries join on rank 0 only, so they count
    once: every rank creates them alike, and :attr:`sample_counts` are rank 0's. Per-layer,
    adaptive and ghost clipping are refused. How the
    block stays out of the per-sample clipping, and its cost: docs, Theory page, *Gradient
    canaries*.

    The canaries test one assumption of the accountant, the noise. ``checks`` runs the
    :class:`~privmon.audit.MechanismChecks` of the others too (clipping, sampling, steps, the
    weights ledger; on by default, ``checks=()`` off): :meth:`mechanism` gives their findings,
    :attr:`statistical_tests` the ones with p-values, and :meth:`state_dict` carries their state.
    They change neither the training nor the canaries' scores.

    Use as a context manager (or call :meth:`detach`) to restore the optimizer.

    Args:
        optimizer: the ``DPOptimizer`` that ``PrivacyEngine.make_private`` returned.
        n_canaries: number of canaries m (>= 2).
        seed: seeds the inclusion bits and the sampling generator (>= 0); a draw that includes
            all or none of the canaries (probability 2^(1-m)) is refused: take another seed or
            more canaries.
        sample_rate: probability that a record is in a batch. None (default) reads the rate
            Opacus' accountant hook was built with; a value must agree with it when both exist.
        checks: the mechanism checks to run, a subset of
            :data:`~privmon.audit.MECHANISM_CHECKS` (all by default; empty: none).

    Examples:
        >>> import torch
        >>> from opacus import PrivacyEngine
        >>> from privmon.audit import GradientCanaries, one_run_epsilon
        >>> _ = torch.manual_seed(0)
        >>> data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        >>> model = torch.nn.Linear(4, 2)
        >>> engine = PrivacyEngine()
        >>> model, optimizer, loader = engine.make_private(
        ...     module=model,
        ...     optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...     data_loader=torch.utils.data.DataLoader(data, batch_size=16),
        ...     noise_multiplier=1.0,
        ...     max_grad_norm=1.0,
        ... )
        >>> with GradientCanaries(optimizer, 1000, seed=0) as canaries:
        ...     for x, y in loader:  # one epoch: 4 steps
        ...         optimizer.zero_grad()
        ...         torch.nn.functional.cross_entropy(model(x), y).backward()
        ...         optimizer.step()
        >>> in_scores, out_scores = canaries.scores()
        >>> canaries.steps, len(in_scores) + len(out_scores)
        (4, 1000)
        >>> [f.evidence for f in canaries.mechanism() if f.fired]  # no mechanism check fired
        []
        >>> audit = one_run_epsilon(in_scores, out_scores, delta=1e-5)
        >>> bool(audit.epsilon <= engine.get_epsilon(delta=1e-5))  # the accountant's ε holds
        True
    """

    def __init__(
        self,
        optimizer: Any,
        n_canaries: int,
        *,
        seed: int = 0,
        sample_rate: float | None = None,
        checks: Iterable[str] = MECHANISM_CHECKS,
    ) -> None:
        enabled = check_names(checks, MECHANISM_CHECKS, name="checks")
        self._optimizer = adapter.check_canary_optimizer(
            optimizer, enabled, runnable=MechanismChecks.runnable(optimizer)
        )
        self._n = check_int(n_canaries, name="n_canaries", minimum=2)
        self._seed = check_int(seed, name="seed", minimum=0)
        self._sample_rate = adapter.canary_sample_rate(sample_rate, optimizer)
        self._rank, _ = adapter.rank_and_world(optimizer)
        params = list(optimizer.params)
        if not params:
            raise ValueError("optimizer has no trainable parameters to audit")
        device, dtype = params[0].device, params[0].dtype
        included, rng = inclusion_bits(self._n, seed=self._seed)
        self._included = torch.from_numpy(included).to(device)
        self._generator = torch.Generator(device=device).manual_seed(int(rng.integers(2**62)))
        self._counts = torch.zeros(self._n, dtype=torch.int64, device=device)
        self._steps = 0
        # Σ over the steps of the block's noised gradient, as the update rule receives it
        exact = torch.float32 if device.type == "mps" else torch.float64
        self._sums = torch.zeros(self._n, dtype=exact, device=device)
        self._final: torch.Tensor | None = None  # the scores frozen by detach()
        self._undo: tuple[torch.Tensor, torch.Tensor] | None = None  # a step's canaries, undone
        self._noised: tuple[torch.Tensor | None] | None = None  # add_noise came back
        self._due = False  # a noised step's update is due: its gradient joins the sums
        self._stopped: str | None = None  # why the canaries stopped (a hook of theirs raised)
        self._block = nn.Parameter(torch.zeros(self._n, device=device, dtype=dtype))
        self._join(optimizer, enabled)

    def _join(self, optimizer: Any, enabled: tuple[str, ...]) -> None:
        """The block joins the optimizer as a param group of its own (the first group's
        hyperparameters), the canaries' hooks wrap its step, and the mechanism checks attach."""
        self._block.summed_grad = None  # type: ignore[attr-defined] # as DPOptimizer sets
        group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        inner = optimizer.original_optimizer
        inner.add_param_group({**group, "params": [self._block]})
        self._hooks = adapter.install(
            optimizer,
            {
                "add_noise": self._add_noise,
                "pre_step": self._pre_step,
                "clip_and_accumulate": self._clip_and_accumulate,
            },
        )
        self._handles = [
            inner.register_step_pre_hook(self._before_update),
            inner.register_load_state_dict_pre_hook(self._before_load),
        ]
        adapter.claim(optimizer, "canaries", self)
        # outside the canaries' hooks: the checks see the block's canaries as part of the sum
        try:
            self._checks = MechanismChecks(optimizer, checks=enabled, canary_block=self._block)
        except BaseException:
            self._checks = MechanismChecks(optimizer, checks=())
            self.detach()
            raise

    # -- the optimizer's step ------------------------------------------------------------
    def _stop(self, event: str, error: BaseException) -> None:
        """The canaries' own work in a step (sampling them into the block's sum, adding the
        block's gradient to the scores) raised: they stop there, said once (the error's type,
        never its message: it may hold a value), and the step goes on. From then on the block
        still takes part in every step as a parameter with zero per-sample gradients (as on
        every rank under torch.distributed), no canary is sampled, and the scores are
        undecided (:meth:`scores` raises, saying why)."""
        if self._stopped is None:
            self._stopped = (
                f"their {event} hook raised {type(error).__name__} after {self._steps} steps"
            )
            logger.error(
                "privmon: the GradientCanaries stopped: %s; training goes on, and their scores "
                "are undecided from here",
                self._stopped,
            )
        self._undo, self._noised, self._due = None, None, False

    def _pre_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Give the block a per-sample gradient that costs no memory (zeros expanded to the
        batch size of a model parameter's, one per accumulated batch), so Opacus' bookkeeping
        (``grad_samples``, ``accumulated_iterations``) counts it like every parameter; then
        Opacus' ``pre_step``. A step counts once its noise was added and ``pre_step`` came back
        (as the accountant counts it); one that raised leaves no trace: the block's summed
        gradient and the sampling generator are put back."""
        block = self._block
        reference = next(p for p in self._optimizer.params if p is not block)
        samples = getattr(reference, "grad_sample", None)
        zero = torch.zeros((), device=block.device, dtype=block.dtype)
        if isinstance(samples, torch.Tensor):
            block.grad_sample = zero.expand(len(samples), self._n)  # type: ignore[attr-defined]
        elif isinstance(samples, list):
            block.grad_sample = [zero.expand(len(s), self._n) for s in samples]  # type: ignore[attr-defined]
        else:  # Opacus reports the model parameter's missing per-sample gradient itself
            block.grad_sample = None  # type: ignore[attr-defined]
        self._undo, self._noised, self._due = None, None, False
        try:
            result = original(*args, **kwargs)
        except BaseException:
            if self._undo is not None:
                before, state = self._undo
                block.summed_grad.copy_(before)
                self._generator.set_state(state)
            self._undo = self._noised = None
            raise
        noised, self._undo, self._noised = self._noised, None, None
        if noised is not None:
            try:
                (sampled,) = noised
                if sampled is not None:
                    self._counts += sampled
                self._steps += 1
                self._due = True
            except Exception as error:
                self._stop("pre_step", error)
        return result

    def _clip_and_accumulate(self, original: Any) -> None:
        """Opacus' clipping without the block (whose per-sample gradients are exactly zero: the
        norms are unchanged), then the block's share of the clipped sum, zero."""
        block = self._block
        block.requires_grad_(False)  # Opacus' ``params`` skips it
        try:
            original()
        finally:
            block.requires_grad_(True)
        if block.summed_grad is None:  # type: ignore[attr-defined]
            block.summed_grad = torch.zeros_like(block)  # type: ignore[attr-defined]

    def _add_noise(self, original: Any) -> None:
        """Once per logical step: sample the included canaries, add C · (sampled) to the block's
        summed clipped gradient, then the optimizer's own noise (distributed: on rank 0, where
        Opacus adds the noise, before it sums the ranks' gradients), whatever the canaries' part
        did."""
        sampled = None
        if self._stopped is None:
            try:
                sampled = self._sample()
            except Exception as error:
                self._stop("add_noise", error)
        original()
        if self._stopped is None:
            self._noised = (sampled,)

    def _sample(self) -> torch.Tensor | None:
        """This step's sampled canaries, added at C to the block's summed gradient (rank 0)."""
        if self._rank != 0:
            return None
        opt = self._optimizer
        summed = self._block.summed_grad  # type: ignore[attr-defined]
        self._undo = (summed.clone(), self._generator.get_state())
        rate = min(1.0, self._sample_rate * opt.accumulated_iterations)
        draws = torch.rand(self._n, generator=self._generator, device=self._counts.device)
        sampled = (draws < rate) & self._included
        summed.add_(sampled.to(summed.dtype), alpha=float(opt.max_grad_norm))
        return sampled

    def _before_update(self, *_: Any) -> None:
        """Before the underlying optimizer's update of a noised step: the block's gradient (noised,
        scaled and, distributed, summed over the ranks) joins the scores."""
        if self._due:
            self._due = False
            try:
                if self._block.grad is not None:
                    self._sums.add_(self._block.grad)
            except Exception as error:
                self._stop("step", error)

    def _before_load(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Name the canary block when a state saved without it is loaded."""
        saved = len(state.get("param_groups", ()))
        if saved == len(optimizer.param_groups) - 1:
            raise ValueError(
                f"the optimizer state has {saved} param groups; the optimizer has "
                f"{saved + 1}: the last is the GradientCanaries' block, so the state was saved "
                "without the canaries. Load it before attaching the GradientCanaries (they add "
                "their param group after), or save it with them"
            )

    # -- results ---------------------------------------------------------------------------
    def _values(self) -> torch.Tensor:
        """The block now, float64 on the CPU."""
        return self._block.detach().to("cpu", torch.float64).clone()

    def _scores(self) -> torch.Tensor:
        """The scores now, float64 on the CPU."""
        return self._sums.to("cpu", torch.float64).clone()

    def scores(self) -> tuple[np.ndarray, np.ndarray]:
        """(in_scores, out_scores): each canary's coordinate of the block's gradient summed over
        the noised steps, as the update rule received it (noised, scaled by Opacus; higher =
        included), for the included and the excluded canaries, each in canary order, float64.
        Learning rates and the update rule play no part: under SGD with one constant lr the
        block's update θ_0 − θ_T is lr times the scores.

        After :meth:`detach` the scores are those of the moment it was called.

        Raises:
            RuntimeError: the canaries stopped (a hook of theirs raised inside a step): their
                scores are undecided.
        """
        if self._stopped is not None:
            raise RuntimeError(f"the GradientCanaries stopped ({self._stopped}): no scores")
        score = (self._final if self._final is not None else self._scores()).numpy()
        included = self.included
        return score[included], score[~included]

    @property
    def included(self) -> np.ndarray:
        """Which canaries are included (bool, shape (n_canaries,); fair coins drawn from the
        seed)."""
        return self._included.cpu().numpy().copy()

    @property
    def sample_counts(self) -> np.ndarray:
        """How many counted steps sampled each canary (int64; always 0 for excluded
        canaries)."""
        return self._counts.cpu().numpy().copy()

    @property
    def steps(self) -> int:
        """Logical steps the canaries took part in: those whose noise was added, not skipped
        virtual ones nor steps that raised inside the optimizer."""
        return self._steps

    @property
    def sample_rate(self) -> float:
        """Probability that a canary is sampled at a step (the records' rate)."""
        return self._sample_rate

    @property
    def n_canaries(self) -> int:
        """Number of canaries m."""
        return self._n

    @property
    def attached(self) -> bool:
        """True until :meth:`detach`."""
        return self._final is None

    # -- mechanism checks ----------------------------------------------------------------------
    def mechanism(self, accountant: Any = None) -> tuple[MechanismFinding, ...]:
        """The mechanism checks' findings over the run so far (:meth:`MechanismChecks.mechanism`;
        empty with ``checks=()``)."""
        return self._checks.mechanism(accountant)

    @property
    def statistical_tests(self) -> tuple[tuple[str, str], ...]:
        """The (check, test) pairs of the mechanism checks that give p-values."""
        return self._checks.statistical_tests

    @property
    def mechanism_checks(self) -> MechanismChecks:
        """The mechanism checks these canaries carry (``checks=``)."""
        return self._checks

    # -- detaching and checkpoints -----------------------------------------------------------
    def detach(self) -> None:
        """Restore the optimizer as it was: its methods, its param groups and its state without
        the block. Scores stay readable, frozen at this moment. Calling it again does nothing.

        Raises:
            RuntimeError: a method the canaries wrapped was wrapped again by someone else
                since (detach that first).
        """
        if not self.attached:
            return
        opt = self._optimizer
        self._checks.detach()
        adapter.uninstall(opt, self._hooks, "canaries")
        adapter.release(opt, "canaries")
        for handle in self._handles:
            handle.remove()
        self._final = self._scores()
        block = self._block
        groups = opt.original_optimizer.param_groups
        groups[:] = [g for g in groups if not any(p is block for p in g["params"])]
        opt.original_optimizer.state.pop(block, None)
        for name in ("grad_sample", "summed_grad"):
            setattr(block, name, None)
        block.grad = None

    def __enter__(self) -> GradientCanaries:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def state_dict(self) -> dict[str, Any]:
        """What resumes the audit after a checkpoint and lets :meth:`load_state_dict` check it
        is loaded into the same canaries: configuration (n, seed, sampling rate, inclusion
        bits), progress (sample counts, steps, the sampling generator's state, the scores) and
        the block's values; with mechanism checks, theirs under ``"mechanism"``
        (:meth:`MechanismChecks.state_dict`); sealed with the digest of all of it. Tensors on
        the CPU (``torch.save``-able)."""
        state = {
            "n_canaries": self._n,
            "seed": self._seed,
            "sample_rate": self._sample_rate,
            "included": self._included.cpu().clone(),
            "sample_counts": self._counts.cpu().clone(),
            "steps": self._steps,
            "generator_state": self._generator.get_state(),
            "scores": self._scores(),
            "values": self._values(),
        }
        if self._checks.checks:
            state["mechanism"] = self._checks.state_dict()
        if self._stopped is not None:
            state["stopped"] = self._stopped
        return sealed(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: sample counts, steps, the sampling generator, the
        scores and the block's values; the optimizer's own state for the block (momentum, Adam
        moments) comes back with ``optimizer.load_state_dict``. The mechanism checks' state is
        loaded when both ``state`` and these canaries have one.

        Raises:
            ValueError: ``state`` is damaged (its content no longer matches its digest) or
                carries no digest, lacks a field, or was saved by canaries of another
                configuration (the message names the first field that differs).
        """
        check_sealed(state, what="GradientCanaries state")
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state) - {"mechanism", "stopped"})
        if missing:
            raise ValueError(f"state is not a GradientCanaries state_dict: it lacks {missing}")
        for key in ("n_canaries", "seed", "sample_rate"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"state was saved by canaries with {key}={state[key]!r}; these have "
                    f"{key}={mine[key]!r}"
                )
        if not torch.equal(torch.as_tensor(state["included"]), mine["included"]):
            raise ValueError("state's included bits differ from these canaries'")
        counts = torch.as_tensor(state["sample_counts"], dtype=torch.int64)
        values, sums = torch.as_tensor(state["values"]), torch.as_tensor(state["scores"])
        if counts.shape != (self._n,) or bool((counts[~mine["included"]] != 0).any()):
            raise ValueError("state's sample_counts do not fit these canaries")
        for key, value in (("values", values), ("scores", sums)):
            if value.shape != (self._n,):
                raise ValueError(f"state's {key} must have shape ({self._n},)")
        self._counts.copy_(counts)
        self._sums.copy_(sums)
        self._steps = check_int(state["steps"], name="state['steps']")
        self._generator.set_state(state["generator_state"])
        with torch.no_grad():
            self._block.copy_(values)
        if "mechanism" in mine and state.get("mechanism") is not None:
            self._checks.load_state_dict(state["mechanism"])
        self._stopped = state.get("stopped")  # saved by canaries that had stopped: still so
