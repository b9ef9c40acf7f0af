"""The guard against scikit-learn's ``(y_true, y_score)`` order passed as ``(member,
nonmember)`` scores, shared by the ROC figures and the one-run audit."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["check_not_label_order"]


def _flat_values(x: Any) -> torch.Tensor | np.ndarray | None:
    """x as 1-D values (shape (n,) or (n, 1); a tensor stays on its device), or None when x is
    not such an array."""
    if isinstance(x, torch.Tensor):
        arr: Any = x.detach()
    else:
        try:
            arr = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError):
            return None
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    return arr if arr.ndim == 1 else None


def _is_label_vector(x: Any) -> bool:
    """Every value is 0 or 1 and both occur (numpy or torch, on the tensor's device)."""
    ones, zeros = x == 1, x == 0
    return bool((ones | zeros).all() and ones.any() and zeros.any())


def _has_fraction(x: Any) -> bool:
    """Some finite value is not an integer (numpy or torch, on the tensor's device)."""
    if isinstance(x, torch.Tensor):
        x = x.to(torch.float64)
        return bool((torch.isfinite(x) & (x != torch.round(x))).any())
    return bool((np.isfinite(x) & (x != np.round(x))).any())


_LABEL_ORDER_MIN = 10  # shorter 0/1 vectors are too easily real (discrete) scores


def check_not_label_order(member_scores: Any, nonmember_scores: Any, *, fn: str) -> None:
    """Refuse scikit-learn's ``(y_true, y_score)`` order passed as ``(member, nonmember)``.

    The signature of that mistake: a first argument of at least 10 values, all 0 or 1 and both
    present (a label vector), exactly as long as a second argument that holds a non-integer
    value (continuous scores). Two real score sets practically never look like that: a query
    whose member scores are all 0/1 gives 0/1 non-member scores too. (For such data anyway,
    ``privmon.roc_summary`` gives the same AUC without this check.)
    """
    first, second = _flat_values(member_scores), _flat_values(nonmember_scores)
    if first is None or second is None or len(first) != len(second):
        return
    if len(first) < _LABEL_ORDER_MIN or not _is_label_vector(first) or not _has_fraction(second):
        return
    raise ValueError(
        f"privmon.{fn} takes (member_scores, nonmember_scores), not scikit-learn's "
        f"(y_true, y_score): the first argument holds only 0/1 labels and is as long as the "
        f"second. Call privmon.{fn}(y_score[y_true == 1], y_score[y_true == 0])."
    )
