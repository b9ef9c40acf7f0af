"""Records as the audits take them: ``(x, y)`` tensors read from pairs, datasets and arrays; and
read-only copies of the arrays an audit returns."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["as_xy", "frozen"]


def frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


def _as_tensor(a: Any, *, name: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach()
    try:
        return torch.as_tensor(np.asarray(a))
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must hold numeric arrays / tensors") from None


def _is_array(a: Any) -> bool:
    return isinstance(a, torch.Tensor | np.ndarray)


def as_xy(data: Any, *, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read a set of records as ``(x, y)`` tensors (``y`` None for unlabelled records).

    Accepted: a tuple ``(x, y)`` (or a list of two arrays / tensors) with the same first
    dimension, always read as features and labels; a ``TensorDataset``; a single array / tensor
    (unlabelled); a list or map-style dataset of ``(x_i, y_i)`` records (stacked).
    """
    if data is None:
        raise ValueError(f"{name} is required")
    tensors = getattr(data, "tensors", None)  # torch.utils.data.TensorDataset
    if isinstance(tensors, tuple) and tensors and all(_is_array(t) for t in tensors):
        if len(tensors) > 2:
            raise ValueError(
                f"{name} is a TensorDataset of {len(tensors)} tensors; pass the pair (x, y)"
            )
        data = tensors if len(tensors) > 1 else tensors[0]
    if _is_array(data):
        x = _as_tensor(data, name=name)
        if x.ndim == 0:
            raise ValueError(f"{name} must have one row per record, got a scalar")
        return x, None
    if (
        isinstance(data, tuple | list)
        and len(data) == 2
        and (isinstance(data, tuple) or all(_is_array(t) for t in data))
    ):
        x, y = (_as_tensor(t, name=name) for t in data)
        if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{name} = (x, y) needs x and y with the same number of rows, got shapes "
                f"{tuple(x.shape)} and {tuple(y.shape)}"
            )
        return x, y
    try:
        n = len(data)
    except TypeError:
        raise ValueError(
            f"{name} must be a pair (x, y) of arrays / tensors, a TensorDataset, or a sequence "
            f"of (x, y) records, got {type(data).__name__}"
        ) from None
    if n == 0:
        raise ValueError(f"{name} is empty")
    records = [data[i] for i in range(n)]
    labelled = isinstance(records[0], tuple | list)
    try:
        if labelled:
            x = torch.stack([_as_tensor(r[0], name=name) for r in records])
            y = torch.stack([_as_tensor(r[1], name=name) for r in records])
            return x, y
        return torch.stack([_as_tensor(r, name=name) for r in records]), None
    except (RuntimeError, IndexError, TypeError):
        raise ValueError(
            f"{name}: could not stack its records into tensors; pass a pair (x, y) of arrays"
        ) from None
