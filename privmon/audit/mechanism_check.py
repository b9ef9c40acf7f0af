"""The base of one DP mechanism check (a test of one assumption of the accountant inside an Opacus
optimizer; :class:`~privmon.audit.MechanismChecks` composes them): a check declares its state
once (:meth:`MechanismCheck.add_state`) and the base saves it (sealed with its digest), loads and
resets it; the check answers the events of a private step, says when it cannot run, and gives
its findings."""

from __future__ import annotations

import copy
import logging
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from privmon._digest import check_sealed, sealed
from privmon.audit.mechanism import MechanismFinding
from privmon.audit.opacus_adapter import OpacusFamily

__all__ = ["MechanismCheck", "StepContext", "guarded", "stop_check", "stopped_findings"]

logger = logging.getLogger("privmon")


@dataclass
class StepContext:
    """What the checks on one optimizer share: the optimizer, the canary block (a parameter that
    is no model parameter, or None), the model whose backward pass clips under ghost clipping
    (the ``GradSampleModule`` make_private returned, or None), this rank and the world size
    (distributed Opacus), whether the parameters are sharded over the ranks (FSDP2: each rank
    holds, and noises, its own shard of every parameter), the sampling rate of the accountant's
    hook (None: unknown), the parameters the optimizer clips (read at each ``pre_step``), the
    private steps counted so far, whether the clipping probe is running (its clipping call is
    no step's), and the checks stopped because one of their hooks raised (why, by name: their
    tests are undecided).

    Examples:
        >>> from privmon.audit import StepContext
        >>> context = StepContext(optimizer=None)
        >>> context.steps, context.rank, context.world, context.sample_rate
        (0, 0, 1, None)
    """

    optimizer: Any
    block: torch.nn.Parameter | None = None
    module: Any = None
    rank: int = 0
    world: int = 1
    sharded: bool = False
    sample_rate: float | None = None
    params: list[Any] = field(default_factory=list)
    steps: int = 0
    probing: bool = False
    stopped: dict[str, str] = field(default_factory=dict)


def stop_check(name: str, context: StepContext, event: str, error: BaseException) -> None:
    """Stop the check ``name`` after its ``event`` hook raised ``error`` inside the training
    step: said once (the exception's type and where it was raised, never its message: it may
    hold a value), its tests undecided from then on, and training goes on."""
    if name in context.stopped:
        return
    context.stopped[name] = (
        f"its {event} hook raised {type(error).__name__} after {context.steps} private steps"
    )
    frame = traceback.extract_tb(error.__traceback__)[-1:]
    where = f" ({frame[0].filename}:{frame[0].lineno})" if frame else ""
    logger.error(
        "privmon: the %s mechanism check stopped: %s%s; training goes on, and the check's "
        "tests are undecided from here",
        name,
        context.stopped[name],
        where,
    )


def guarded(name: str, context: StepContext, event: str, hook: Callable[..., Any]) -> Any:
    """``hook`` (one a check registers itself, e.g. an optimizer step hook), as run while the
    check ``name`` runs: once it raises, the check stops (:func:`stop_check`) and the step goes
    on."""

    def run(*args: Any) -> None:
        if name in context.stopped:
            return
        try:
            hook(*args)
        except Exception as error:
            stop_check(name, context, event, error)

    return run


def _saved(value: Any) -> Any:
    """A state's value as saved: bytes as a uint8 tensor, an object with ``state()`` as that."""
    if isinstance(value, bytearray):
        return torch.from_numpy(np.frombuffer(bytes(value), dtype=np.uint8).copy())
    if hasattr(value, "state") and hasattr(value, "load"):
        return value.state()
    return copy.deepcopy(value)


def _loaded(default: Any, value: Any) -> Any:
    """:func:`_saved`'s inverse, shaped by the state's default."""
    if isinstance(default, bytearray):
        return bytearray(torch.as_tensor(value, dtype=torch.uint8).numpy().tobytes())
    if hasattr(default, "state") and hasattr(default, "load"):
        restored = copy.deepcopy(default)
        restored.load(value)
        return restored
    return copy.deepcopy(value)


