"""The mechanism checks' clipping probe (:class:`~privmon.audit.MechanismChecks`): a synthetic
row of norm 100 C, replayed through the optimizer's own ``clip_and_accumulate`` on scratch
state (under ghost clipping: through the model's own ``get_clipping_coef``, which weights each
row's loss), must contribute at most C, up to the rounding the parameters' dtype allows; and
under ghost clipping, every private step's backward pass computed clipping coefficients.
Derivations: docs, Theory page, *Mechanism checks*."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from privmon.audit import mechanism_evidence as evidence
from privmon.audit import opacus_adapter as adapter
from privmon.audit.mechanism import MechanismFinding
from privmon.audit.mechanism_check import MechanismCheck, StepContext
from privmon.audit.mechanism_evidence import PROBE_NORM
from privmon.audit.mechanism_math import CLIP_TOLERANCE, clip_tolerance

__all__ = ["ClippingCheck"]

logger = logging.getLogger("privmon")

# The probe runs at the first PROBE_FIRST private steps, every PROBE_EVERY-th, and whenever C,
# the optimizer's class or its clip_and_accumulate changed since the last probe.
PROBE_FIRST, PROBE_EVERY = 10, 10
_MISSING = object()


class ClippingCheck(MechanismCheck):
    """Each record's gradient clipped to C: the probe's worst contribution against C; and no
    non-finite per-sample gradient reaching a noised update (``finite``).

    The second test is the clipping check's because a NaN or infinite row is a contribution no
    clipping bounds (Opacus' clip factor C / ‖g‖ is NaN or 0, and 0 · inf is NaN): one record
    then decides the whole update — NaN weights or not — which no noise hides. It is read from
    what the clipping call produced (its summed gradient; the row from its per-sample
    gradients, only when the sum is not finite), never from the noise, which was added right.

    Examples:
        >>> from privmon.audit.mechanism_check import StepContext
        >>> from privmon.audit.mechanism_clipping import ClippingCheck
        >>> ClippingCheck().findings(StepContext(optimizer=None), accountant=None)[0].evidence
        'clipping: not tested: no private step yet'
    """

    name = "clipping"
    tests = evidence.kinds_of("clipping")
    refused_on = tuple(
        (
            family,
            "ghost clipping clips inside the loss's backward pass, in the model: pass "
            "module= (the model make_private returned) to probe its clipping coefficients",
        )
        for family in adapter.CLIPS_IN_BACKWARD
    )
    probes: int
    over: int
    bound: float
    worst: tuple[float, float, int] | None
    key: tuple[Any, ...]
    error: str | None
    nonfinite: int
    first_nonfinite: tuple[int, int | None, str] | None
    pending: tuple[int | None, str] | None
    unclipped: int
    first_unclipped: int
    coefficients: int
    step_clipped: bool

    def __init__(self) -> None:
        super().__init__()
        self.add_state("probes", 0)
        self.add_state("over", 0)  # probes above C
        self.add_state("bound", math.nan)  # the last probe's C
        self.add_state("worst", None)  # (ratio, bound, step)
        self.add_state("key", (), persistent=False)  # what the last probe ran with
        self.add_state("error", None, persistent=False)  # why the probe could not run
        self.add_state("nonfinite", 0)  # private steps a non-finite per-sample gradient reached
        self.add_state("first_nonfinite", None)  # (step, row, "NaN" | "inf") of the first
        self.add_state("pending", None, persistent=False)  # the current step's (row, kind)
        # ghost clipping: private steps whose backward computed no clipping coefficients
        self.add_state("unclipped", 0)
        self.add_state("first_unclipped", 0)
        self.add_state("coefficients", 0, persistent=False)  # computed since the last sum
        self.add_state("step_clipped", True, persistent=False)  # the current step had some
        self._context: StepContext | None = None
        self._hooks: list[adapter.Hook] = []

    def refusal(self, context: StepContext, *, family: adapter.OpacusFamily | None) -> str | None:
        if family in adapter.CLIPS_IN_BACKWARD and context.module is not None:
            return None
        return super().refusal(context, family=family)

    def attach(self, context: StepContext) -> None:
        self._context = context
        if context.module is not None:
            self._hooks = adapter.install(context.module, {"get_clipping_coef": self._coefficients})

    def detach(self) -> None:
        if self._context is not None and self._hooks:
            adapter.uninstall(self._context.module, self._hooks, "mechanism checks")
        self._hooks = []

    def _coefficients(self, original: Any) -> Any:
        """Ghost clipping's coefficients for a backward pass (the probe's are not counted)."""
        if self._context is not None and not self._context.probing:
            self.coefficients += 1
        return original()

    def clipped(self, context: StepContext, *, rows: int, fresh: bool) -> None:
        """A clipping call that left the summed gradient non-finite marks the step (its first
        non-finite row); the mark counts once the step reaches the noise. Under ghost clipping,
        a step's sum restarting closes its backward passes: clipped when they computed
        coefficients."""
        if fresh:
            self.pending = None
            if context.module is not None:
                self.step_clipped, self.coefficients = self.coefficients > 0, 0
        if self.pending is None and rows:
            self.pending = (
                adapter.nonfinite_norm_row(context.optimizer, context.params, context.module)
                if context.module is not None  # ghost clipping: per-sample norms, no gradients
                else adapter.nonfinite_row(context.params)
            )

    def private_step(self, context: StepContext) -> None:
        if self.pending is not None:
            self.nonfinite += 1
            if self.first_nonfinite is None:
                self.first_nonfinite = (context.steps, *self.pending)
            self.pending = None
        if not self.step_clipped:
            if self.unclipped == 0:
                self.first_unclipped = context.steps
            self.unclipped += 1
        self.step_clipped = True
        opt = context.optimizer
        bound = float(opt.max_grad_norm)
        key = (
            bound,
            type(opt),
            opt.__dict__.get("clip_and_accumulate"),
            getattr(context.module, "max_grad_norm", None),
        )
        due = self.probes < PROBE_FIRST or context.steps % PROBE_EVERY == 0
        if due or key != self.key:
            self.key = key
            self._check(context, bound)

    def _check(self, context: StepContext, bound: float) -> None:
        try:
            contribution = self._probe(context, bound)
        except Exception as e:  # a custom clipping path that cannot take the probe
            if self.error is None:
                logger.warning("privmon: the clipping probe could not run: %r", e)
            self.error = f"{type(e).__name__}: {e}"
            return
        self.probes += 1
        self.bound = bound
        ratio = contribution / bound if bound > 0 else math.inf
        if ratio > 1 + _tolerance(context.params, bound):
            self.over += 1
        if self.worst is None or ratio > self.worst[0]:
            self.worst = (ratio, bound, context.steps)

    def _probe(self, context: StepContext, bound: float) -> float:
        if context.module is None:
            return _flat_probe(context, bound)
        share = PROBE_NORM * bound / math.sqrt(max(sum(p.numel() > 0 for p in context.params), 1))
        context.probing = True
        try:
            return adapter.ghost_coefficient(context.module, share) * PROBE_NORM * bound
        finally:
            context.probing = False

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        unclipped = (self.unclipped, self.first_unclipped)
        return [
            evidence.clipping(
                self.worst, self.probes, self.over, context.steps, self.bound, self.error, unclipped
            ),
            evidence.finite_gradients(
                self.first_nonfinite, self.nonfinite, context.steps, sharded=context.sharded
            ),
        ]


def _flat_probe(context: StepContext, bound: float) -> float:
    """The contribution ‖Σ_p summed_grad_p‖ of one row of norm PROBE_NORM · C, equal on every
    clipped parameter, through the optimizer's own ``clip_and_accumulate`` on scratch state
    (every parameter's ``grad_sample`` and ``summed_grad`` put back after)."""
    params = context.params
    saved = [(p, p.__dict__.get("grad_sample", _MISSING), p.summed_grad) for p in params]
    share = PROBE_NORM * bound / math.sqrt(max(sum(p.numel() > 0 for p in params), 1))
    try:
        for p in params:
            value = share / math.sqrt(max(p.numel(), 1))
            p.grad_sample = torch.full((1, *p.shape), value, dtype=p.dtype, device=p.device)
            p.summed_grad = None
        context.probing = True
        with adapter.kept_clipping_counts(context.optimizer):
            context.optimizer.clip_and_accumulate()
        sums = [p.summed_grad.float() for p in params if p.summed_grad is not None]
        norms = [torch.linalg.vector_norm(s) for s in sums] or [torch.zeros(())]
        total = float(torch.stack(norms).double().square().sum())
    finally:
        context.probing = False
        for p, samples, summed in saved:
            if samples is _MISSING:
                p.__dict__.pop("grad_sample", None)
            else:
                p.grad_sample = samples
            p.summed_grad = summed
    return math.sqrt(total)


def _tolerance(params: list[Any], bound: float) -> float:
    """The rounding a correct clipping path in the parameters' precision (the coarsest of their
    dtypes: the probe's rows are in each parameter's own) allows the probe."""
    params = [p for p in params if p.numel() > 0]
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
