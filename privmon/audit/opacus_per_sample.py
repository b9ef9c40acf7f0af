"""What an Opacus training step keeps on the model between its backward pass and the optimizer
step, which a check's queries must neither consume nor see (the training guard hides it): the
per-sample-gradient hooks of the ``GradSampleModule``s and the parameters' per-sample gradients.
Like :mod:`~privmon.audit.opacus_adapter` (the optimizer's side), it reads Opacus' internals,
checked against Opacus 1.6.0."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PerSampleState", "grad_sample_modules"]


def _switches_hooks(owner: Any) -> bool:
    return callable(getattr(owner, "disable_hooks", None)) and isinstance(
        getattr(owner, "hooks_enabled", None), bool
    )


def grad_sample_modules(roots: Sequence[torch.nn.Module]) -> list[Any]:
    """Opacus ``GradSampleModule``s whose per-sample-gradient hooks fire on these modules, each
    once: the roots themselves, and the owners of the hooks Opacus lists on the model it wraps
    (``autograd_grad_sample_hooks``: a query may hold the wrapped model, not the wrapper).

    Examples:
        >>> import torch
        >>> from opacus import GradSampleModule
        >>> from privmon.audit.opacus_per_sample import grad_sample_modules
        >>> model = torch.nn.Linear(3, 2)
        >>> wrapper = GradSampleModule(model)
        >>> grad_sample_modules([model]) == [wrapper]
        True
    """
    found: dict[int, Any] = {}
    for m in (m for root in roots for m in root.modules()):
        owners: list[Any] = [m]
        for handle in getattr(m, "autograd_grad_sample_hooks", ()):
            hooks = handle.hooks_dict_ref()  # torch's RemovableHandle
            hook = None if hooks is None else hooks.get(handle.id)
            owners.append(getattr(getattr(hook, "func", hook), "__self__", None))  # a partial
        found |= {id(owner): owner for owner in owners if _switches_hooks(owner)}
    return list(found.values())


class PerSampleState:
    """What an Opacus step keeps on the model between its backward pass and the optimizer step,
    which a check's queries must neither consume nor see, as found when made: the hook switches
    of :func:`grad_sample_modules` (a query's backward pass would consume the step's captured
    activations, or leave partial per-sample gradients that fail the next step) and the
    parameters' per-sample gradients (``grad_sample``: torch's Expanded Weights, Opacus'
    ``grad_sample_mode="ew"``, refuses a forward while a parameter holds them).

    Examples:
        >>> import torch
        >>> from opacus import GradSampleModule
        >>> from privmon.audit.opacus_per_sample import PerSampleState
        >>> model = GradSampleModule(torch.nn.Linear(3, 2))
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> weight = next(model.parameters())
        >>> state = PerSampleState([model])
        >>> state.hide()
        >>> model.hooks_enabled, weight.grad_sample is None
        (False, True)
        >>> state.restore()
        >>> model.hooks_enabled, weight.grad_sample.shape
        (True, torch.Size([4, 2, 3]))
    """

    def __init__(self, roots: Sequence[torch.nn.Module]) -> None:
        self._switches = [(m, m.hooks_enabled) for m in grad_sample_modules(roots)]
        params = {id(p): p for root in roots for p in root.parameters()}.values()
        self._samples = [  # a plain attribute of the parameter
            (p, samples) for p in params if (samples := p.__dict__.get("grad_sample")) is not None
        ]

    def hide(self) -> None:
        """Hooks off and the per-sample gradients found hidden: before each query."""
        for m, _ in self._switches:
            m.disable_hooks()
        for p, _ in self._samples:
            p.grad_sample = None  # type: ignore[attr-defined]

    def restore(self) -> None:
        """Hooks and per-sample gradients as found."""
        for m, enabled in self._switches:
            m.hooks_enabled = enabled
        for p, samples in self._samples:
            p.grad_sample = samples  # type: ignore[attr-defined]