class MechanismCheck:
    """One mechanism check: subclass it, name it (``name``, no ``/``), list its tests
    (``tests``: ``(test, "deterministic" | "statistical")`` in the order of its findings),
    declare its state with :meth:`add_state` in ``__init__`` (annotated on the class, for the
    type checker), and answer the events it needs (each gets the :class:`StepContext`; all do
    nothing by default):

    - :meth:`attach` / :meth:`detach`: the checks join / leave the optimizer;
    - :meth:`clipped`: a clipping call of a step clipped ``rows`` rows (``fresh``: its summed
      gradient restarted);
    - :meth:`noised`: ``add_noise`` just added the step's noise (before ``scale_grad``);
    - :meth:`private_step`: a step reached the noise and its ``pre_step`` came back
      (``context.steps`` already counts it);

    and give :meth:`findings`, one :class:`~privmon.audit.MechanismFinding` per test.
    :meth:`refusal` says why the check cannot run on an optimizer (None: it can).

    Examples:
        >>> from privmon.audit import MechanismCheck, MechanismFinding, StepContext
        >>> class Steps(MechanismCheck):
        ...     name, tests = "counted", (("count", "deterministic"),)
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.add_state("seen", 0)
        ...     def private_step(self, context: StepContext) -> None:
        ...         self.seen += 1
        ...     def findings(self, context, *, accountant):
        ...         said = f"counted: {self.seen} steps"
        ...         return [MechanismFinding("counted", "count", "deterministic", False, None,
        ...                                  said)]
        >>> check = Steps()
        >>> check.private_step(StepContext(optimizer=None))
        >>> state = check.state_dict()
        >>> fresh = Steps()
        >>> fresh.load_state_dict(state)
        >>> fresh.seen, fresh.findings(StepContext(optimizer=None), accountant=None)[0].evidence
        (1, 'counted: 1 steps')
    """

    name: ClassVar[str] = ""
    tests: ClassVar[tuple[tuple[str, Literal["deterministic", "statistical"]], ...]] = ()
    refused_on: ClassVar[tuple[tuple[OpacusFamily, str], ...]] = ()
    """(family, why): the Opacus optimizer families the check cannot run on (:meth:`refusal`)."""

    def __init__(self) -> None:
        self._defaults: dict[str, tuple[Any, bool]] = {}

    # -- state -----------------------------------------------------------------------------
    def add_state(self, name: str, default: Any, *, persistent: bool = True) -> None:
        """Declare the attribute ``name`` with its ``default`` value (set now, and again by
        :meth:`reset`): a number, a string, None, a tuple, a ``bytearray`` or an object with
        ``state()`` / ``load(state)``. ``persistent=False``: not saved, reset on loading (what
        holds only within a step, or refers to live tensors)."""
        if not name.isidentifier() or name.startswith("_") or name in self._defaults:
            raise ValueError(f"state name {name!r} must be a new public identifier")
        self._defaults[name] = (copy.deepcopy(default), persistent)
        setattr(self, name, copy.deepcopy(default))

    def reset(self) -> None:
        """Every declared state back to its default."""
        for name, (default, _) in self._defaults.items():
            setattr(self, name, copy.deepcopy(default))

    def state_dict(self) -> dict[str, Any]:
        """The persistent states, sealed with their digest."""
        return sealed(
            {n: _saved(getattr(self, n)) for n, (_, keep) in self._defaults.items() if keep}
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (the other states reset).

        Raises:
            ValueError: ``state`` is damaged or carries no digest, or lacks a state.
        """
        check_sealed(state, what=f"the {self.name} check's state")
        kept = [n for n, (_, keep) in self._defaults.items() if keep]
        missing = sorted(set(kept) - set(state))
        if missing:
            raise ValueError(f"state is not the {self.name} check's state: it lacks {missing}")
        self.reset()
        for name in kept:
            setattr(self, name, _loaded(self._defaults[name][0], state[name]))

    # -- the events of a step ------------------------------------------------------------------
    def refusal(self, context: StepContext, *, family: OpacusFamily | None) -> str | None:
        """Why the check cannot run on ``context.optimizer`` (of Opacus ``family``, None for
        flat clipping), or None; default: :attr:`refused_on`'s reason for the family."""
        if family is None:
            return None
        return dict(self.refused_on).get(family)

    def attach(self, context: StepContext) -> None:
        """The checks joined the optimizer (register extra hooks here, each through
        :func:`guarded`: one that raises stops the check, never the training step)."""

    def detach(self) -> None:
        """The checks left the optimizer (remove what :meth:`attach` registered)."""

    def clipped(self, context: StepContext, *, rows: int, fresh: bool) -> None:
        """A clipping call of a step clipped ``rows`` rows (0 if it raised)."""

    def noised(self, context: StepContext) -> None:
        """``add_noise`` just added the step's noise."""

    def private_step(self, context: StepContext) -> None:
        """A private step was counted."""

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        """One finding per test, over the run so far (``accountant``: the one the caller
        reports, or None for the one the optimizer's step hook counts with)."""
        raise NotImplementedError


def stopped_findings(check: MechanismCheck, why: str) -> list[MechanismFinding]:
    """The findings of a stopped check: each of its tests undecided, saying why."""
    said = f"{check.name}: the check stopped ({why}): undecided, not a DP violation"
    return [
        MechanismFinding(check.name, test, kind, False, None, said, undecided=True)
        for test, kind in check.tests
    ]
