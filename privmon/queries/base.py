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

__all__ = ["CallableQuery", "Query", "check_scores", "score_shape"]


class Query(abc.ABC):
    """Base class: ``prepare(device)`` → ``__call__(batch)`` per batch → ``release()``.

    Attributes:
        name: short tag used in reports and TensorBoard.
        modules: every module the query runs; the monitor saves and restores their train/eval modes
            and puts them in eval mode during a check.
        discrete: True when scores take few distinct values (histogram estimators only).
        higher_is_member: True / False when members tend to score higher / lower, None if unknown
            or for vector scores.
        transform: optional ``batch -> (x, y)`` adapter (:mod:`privmon.queries`).

    Subclass it for a query with per-check state (samples to draw, caches): implement
    ``__call__``, and ``prepare`` / ``release`` where needed.

    Examples:
        >>> import torch
        >>> from privmon.queries import Query
        >>> class NormQuery(Query):
        ...     higher_is_member = False
        ...     def __call__(self, batch):
        ...         return batch.norm(dim=1)
        >>> query = NormQuery(name="norm")
        >>> query(torch.ones(3, 4)).tolist()
        [2.0, 2.0, 2.0]
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

    Args:
        fn: ``batch -> scores``, one score (or row of scores) per record of the raw batch.
        name: tag in reports.
        modules: every module ``fn`` runs, so that the monitor protects its train / eval mode.
        discrete: True when the scores take few distinct values (histogram estimators only).
        higher_is_member: True / False when members tend to score higher / lower; None: unknown.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import CallableQuery
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 3)
        >>> def margin(batch):  # top logit minus the runner-up
        ...     top2 = model(batch[0]).topk(2, dim=1).values
        ...     return top2[:, 0] - top2[:, 1]
        >>> query = CallableQuery(margin, name="margin", modules=model, higher_is_member=True)
        >>> query((torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0]))).shape
        torch.Size([5])
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


def check_scores(
    scores: Any, *, records: int | None, trailing: tuple[int, ...] | None, name: str
) -> torch.Tensor:
    """A query's scores for one batch, checked against the protocol: a tensor of shape (n,) or
    (n, d), one row per record of the batch (``records``, from
    :func:`~privmon.queries.batches.count_records`; None: not checked) and the trailing shape of
    the query's earlier batches (``trailing``; None at its first batch). A ValueError names the
    query (``name``) and what it returned: rows that do not match the records would give the
    wrong records' risks."""
    if not isinstance(scores, torch.Tensor):
        raise ValueError(
            f"query {name!r} returned a {type(scores).__name__}; expected a torch.Tensor of "
            "shape (n,) or (n, d)"
        )
    shape = tuple(scores.shape)
    if scores.ndim not in (1, 2):
        what = "a 0-d tensor (one number for the whole batch)" if not shape else f"shape {shape}"
        raise ValueError(
            f"query {name!r} returned {what}; expected one score per record, shape (n,) or (n, d)"
        )
    if records is not None and shape[0] != records:
        raise ValueError(
            f"query {name!r} returned {shape[0]} rows (shape {shape}) for a batch of "
            f"{records} records; expected one row per record, in the batch's order"
        )
    if trailing is not None and shape[1:] != trailing:
        raise ValueError(
            f"query {name!r} changed its scores' shape between batches: "
            f"{score_shape(trailing)} at first, then {score_shape(shape[1:])}"
        )
    return scores


def score_shape(trailing: tuple[int, ...]) -> str:
    """Scores' shape as the protocol writes it, from their trailing shape: ``(n,)``,
    ``(n, d)``."""
    return "(n,)" if not trailing else f"(n, {', '.join(map(str, trailing))})"
