"""The LR schedulers already bound to an optimizer (the gradient canaries refuse an optimizer
that has one: a scheduler made before them does not know their param group). A scheduler keeps
its optimizer, never the other way round, and a ``ReduceLROnPlateau`` leaves no trace on the
optimizer it schedules (torch's other schedulers set ``'initial_lr'``), so they are found among
the live objects."""

from __future__ import annotations

import gc
from typing import Any

__all__ = ["bound_schedulers"]


def _scheduler_kinds() -> tuple[type, ...]:
    from torch.optim import lr_scheduler

    names = ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau")
    return tuple({getattr(lr_scheduler, n) for n in names if hasattr(lr_scheduler, n)})


def bound_schedulers(optimizer: Any) -> list[str]:
    """The class names of the LR schedulers bound to ``optimizer`` or to the optimizer it wraps
    (``original_optimizer``): torch's schedulers (``LRScheduler``, ``ReduceLROnPlateau`` and
    their subclasses: LambdaLR, OneCycleLR, SequentialLR, transformers' schedules, ...) among the
    live objects, and "a scheduler" for a param group carrying 'initial_lr' (what torch's and
    timm's schedulers set). A scheduler keeps its optimizer, never the other way round, so the
    live objects are searched (once, at construction); one already dropped is collected first.

    Examples:
        >>> import torch
        >>> from privmon.audit.lr_schedulers import bound_schedulers
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> bound_schedulers(optimizer)
        []
        >>> scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        >>> bound_schedulers(optimizer)
        ['StepLR']
    """
    kinds = _scheduler_kinds()
    targets = {id(optimizer), id(getattr(optimizer, "original_optimizer", optimizer))}

    def live() -> list[str]:
        return sorted(
            type(obj).__name__
            for obj in gc.get_objects()
            if issubclass(type(obj), kinds) and id(getattr(obj, "optimizer", None)) in targets
        )

    found = live()
    if found:  # one dropped but not yet collected (in a reference cycle) is not bound
        gc.collect()
        found = live()
    if not found and any("initial_lr" in group for group in optimizer.param_groups):
        found = ["a scheduler (its param groups carry 'initial_lr')"]
    return found
