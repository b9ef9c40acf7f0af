"""Membership-inference risk per subgroup of the records (DOMIAS §5.3).

DOMIAS (van Breugel et al., "Membership Inference Attacks against Synthetic Data through
Overfitting Detection", Sec. 5.3, Fig. 5) shows that an attack's success can differ sharply
between groups of records: a generator overfits sparse regions, so an under-represented group
can be far more exposed than the population while a global AUC near 0.5 hides it ("data
publishers [should] quantify the excess MIA risk to specific subgroups", Sec. 6).
:func:`subgroup_risk` restricts an attack's figures to the members and non-members of each
user-given group: one stable sort by group, then one ranking per group through the functions
behind :func:`privmon.auc` and :func:`privmon.top_q_precision`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from privmon._validation import as_scores, check_quantiles, to_numpy
from privmon.estimators.roc import auc_from_ranking, rank_scores, top_q_precision_from_ranking

__all__ = ["subgroup_risk"]

DEFAULT_Q = (0.01, 0.05, 0.1, 0.2)


def _scores(x: Any, *, name: str) -> np.ndarray:
    """float64 numpy vector of one score per record; non-finite values kept (flagged later)."""
    t, _ = as_scores(x, name=name, drop=False)
    if t.shape[1] != 1:
        raise ValueError(
            f"{name} must be one score per record, shape (n,) or (n, 1), got d = {t.shape[1]} "
            "dimensions"
        )
    return to_numpy(t[:, 0])


def _labels(groups: Any, *, name: str, n: int, scores_name: str) -> np.ndarray:
    if isinstance(groups, torch.Tensor):
        groups = to_numpy(groups)
    arr = np.asarray(groups)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must be one group label per record, shape (n,), got shape {arr.shape}"
        )
    if arr.shape[0] != n:
        raise ValueError(
            f"{name} has {arr.shape[0]} labels but {scores_name} has {n} scores; "
            "they must have one label per score, in the same order"
        )
    return arr


def _key(v: Any) -> Hashable:
    """numpy scalars -> Python scalars (JSON-friendly dict keys)."""
    return v.item() if isinstance(v, np.generic) else v


def subgroup_risk(
    member_scores: Any,
    nonmember_scores: Any,
    member_groups: Any,
    nonmember_groups: Any,
    *,
    q: float | Sequence[float] = DEFAULT_Q,
) -> dict[Hashable, dict[str, Any]]:
    """AUC and top-q precision of an attack within each subgroup (DOMIAS §5.3).

    Args:
        member_scores, nonmember_scores: attack scores (higher = member) of the member and
            non-member records, numpy arrays or torch tensors of shape (n,) or (n, 1).
        member_groups, nonmember_groups: one group label per score, in the same order (any
            labels ``np.unique`` can sort: integers, strings, booleans; numpy arrays, lists or
            torch tensors). Labels are compared by value across the two sides.
        q: quantile(s) in (0, 1] for the top-q precision.

    Returns:
        ``{group: figures}`` with groups in sorted order (numpy scalar labels turned into Python
        scalars). ``figures["auc"]``: :func:`privmon.auc` of the group's member scores against
        its non-member scores; ``figures["top_q_precision"]``: ``{q: precision}``, the member
        fraction among the group's ceil(q · n_group) highest scores (DOMIAS App. D), to read
        against ``figures["member_fraction"]`` (the precision of guessing at random within the
        group); ``n_members`` / ``n_nonmembers``: the group's finite scores on each side;
        ``n_dropped``: its NaN / infinite scores, dropped before ranking. ``auc`` and
        ``top_q_precision`` are NaN for a group without a finite member score or without a
        finite non-member score (no error: one empty cell does not hide the other groups);
        ``member_fraction`` is NaN for a group with no finite score.

    Raises:
        ValueError: a score argument is empty or has more than one dimension per record; a label
            argument's length differs from its scores'; ``q`` outside (0, 1]; labels of the two
            sides that cannot be sorted together. Messages name the argument.

    Examples:
        >>> import numpy as np
        >>> from privmon.attacks import subgroup_risk
        >>> rng = np.random.default_rng(0)
        >>> groups = np.repeat(["common", "rare"], [900, 100])
        >>> members = rng.normal(size=1000) + (groups == "rare")  # the rare group leaks
        >>> risk = subgroup_risk(members, rng.normal(size=1000), groups, groups, q=0.1)
        >>> {group: round(figures["auc"], 2) for group, figures in risk.items()}
        {'common': 0.49, 'rare': 0.73}
        >>> risk["rare"]["n_members"], risk["rare"]["member_fraction"]
        (100, 0.5)
    """
    qs, _ = check_quantiles(q)
    mem = _scores(member_scores, name="member_scores")
    non = _scores(nonmember_scores, name="nonmember_scores")
    g_mem = _labels(
        member_groups, name="member_groups", n=mem.shape[0], scores_name="member_scores"
    )
    g_non = _labels(
        nonmember_groups, name="nonmember_groups", n=non.shape[0], scores_name="nonmember_scores"
    )
    if (g_mem.dtype.kind in "USO") != (g_non.dtype.kind in "USO") and g_mem.size and g_non.size:
        raise ValueError(
            f"member_groups ({g_mem.dtype}) and nonmember_groups ({g_non.dtype}) hold labels of "
            "different kinds (numbers against strings); use the same labels on both sides"
        )
    try:
        groups, inverse = np.unique(np.concatenate([g_mem, g_non]), return_inverse=True)
    except TypeError as err:
        raise ValueError(
            "member_groups and nonmember_groups must hold labels that can be compared and sorted "
            f"together (e.g. all integers or all strings): {err}"
        ) from None
    inverse = inverse.reshape(-1)
    n1 = mem.shape[0]
    scores = np.concatenate([mem, non])
    is_member = np.arange(scores.shape[0]) < n1
    finite = np.isfinite(scores)
    n_groups = groups.shape[0]
    # counts per group for every record class, in one bincount each
    n_mem = np.bincount(inverse[is_member & finite], minlength=n_groups)
    n_non = np.bincount(inverse[~is_member & finite], minlength=n_groups)
    n_bad = np.bincount(inverse[~finite], minlength=n_groups)
    # records sorted by group (stable: each side keeps its order within a group)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(n_groups + 1))
    nan_q = dict.fromkeys(qs.tolist(), float("nan"))
    out: dict[Hashable, dict[str, Any]] = {}
    for i, label in enumerate(groups):
        idx = order[bounds[i] : bounds[i + 1]]
        nm, nn = int(n_mem[i]), int(n_non[i])
        total = nm + nn
        entry: dict[str, Any] = {
            "auc": float("nan"),
            "top_q_precision": dict(nan_q),
            "n_members": nm,
            "n_nonmembers": nn,
            "n_dropped": int(n_bad[i]),
            "member_fraction": nm / total if total else float("nan"),
        }
        if nm and nn:
            keep = idx[finite[idx]]
            r = rank_scores(scores[keep[is_member[keep]]], scores[keep[~is_member[keep]]])
            entry["auc"] = auc_from_ranking(r)
            prec = top_q_precision_from_ranking(r, qs)
            entry["top_q_precision"] = dict(zip(qs.tolist(), prec.tolist(), strict=True))
        out[_key(label)] = entry
    return out
