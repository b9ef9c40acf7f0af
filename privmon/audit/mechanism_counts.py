"""The mechanism checks that count (:class:`~privmon.audit.MechanismChecks`): the rows per step
against Binomial(N, q t) (sampling), and the private steps against the accountant's count
(steps). Derivations: docs, Theory page, *Mechanism checks*."""

from __future__ import annotations

from typing import Any

from privmon.audit import mechanism_evidence as evidence
from privmon.audit import opacus_adapter as adapter
from privmon.audit.mechanism import MechanismFinding
from privmon.audit.mechanism_check import MechanismCheck, StepContext
from privmon.audit.mechanism_math import RowCounts

__all__ = ["SamplingCheck", "StepsCheck"]


class SamplingCheck(MechanismCheck):
    """Poisson batches at rate q from N records: the rows of each logical step (those the
    clipping calls clipped since the summed gradient restarted; under ghost clipping, those its
    backward pass computed norms for) against Binomial(N, q t).

    Examples:
        >>> from privmon.audit.mechanism_check import StepContext
        >>> from privmon.audit.mechanism_counts import SamplingCheck
        >>> check = SamplingCheck()
        >>> check.clipped(StepContext(optimizer=None), rows=20, fresh=True)
        >>> check.rows
        20
    """

    name = "sampling"
    tests = evidence.kinds_of("sampling")
    refused_on = (
        (
            adapter.FSDP,
            "under FSDP the model keeps each row's gradient norm: pass module= (the model "
            "make_private returned) to count the rows of each step",
        ),
    )
    counts: RowCounts
    rows: int

    def __init__(self) -> None:
        super().__init__()
        self.add_state("counts", RowCounts())
        self.add_state("rows", 0, persistent=False)  # rows clipped in the current logical step

    def refusal(self, context: StepContext, *, family: adapter.OpacusFamily | None) -> str | None:
        if family is adapter.FSDP and context.module is not None:
            return None
        return super().refusal(context, family=family)

    def clipped(self, context: StepContext, *, rows: int, fresh: bool) -> None:
        """The count follows the summed gradient: it restarts with it, so rows of a step that
        raised before its noise and was cleared (``optimizer.zero_grad``) are not the next's."""
        if fresh:
            self.rows = 0
        self.rows += rows

    def private_step(self, context: StepContext) -> None:
        if context.sample_rate is not None:
            rate = context.sample_rate * context.optimizer.accumulated_iterations
            self.counts.add(self.rows, rate)
        self.rows = 0

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        expected = getattr(context.optimizer, "expected_batch_size", None)
        return [
            evidence.sampling(test, self.counts, context.sample_rate, expected, context.world)
            for test in ("mean", "dispersion")
        ]


class StepsCheck(MechanismCheck):
    """Every noised step counted: the private steps taken (across a resume) against the steps
    the accountant counted since the checks were first attached.

    Examples:
        >>> from privmon.audit.mechanism_check import StepContext
        >>> from privmon.audit.mechanism_counts import StepsCheck
        >>> StepsCheck().findings(
        ...     StepContext(optimizer=None), accountant=None)[0].evidence[:18]
        'steps: not tested:'
    """

    name = "steps"
    tests = evidence.kinds_of("steps")
    counted_at_attach: int

    def __init__(self) -> None:
        super().__init__()
        self.add_state("counted_at_attach", 0)

    def attach(self, context: StepContext) -> None:
        """Read the count of the accountant the optimizer's step hook counts with."""
        accountant = adapter.hook_accountant(context.optimizer)
        self.counted_at_attach = adapter.accountant_steps(accountant) or 0

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        counted = adapter.accountant_steps(accountant) if accountant is not None else None
        if counted is None:
            counted = adapter.accountant_steps(adapter.hook_accountant(context.optimizer))
        return [evidence.step_count(counted, self.counted_at_attach + context.steps)]
