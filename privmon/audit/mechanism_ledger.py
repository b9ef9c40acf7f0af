"""The mechanism checks' weights ledger (:class:`~privmon.audit.MechanismChecks`): the weights
at a check are those the last private step left (version counters and storage, no copy), and no
optimizer step without noise changed a value (told by a copy of the parameters with a gradient,
taken before such a step only). Derivations: docs, Theory page, *Mechanism checks*."""

from __future__ import annotations

from typing import Any

import torch

from privmon.audit import mechanism_evidence as evidence
from privmon.audit.mechanism import MechanismFinding
from privmon.audit.mechanism_check import MechanismCheck, StepContext

__all__ = ["LedgerCheck"]

Entry = tuple[torch.Tensor, int, int]  # a parameter, its version counter, its storage


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and values (NaN where the other is NaN)."""
    return a.shape == b.shape and bool(torch.where(a.isnan(), b.isnan(), a == b).all())


def _fingerprint(optimizer: Any) -> list[Entry]:
    return [
        (p, p._version, p.data_ptr())
        for group in optimizer.original_optimizer.param_groups
        for p in group["params"]
    ]


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
    ledger: list[Entry] | None
    ledger_step: int
    before: list[tuple[torch.Tensor, int, int, torch.Tensor | None]]
    private: bool

    def __init__(self) -> None:
        super().__init__()
        self.add_state("unnoised", 0)  # optimizer steps that ran without noise
        self.add_state("first_unnoised", 0)  # the private steps before the first of them
        self.add_state("ledger", None, persistent=False)  # the last private step's entries
        self.add_state("ledger_step", 0, persistent=False)
        self.add_state("before", [], persistent=False)  # entries and copies before a step
        self.add_state("private", False, persistent=False)  # a private step's update is due
        self._context: StepContext | None = None
        self._handles: list[Any] = []

    def attach(self, context: StepContext) -> None:
        inner = context.optimizer.original_optimizer
        self._context = context
        self._handles = [
            inner.register_step_pre_hook(self._before_step),
            inner.register_step_post_hook(self._after_step),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def private_step(self, context: StepContext) -> None:
        self.private = True

    def _before_step(self, *_: Any) -> None:
        """Before a step of the underlying optimizer that no noised ``pre_step`` preceded: the
        parameters' version counters, and a copy of those with a gradient (the ones a step may
        write), to tell whether it changed a value."""
        if not self.private and self._context is not None:
            self.before = [
                (p, v, ptr, None if p.grad is None else p.detach().clone())
                for p, v, ptr in _fingerprint(self._context.optimizer)
            ]

    def _after_step(self, *_: Any) -> None:
        """After every step of the underlying optimizer: a private one updates the ledger; any
        other that changed a parameter's value is a non-private update (one that wrote the
        values they had, as a step on zero gradients does, leaves the ledger as it was)."""
        assert self._context is not None
        if self.private:
            self.private, self.before = False, []
            self.ledger = _fingerprint(self._context.optimizer)
            self.ledger_step = self._context.steps
            return
        before, self.before = self.before, []
        kept, wrote = {}, False
        for p, version, ptr, copy in before:
            if (p._version, p.data_ptr()) == (version, ptr):
                continue
            if copy is not None and _same_values(copy, p):
                kept[id(p)] = (version, ptr)
            else:
                wrote = True
        if self.ledger is not None:  # entries still those of the last private step follow
            self.ledger = [
                (q, q._version, q.data_ptr()) if kept.get(id(q)) == (v, ptr) else (q, v, ptr)
                for q, v, ptr in self.ledger
            ]
        if wrote:
            if self.unnoised == 0:
                self.first_unnoised = self._context.steps
            self.unnoised += 1

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        changed = None
        if self.ledger is not None:
            changed = sum((p._version, p.data_ptr()) != (v, ptr) for p, v, ptr in self.ledger)
        return [evidence.ledger(self.unnoised, self.first_unnoised, changed, self.ledger_step)]
