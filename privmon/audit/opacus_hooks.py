"""What the gradient canaries and the mechanism checks share to live inside an Opacus
``DPOptimizer``: wrappers of the instance's methods, which of privmon's objects an optimizer
carries, and what Opacus' accountant hook closes over (the accountant and its sampling rate)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "Hook",
    "accountant_steps",
    "attached",
    "check_dp_optimizer",
    "claim",
    "hook_accountant",
    "hook_sample_rate",
    "install",
    "rank_and_world",
    "release",
    "uninstall",
]

# Which of privmon's objects each optimizer carries: {"canaries": ..., "checks": ...}.
_CARRIED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


class Hook:
    """A wrapper that replaces one method of an Opacus optimizer instance: ``body(original,
    *args, **kwargs)`` runs in its place (recognisable, so that detaching can tell whether
    someone wrapped the method again since)."""

    def __init__(self, optimizer: Any, name: str, body: Callable[..., Any]) -> None:
        self.name = name
        self.previous = optimizer.__dict__.get(name)  # an instance-level wrapper, or None
        self.original = getattr(optimizer, name)
        self.body = body

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.body(self.original, *args, **kwargs)


def install(optimizer: Any, bodies: dict[str, Callable[..., Any]]) -> list[Hook]:
    """Wrap each named method of the optimizer instance with its body, in order."""
    hooks = [Hook(optimizer, name, body) for name, body in bodies.items()]
    for hook in hooks:
        setattr(optimizer, hook.name, hook)
    return hooks


def uninstall(optimizer: Any, hooks: list[Hook], owner: str) -> None:
    """Put back what :func:`install` replaced (RuntimeError, changing nothing, when one of the
    methods was wrapped again by someone else since)."""
    for hook in hooks:
        if optimizer.__dict__.get(hook.name) is not hook:
            raise RuntimeError(
                f"optimizer.{hook.name} was replaced after the {owner} were attached; restore "
                f"it before detaching the {owner}"
            )
    for hook in reversed(hooks):
        if hook.previous is None:
            delattr(optimizer, hook.name)
        else:
            setattr(optimizer, hook.name, hook.previous)


def attached(optimizer: Any, role: str) -> Any:
    """The object of this role ("canaries", "checks") the optimizer carries, or None."""
    return _CARRIED.get(optimizer, {}).get(role)


def claim(optimizer: Any, role: str, owner: Any) -> None:
    """Record that ``owner`` is the optimizer's object of this role."""
    _CARRIED.setdefault(optimizer, {})[role] = owner


def release(optimizer: Any, role: str) -> None:
    """Forget the optimizer's object of this role."""
    _CARRIED.get(optimizer, {}).pop(role, None)


def check_dp_optimizer(optimizer: Any, *, who: str) -> Any:
    """``optimizer`` if it is an Opacus ``DPOptimizer`` (TypeError otherwise; ``who`` needs
    it)."""
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError:  # pragma: no cover - opacus is an optional dependency
        raise TypeError(
            f"optimizer must be an Opacus DPOptimizer for {who}, and opacus is not installed "
            "(pip install 'privmon[dp]')"
        ) from None
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            "optimizer must be an Opacus DPOptimizer (the optimizer PrivacyEngine.make_private "
            f"returns), got {type(optimizer).__name__}"
        )
    return optimizer


def _free_variable(optimizer: Any, name: str) -> Any:
    """The value of a free variable of the optimizer's step hook (Opacus' ``make_private``
    attaches ``accountant.get_optimizer_hook_fn(sample_rate=...)``, a closure over the
    accountant ``self`` and ``sample_rate``), or None."""
    hook = getattr(optimizer, "step_hook", None)
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
    if code is None or not cells or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def hook_sample_rate(optimizer: Any) -> float | None:
    """The sampling rate Opacus' accountant hook was built with, or None when the optimizer
    carries no such hook."""
    rate = _free_variable(optimizer, "sample_rate")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 1:
        return None
    return float(rate)


def hook_accountant(optimizer: Any) -> Any:
    """The accountant the optimizer's step hook counts steps with (an Opacus accountant: it has
    a ``history``), or None."""
    owner = _free_variable(optimizer, "self")
    return owner if accountant_steps(owner) is not None else None


def accountant_steps(accountant: Any) -> int | None:
    """Steps an Opacus accountant (or a ``PrivacyEngine``'s) counted: the sum of ``num_steps``
    over its ``history`` of ``(noise_multiplier, sample_rate, num_steps)``; None when
    ``accountant`` is neither."""
    accountant = getattr(accountant, "accountant", accountant)  # a PrivacyEngine's
    history = getattr(accountant, "history", None)
    if not isinstance(history, list):
        return None
    try:
        return int(sum(int(entry[2]) for entry in history))
    except (TypeError, IndexError, ValueError):
        return None


def rank_and_world(optimizer: Any) -> tuple[int, int]:
    """(rank, world size) of a distributed Opacus optimizer (it adds the noise on rank 0 and
    sums over the ranks); (0, 1) for one process."""
    rank, world = getattr(optimizer, "rank", 0), getattr(optimizer, "world_size", 1)
    if not isinstance(rank, int) or not isinstance(world, int) or world < 1:
        return 0, 1
    return rank, world
