"""The mechanism checks' weights ledger (:class:`~privmon.audit.MechanismChecks`): the weights
at a check are those the last private step left (no in-place write and the same storage since,
no copy), and no optimizer step without noise changed a value (told by a copy of the parameters
with a gradient, taken before such a step only). Derivations: docs, Theory page, *Mechanism
checks*."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from privmon._inplace_writes import InPlaceWrites
from privmon.audit import mechanism_evidence as evidence
from privmon.audit.mechanism import MechanismFinding
from privmon.audit.mechanism_check import MechanismCheck, StepContext, guarded
from privmon.audit.opacus_adapter import local

__all__ = ["LedgerCheck"]


class _Weights(NamedTuple):
    """The parameters as a point of training left them: their storage, and a witness of the
    in-place writes since."""

    params: list[torch.Tensor]
    storage: list[int]
    writes: InPlaceWrites

    @classmethod
    def of(cls, optimizer: Any) -> _Weights:
        params = [p for g in optimizer.original_optimizer.param_groups for p in g["params"]]
        return cls(params, _storage(params), InPlaceWrites(params))

    def changed(self) -> bool:
        """Written in place, or given other storage, since."""
        return self.writes.any() or _storage(self.params) != self.storage


def _storage(params: list[torch.Tensor]) -> list[int]:
    """Where each parameter's values are (this rank's shard of a DTensor)."""
    return [local(p).data_ptr() for p in params]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and values (NaN where the other is NaN; this rank's shards of DTensors)."""
    a, b = local(a), local(b)
    return a.shape == b.shape and bool(torch.where(a.isnan(), b.isnan(), a == b).all())


class LedgerCheck(MechanismCheck):
    """No update of the weights but the private steps: hooks before and after each step of the
    underlying optimizer.

    Examples:
        >>> from privmon.audit.mechanism_check import StepContext
        >>> from privmon.audit.mechanism_ledger import LedgerCheck
        >>> LedgerCheck().findings(StepContext(optimizer=None), accountant=None)[0].evidence
        'ledger: no private step yet'
    """

    name = "ledger"
    tests = evidence.kinds_of("ledger")
    unnoised: int
    first_unnoised: int
    written: int
    first_written: int
    ledger_unnoised: int
    ledger: _Weights | None
    ledger_step: int
    moved: bool
    before: tuple[_Weights, list[torch.Tensor | None], InPlaceWrites] | None
    private: bool

    def __init__(self) -> None:
        super().__init__()
        self.add_state("unnoised", 0)  # optimizer steps that ran without noise
        self.add_state("first_unnoised", 0)  # the private steps before the first of them
        self.add_state("written", 0)  # private steps whose weights were written since the last
        self.add_state("first_written", 0)  # ... by no step of the optimizer; the first's last
        self.add_state("ledger_unnoised", 0, persistent=False)  # unnoised at the ledger's time
        self.add_state("ledger", None, persistent=False)  # as the last private step left them
        self.add_state("ledger_step", 0, persistent=False)
        self.add_state("moved", False, persistent=False)  # changed since, seen before a step
        self.add_state("before", None, persistent=False)  # before a step, with value copies
        self.add_state("private", False, persistent=False)  # a private step's update is due
        self._context: StepContext | None = None
        self._handles: list[Any] = []

    def attach(self, context: StepContext) -> None:
        inner = context.optimizer.original_optimizer
        self._context = context
        self._handles = [
            inner.register_step_pre_hook(guarded(self.name, context, "step", self._before_step)),
            inner.register_step_post_hook(guarded(self.name, context, "step", self._after_step)),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def private_step(self, context: StepContext) -> None:
        """Before the private step's update: the weights it starts from must be those the last
        private step left, unless an unnoised step of the optimizer (counted apart) wrote them;
        else something else wrote them in between (a second optimizer stepping on ``.grad``
        after ``backward``, an in-place edit) and the private step builds on it."""
        self.private = True
        if (
            self.ledger is not None
            and self.unnoised == self.ledger_unnoised
            and (self.moved or self.ledger.changed())
        ):
            if self.written == 0:
                self.first_written = self.ledger_step
            self.written += 1

    def _before_step(self, *_: Any) -> None:
        """Before a step of the underlying optimizer that no noised ``pre_step`` preceded:
        whether the weights already moved since the last private step, and the parameters with
        a copy of those with a gradient (the ones a step may write), to tell whether it changed
        a value."""
        if not self.private and self._context is not None:
            self.moved = self.moved or (self.ledger is not None and self.ledger.changed())
            weights = _Weights.of(self._context.optimizer)
            copies = [None if p.grad is None else p.detach().clone() for p in weights.params]
            frozen = [p for p, c in zip(weights.params, copies, strict=True) if c is None]
            self.before = (weights, copies, InPlaceWrites(frozen))

    def _after_step(self, *_: Any) -> None:
        """After every step of the underlying optimizer: a private one renews the ledger; any
        other that changed a parameter's value is a non-private update (one that wrote the
        values they had, as a step on zero gradients does, leaves the ledger as it was)."""
        assert self._context is not None
        if self.private:
            self.private, self.before, self.moved = False, None, False
            self.ledger = _Weights.of(self._context.optimizer)
            self.ledger_step, self.ledger_unnoised = self._context.steps, self.unnoised
            return
        if self.before is None:
            return
        (weights, copies, frozen), self.before = self.before, None
        if not weights.changed():
            return
        rows = zip(weights.params, copies, weights.storage, strict=True)
        if frozen.any() or any(
            local(p).data_ptr() != ptr if c is None else not _same_values(c, p)
            for p, c, ptr in rows
        ):
            if self.unnoised == 0:
                self.first_unnoised = self._context.steps
            self.unnoised += 1
        elif self.ledger is not None:  # the same values: the ledger follows the writes
            self.ledger = _Weights.of(self._context.optimizer)

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        changed = None if self.ledger is None else self.moved or self.ledger.changed()
        return [
            evidence.ledger(
                self.unnoised,
                self.first_unnoised,
                changed,
                self.ledger_step,
                written=(self.written, self.first_written),
            )
        ]
