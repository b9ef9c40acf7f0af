"""Mechanism checks of DP-SGD inside an Opacus optimizer: at every private step, a test of each
assumption the accountant makes (clipping, noise, sampling, steps, nothing else touching the
weights) on what the step really did. The findings are
:class:`~privmon.audit.MechanismFinding` records; the derivations are on the docs' Theory page,
*Mechanism checks*."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from privmon._digest import check_sealed, sealed
from privmon._validation import check_names
from privmon.audit import mechanism_evidence as evidence
from privmon.audit import opacus_hooks as hooks
from privmon.audit.mechanism import MECHANISM_CHECKS, MechanismFinding
from privmon.audit.mechanism_evidence import PROBE_NORM, TESTS
from privmon.audit.mechanism_math import CLIP_TOLERANCE, RowCounts, clip_tolerance
from privmon.audit.mechanism_noise import fixed_tensor, read_noise

__all__ = ["MechanismChecks"]

logger = logging.getLogger("privmon")

# The probe runs at the first PROBE_FIRST private steps, every PROBE_EVERY-th, and whenever C,
# the optimizer's class or its clip_and_accumulate changed since the last probe.
PROBE_FIRST, PROBE_EVERY = 10, 10
_MISSING = object()
_GHOST = {
    "clipping": "ghost clipping computes the per-sample norms inside the backward pass and keeps "
    "no per-sample gradients, so there is no clipping step to replay a row through",
    "sampling": "ghost clipping keeps no per-sample gradients to count the rows of a step with",
}
_ADACLIP = {
    "clipping": "AdaClip moves max_grad_norm after each step's noise, so the bound read after the "
    "step is not the one the step clipped to",
    "noise": "AdaClip splits the noise between the gradient and a noisy count of unclipped rows: "
    "the gradient's noise is not N(0, σ²C²)",
}
_PER_LAYER_DDP = {
    check: "it clips and noises each layer inside the backward pass, with no clipping or noise "
    "step of the optimizer to look into"
    for check in MECHANISM_CHECKS
}
_FSDP = {
    check: "FSDP shards every tensor over the ranks; the checks read whole tensors"
    for check in MECHANISM_CHECKS
}
# Opacus optimizers on which some checks cannot run: check -> why.
CANNOT_RUN: dict[str, dict[str, str]] = {
    "DPOptimizerFastGradientClipping": _GHOST,
    "DistributedDPOptimizerFastGradientClipping": _GHOST,
    "FSDPOptimizerFastGradientClipping": _FSDP,
    "SimpleDistributedPerLayerOptimizer": _PER_LAYER_DDP,
    "AdaClipDPOptimizer": _ADACLIP,
}


def _refuse_unsupported(optimizer: Any, checks: tuple[str, ...]) -> None:
    for cls in type(optimizer).__mro__:
        reasons = CANNOT_RUN.get(cls.__name__) if cls.__module__.startswith("opacus") else None
        blocked = [c for c in checks if reasons and c in reasons]
        if blocked:
            assert reasons is not None
            rest = tuple(c for c in checks if c not in blocked)
            why = "; ".join(f"{c}: {reasons[c]}" for c in blocked)
            raise ValueError(
                f"optimizer is an Opacus {cls.__name__}, on which the mechanism checks "
                f"{', '.join(blocked)} cannot run ({why}). Pass checks={rest!r} to run the "
                "others, or use flat clipping on one process (make_private(clipping='flat'), "
                "grad_sample_mode='hooks')."
            )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and values (NaN where the other is NaN)."""
    return a.shape == b.shape and bool(torch.where(a.isnan(), b.isnan(), a == b).all())


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
      parameters' dtype allows;
    - ``noise``: the noise actually added (``p.grad − p.summed_grad`` right after ``add_noise``,
      up to 65,536 values per step, of the model and the canary block, where the gradients'
      dtype resolves it) against N(0, σ²C²) with the σ and C the accountant read (statistical,
      one-sided); and no step repeating another's noise (deterministic: a digest per step);
    - ``sampling`` (statistical): rows per step against Binomial(N, q t) (mean and dispersion),
      for every N that ``expected_batch_size`` allows;
    - ``steps`` (deterministic): private steps taken = steps the accountant counted (across a
      resume, through :meth:`state_dict`);
    - ``ledger`` (deterministic): the weights at a check are those the last private step left
      (version counters and storage, no copy), and no optimizer step without noise changed a
      value (told by a copy of the parameters with a gradient, taken before such a step only).

    The checks use no random numbers and never change the gradients, the optimizer's state or
    the weights: training is bit-identical with and without them. Each can be switched off by
    name. Refused where a check cannot run (ghost clipping: clipping, sampling; AdaClip:
    clipping, noise; distributed Opacus). Use as a context manager (or call :meth:`detach`).
    :class:`~privmon.audit.GradientCanaries` creates one (its ``checks=``): use either.

    Args:
        optimizer: the ``DPOptimizer`` that ``PrivacyEngine.make_private`` returned.
        checks: which of :data:`~privmon.audit.MECHANISM_CHECKS` to run (empty: none).
        canary_block: a parameter of the optimizer that is no model parameter and sees only
            noise (GradientCanaries' block): its noise joins the noise test, and the clipping
            probe and the row count leave it out.

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
        checks: Iterable[str] = MECHANISM_CHECKS,
        canary_block: torch.nn.Parameter | None = None,
    ) -> None:
        self._optimizer = hooks.check_dp_optimizer(optimizer, who="MechanismChecks")
        self._checks = check_names(checks, MECHANISM_CHECKS, name="checks")
        _refuse_unsupported(optimizer, self._checks)
        if self._checks and hooks.attached(optimizer, "checks") is not None:
            raise ValueError(
                "optimizer already carries mechanism checks (a MechanismChecks, or "
                "GradientCanaries with checks on): detach() them before attaching others"
            )
        if self._checks and canary_block is None and hooks.attached(optimizer, "canaries"):
            raise ValueError(
                "optimizer carries GradientCanaries: their checks= runs the mechanism checks "
                "(they know the canary block); detach() them or pass checks= to them"
            )
        self._block = canary_block
        self._sample_rate = hooks.hook_sample_rate(optimizer)
        # distributed Opacus: noise added on rank 0, each rank samples its shard
        self._rank, self._world = hooks.rank_and_world(optimizer)
        accountant = hooks.hook_accountant(optimizer)
        self._counted_at_attach = hooks.accountant_steps(accountant) or 0
        self._steps = 0  # private steps since attach (and before a resume, after loading)
        self._rows = 0  # rows clipped in the current logical step
        self._probing = False
        self._params: list[Any] = []  # the model's parameters, read at each pre_step
        self._noised: tuple[Any, ...] | None = None  # what add_noise left for the step
        self._private = False  # a private step's optimizer step is due
        self._squares = 0.0  # Σ ‖z‖² / (σC)²
        self._values = 0  # noise values tested
        self._noise_steps = 0  # steps they come from
        self._scale_seen = (math.nan, math.nan)  # last (σ, C) of the noise test
        self._digests = bytearray()  # 8 bytes per step: the noise's digest
        self._counts = RowCounts()
        self._worst: tuple[float, float, int] | None = None  # (ratio, bound, step)
        self._probes = 0
        self._bound = math.nan  # the last probe's C
        self._key: tuple[Any, ...] = ()  # what the last probe ran with
        self._over = 0  # probes above C
        self._probe_error: str | None = None
        self._ledger: list[tuple[torch.Tensor, int, int]] | None = None
        self._ledger_step = 0
        self._before: list[tuple[torch.Tensor, int, int, torch.Tensor | None]] = []
        self._unnoised = 0  # optimizer steps that ran without noise
        self._first_unnoised = 0  # the private steps before the first of them
        self._frozen: tuple[MechanismFinding, ...] | None = None  # the findings at detach
        self._hooks: list[hooks.Hook] = []
        self._around: list[Any] = []  # the ledger's step pre- and post-hook
        if self._checks:
            self._hooks = hooks.install(
                optimizer,
                {
                    "add_noise": self._add_noise,
                    "pre_step": self._pre_step,
                    "clip_and_accumulate": self._clip_and_accumulate,
                },
            )
            if "ledger" in self._checks:
                inner = optimizer.original_optimizer
                self._around = [
                    inner.register_step_pre_hook(self._before_step),
                    inner.register_step_post_hook(self._after_step),
                ]
            hooks.claim(optimizer, "checks", self)

    # -- the optimizer's step ------------------------------------------------------------
    def _model_params(self) -> list[Any]:
        """The parameters the optimizer clips (the canary block left out)."""
        block = self._block
        return [p for p in self._optimizer.params if p is not block]

    def _clip_and_accumulate(self, original: Any) -> None:
        """Opacus' clipping; then the step's rows are counted (not the probe's). The count
        follows the summed gradient: it restarts with it, so rows of a step that raised before
        its noise and was cleared (``optimizer.zero_grad``) are not the next step's."""
        if self._probing:
            original()
            return
        for p in self._params:
            samples = getattr(p, "grad_sample", None)
            if isinstance(samples, torch.Tensor | list):
                if getattr(p, "summed_grad", None) is None:
                    self._rows = 0
                original()
                self._rows += (
                    len(samples)
                    if isinstance(samples, torch.Tensor)
                    else sum(len(s) for s in samples)
                )
                return
        original()

    def _add_noise(self, original: Any) -> None:
        """The optimizer's noise; then the noise it added is read (before ``scale_grad``)."""
        self._noised = None
        original()
        self._noised = self._read_noise() if "noise" in self._checks and not self._rank else ()

    def _read_noise(self) -> tuple[float, int, bytes]:
        """What the noise test reads of the step just noised (``read_noise``): a fixed tensor
        (``fixed_tensor`` of the canary block and the model's) and one of the model's in turn
        (each one every len(params) steps)."""
        opt, block, params = self._optimizer, self._block, self._params
        scale = float(opt.noise_multiplier) * float(opt.max_grad_norm)
        if not params or scale <= 0:  # σ·C = 0 is accounted (ε = ∞): no noise to test
            return 0.0, 0, b""
        fixed = fixed_tensor([block, *params] if block is not None else params)
        turn = params[self._steps % len(params)]
        return read_noise((fixed,) if turn is fixed else (fixed, turn), scale)

    def _pre_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Opacus' ``pre_step``; once a step reached the noise and came back, it is counted and
        checked with the σ and C the accountant read."""
        self._noised = None
        self._params = self._model_params()
        result = original(*args, **kwargs)
        noised, self._noised = self._noised, None
        if noised is not None:
            self._count_step(noised)
        return result

    def _count_step(self, noised: tuple[Any, ...]) -> None:
        opt = self._optimizer
        self._steps += 1
        self._private = True
        sigma, bound = float(opt.noise_multiplier), float(opt.max_grad_norm)
        if noised:
            squares, values, digest = noised
            self._digests += digest or self._steps.to_bytes(8, "little")
            if values and sigma * bound > 0:
                self._squares += squares / (sigma * bound) ** 2
                self._values += values
                self._noise_steps += 1
                self._scale_seen = (sigma, bound)
        if "sampling" in self._checks:
            if self._sample_rate is not None:
                rate = self._sample_rate * opt.accumulated_iterations
                self._counts.add(self._rows, rate)
            self._rows = 0
        if "clipping" in self._checks:
            key = (bound, type(opt), opt.__dict__.get("clip_and_accumulate"))
            if self._probes < PROBE_FIRST or self._steps % PROBE_EVERY == 0 or key != self._key:
                self._key = key
                self._check_clipping(bound)

    def _check_clipping(self, bound: float) -> None:
        try:
            contribution = self._probe(bound)
        except Exception as e:  # a custom clipping path that cannot take the probe
            if self._probe_error is None:
                logger.warning("privmon: the clipping probe could not run: %r", e)
            self._probe_error = f"{type(e).__name__}: {e}"
            return
        self._probes += 1
        self._bound = bound
        ratio = contribution / bound if bound > 0 else math.inf
        if ratio > 1 + self._clip_tolerance(bound):
            self._over += 1
        if self._worst is None or ratio > self._worst[0]:
            self._worst = (ratio, bound, self._steps)

    def _clip_tolerance(self, bound: float) -> float:
        """The rounding a correct clipping path in the parameters' precision (the coarsest of
        their dtypes: the probe's rows are in each parameter's own) allows the probe."""
        params = [p for p in self._params if p.numel() > 0]
        if not params:
            return CLIP_TOLERANCE
        info = [torch.finfo(p.dtype) for p in params]
        return clip_tolerance(
            max(i.eps for i in info),
            max(i.tiny for i in info),
            bound,
            max(p.numel() for p in params),
            len(params),
        )

    def _probe(self, bound: float) -> float:
        """The contribution ‖Σ_p summed_grad_p‖ of one row of norm PROBE_NORM · C, equal on every
        clipped parameter, through the optimizer's own ``clip_and_accumulate`` on scratch
        state (every parameter's ``grad_sample`` and ``summed_grad`` put back after)."""
        params = self._params
        saved = [(p, p.__dict__.get("grad_sample", _MISSING), p.summed_grad) for p in params]
        share = PROBE_NORM * bound / math.sqrt(max(sum(p.numel() > 0 for p in params), 1))
        try:
            for p in params:
                value = share / math.sqrt(max(p.numel(), 1))
                p.grad_sample = torch.full((1, *p.shape), value, dtype=p.dtype, device=p.device)
                p.summed_grad = None
            self._probing = True
            self._optimizer.clip_and_accumulate()
            sums = [p.summed_grad.float() for p in params if p.summed_grad is not None]
            norms = torch._foreach_norm(sums) if sums else [torch.zeros(())]
            total = float(torch.stack(norms).double().square().sum())
        finally:
            self._probing = False
            for p, samples, summed in saved:
                if samples is _MISSING:
                    p.__dict__.pop("grad_sample", None)
                else:
                    p.grad_sample = samples
                p.summed_grad = summed
        return math.sqrt(total)

    def _before_step(self, *_: Any) -> None:
        """Before a step of the underlying optimizer that no noised ``pre_step`` preceded: the
        parameters' version counters, and a copy of those with a gradient (the ones a step may
        write), to tell whether it changed a value."""
        if not self._private:
            self._before = [
                (p, v, ptr, None if p.grad is None else p.detach().clone())
                for p, v, ptr in self._fingerprint()
            ]

    def _after_step(self, *_: Any) -> None:
        """After every step of the underlying optimizer: a private one updates the ledger; any
        other that changed a parameter's value is a non-private update (one that wrote the
        values they had, as a step on zero gradients does, leaves the ledger as it was)."""
        if not self._private:
            before, self._before = self._before, []
            kept, wrote = {}, False
            for p, version, ptr, copy in before:
                if (p._version, p.data_ptr()) == (version, ptr):
                    continue
                if copy is not None and _same_values(copy, p):
                    kept[id(p)] = (version, ptr)
                else:
                    wrote = True
            if self._ledger is not None:  # entries still those of the last private step follow
                self._ledger = [
                    (q, q._version, q.data_ptr()) if kept.get(id(q)) == (v, ptr) else (q, v, ptr)
                    for q, v, ptr in self._ledger
                ]
            if wrote:
                if self._unnoised == 0:
                    self._first_unnoised = self._steps
                self._unnoised += 1
            return
        self._private, self._before = False, []
        self._ledger = self._fingerprint()
        self._ledger_step = self._steps

    def _fingerprint(self) -> list[tuple[torch.Tensor, int, int]]:
        return [
            (p, p._version, p.data_ptr())
            for group in self._optimizer.original_optimizer.param_groups
            for p in group["params"]
        ]

    # -- findings --------------------------------------------------------------------------
    def mechanism(self, accountant: Any = None) -> tuple[MechanismFinding, ...]:
        """One finding per enabled test, in the order of :data:`TESTS`, over the run so far.

        Args:
            accountant: the accountant whose ε is reported (an Opacus accountant or a
                ``PrivacyEngine``); default the one the optimizer's step hook counts with.

        After :meth:`detach`, the findings of the moment it was called.
        """
        if self._frozen is not None:
            return self._frozen
        counted = hooks.accountant_steps(accountant) if accountant is not None else None
        if counted is None:
            counted = hooks.accountant_steps(hooks.hook_accountant(self._optimizer))
        changed = None
        if self._ledger is not None:
            changed = sum((p._version, p.data_ptr()) != (v, ptr) for p, v, ptr in self._ledger)
        expected = getattr(self._optimizer, "expected_batch_size", None)
        findings = {
            "clipping": lambda: [
                evidence.clipping(
                    self._worst,
                    self._probes,
                    self._over,
                    self._steps,
                    self._bound,
                    self._probe_error,
                )
            ],
            "noise": lambda: [
                evidence.noise_variance(
                    self._squares,
                    self._values,
                    self._noise_steps,
                    math.prod(self._scale_seen),
                    self._rank,
                ),
                evidence.noise_repeat(bytes(self._digests), self._rank),
            ],
            "sampling": lambda: [
                evidence.sampling(test, self._counts, self._sample_rate, expected, self._world)
                for test in ("mean", "dispersion")
            ],
            "steps": lambda: [evidence.step_count(counted, self._counted_at_attach + self._steps)],
            "ledger": lambda: [
                evidence.ledger(self._unnoised, self._first_unnoised, changed, self._ledger_step)
            ],
        }
        return tuple(f for check in self._checks for f in findings[check]())

    @property
    def statistical_tests(self) -> tuple[tuple[str, str], ...]:
        """The (check, test) pairs that give p-values, in order (constant for the object)."""
        return tuple((c, t) for c, t, kind in TESTS if kind == "statistical" and c in self._checks)

    @property
    def checks(self) -> tuple[str, ...]:
        """The enabled checks, in the order of :data:`~privmon.audit.MECHANISM_CHECKS`."""
        return self._checks

    @property
    def steps(self) -> int:
        """Private steps counted (those before a resume included, after loading its state)."""
        return self._steps

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
        hooks.uninstall(self._optimizer, self._hooks, "mechanism checks")
        for handle in self._around:
            handle.remove()
        if self._checks:
            hooks.release(self._optimizer, "checks")
        self._frozen = frozen

    def __enter__(self) -> MechanismChecks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def state_dict(self) -> dict[str, Any]:
        """What resumes the checks after a checkpoint: the enabled checks, the private steps
        taken and the accountant's count when the checks were first attached (so that a resume
        whose accountant lost its state is seen), the noise statistics and the steps' digests
        (8 bytes a step), the row counts, the probe's worst case and the steps taken without
        noise, sealed with the digest of all of it. The ledger restarts at the next private
        step."""
        digests = np.frombuffer(bytes(self._digests), dtype=np.int64).copy()
        return sealed(
            {
                "checks": list(self._checks),
                "steps": self._steps,
                "accountant_steps_at_attach": self._counted_at_attach,
                "noise": {
                    "squares": self._squares,
                    "values": self._values,
                    "steps": self._noise_steps,
                    "scale": list(self._scale_seen),
                    "digests": torch.from_numpy(digests),
                },
                "sampling": self._counts.state(),
                "clipping": {
                    "probes": self._probes,
                    "over": self._over,
                    "bound": self._bound,
                    "worst": None if self._worst is None else list(self._worst),
                },
                "ledger": {"unnoised": self._unnoised, "first_unnoised": self._first_unnoised},
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            ValueError: ``state`` is damaged (its content no longer matches its digest) or
                carries no digest, lacks a field, or was saved by checks of another
                configuration.
        """
        check_sealed(state, what="MechanismChecks state")
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"state is not a MechanismChecks state_dict: it lacks {missing}")
        if tuple(state["checks"]) != self._checks:
            raise ValueError(
                f"state was saved by checks={tuple(state['checks'])!r}; these have "
                f"checks={self._checks!r}"
            )
        self._steps = int(state["steps"])
        self._counted_at_attach = int(state["accountant_steps_at_attach"])
        noise = state["noise"]
        self._squares, self._values = float(noise["squares"]), int(noise["values"])
        self._noise_steps = int(noise["steps"])
        self._scale_seen = (float(noise["scale"][0]), float(noise["scale"][1]))
        digests = torch.as_tensor(noise["digests"], dtype=torch.int64).numpy()
        self._digests = bytearray(digests.tobytes())
        self._counts.load(state["sampling"])
        clipping = state["clipping"]
        self._probes, self._over = int(clipping["probes"]), int(clipping["over"])
        self._bound = float(clipping["bound"])
        worst = clipping["worst"]
        self._worst = None if worst is None else (float(worst[0]), float(worst[1]), int(worst[2]))
        self._unnoised = int(state["ledger"]["unnoised"])
        self._first_unnoised = int(state["ledger"]["first_unnoised"])
        self._ledger = None
