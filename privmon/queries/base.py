"""The query protocol (:class:`Query`) and :class:`CallableQuery`, which wraps any function."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from privmon._validation import check_module, check_name, check_transform
from privmon.queries.batches import (
    Batch,
    Transform,
    as_float,
    module_device,
    split_batch,
    unique_modules,
)

__all__ = ["CallableQuery", "Query"]


class Query(abc.ABC):
    """Base class: ``prepare(device)`` → ``__call__(batch)`` per batch → ``release()``.

    Attributes:
        name: short tag used in reports and TensorBoard.
        modules: every module the query runs; the monitor saves and restores their train/eval modes
            and puts them in eval mode during a check.
        discrete: True when scores take few distinct values (histogram estimators only).
        higher_is_member: True / False when members tend to score higher / lower, None if unknown
            or for vector scores.
        transform: optional ``batch -> (x, y)`` adapter (see the module docstring).
    """

    name: str
    modules: tuple[nn.Module, ...] = ()
    discrete: bool = False
    higher_is_member: bool | None = None

    def __init__(
        self,
        *,
        name: str,
        modules: nn.Module | Iterable[nn.Module] = (),
        transform: Transform | None = None,
    ) -> None:
        self.name = check_name(name)
        mods = (modules,) if isinstance(modules, nn.Module) else tuple(modules)
        for m in mods:
            check_module(m, name="modules")
        self.modules = unique_modules(mods)
        self.transform = check_transform(transform)

    @property
    def device(self) -> torch.device:
        """The device the query computes on: that of its first module's parameters (else CPU)."""
        return module_device(self.modules)

    def prepare(self, device: Any = None) -> None:  # noqa: B027 - optional hook, default no-op
        """Called once per check before any batch. Default: nothing."""

    @abc.abstractmethod
    def __call__(self, batch: Batch) -> torch.Tensor:
        """Scores of shape (n,) or (n, d) on the model's device."""

    def release(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Called once per check after the last batch; drops per-check caches. Default: nothing."""

    def _split(self, batch: Batch) -> tuple[Any, torch.Tensor | None]:
        return split_batch(batch, self.device, self.transform)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class CallableQuery(Query):
    """Wrap any callable ``fn(batch) -> scores`` (raw batch in; tensor, array or sequence out).

    Scores become a float tensor of shape (n,) or (n, d) on the device of ``modules`` (or, without
    modules, of the tensor ``fn`` returned; CPU for arrays). ``fn`` runs in whatever grad mode the
    caller set (the monitor: no_grad), so a gradient-based query can use ``torch.enable_grad()``.
    List every module ``fn`` runs in ``modules`` so the monitor protects its mode.
    """

    def __init__(
        self,
        fn: Callable[[Batch], Any],
        *,
        name: str,
        modules: nn.Module | Iterable[nn.Module] = (),
        discrete: bool = False,
        higher_is_member: bool | None = None,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        if higher_is_member not in (None, True, False):
            raise ValueError(
                f"higher_is_member must be None, True or False, got {higher_is_member!r}"
            )
        self.fn = fn
        self.discrete = bool(discrete)
        self.higher_is_member = higher_is_member
        super().__init__(name=name, modules=modules)

    def __call__(self, batch: Batch) -> torch.Tensor:
        out = self.fn(batch)
        t = out if isinstance(out, torch.Tensor) else torch.as_tensor(np.asarray(out))
        if self.modules:
            t = t.to(self.device)
        if t.is_complex():
            raise ValueError(f"{self.name}: fn returned complex scores")
        t = as_float(t.detach())
        if t.ndim not in (1, 2):
            raise ValueError(
                f"{self.name}: fn returned shape {tuple(t.shape)}; expected (n,) or (n, d)"
            )
        return t
