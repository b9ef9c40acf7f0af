"""Threshold metrics of a membership score: AUC, ROC curve, TPR at low FPR, accuracy at the
median, top-q precision.

Convention: a higher score means "more likely a member". Every public function takes the member
scores and the non-member scores (numpy arrays or torch tensors on any device, shape (n,) or
(n, 1)); rows that are NaN or infinite are dropped (never counted as ties). The non-member scores
are moved onto the member scores' device and all work is done there in torch (numpy sorts CPU
scores), in O(n log n): the pooled scores are sorted once (:func:`rank_scores`) and every metric
is read off the cumulative member / non-member counts per distinct score. Results are Python
floats or numpy arrays. Sources (LiRA, DOMIAS): Theory, *Threshold metrics of a score*.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from privmon._label_order import check_not_label_order
from privmon._validation import (
    as_scores,
    check_fprs,
    check_quantiles,
    to_numpy,
)

__all__ = [
    "Ranked",
    "accuracy_at_median",
    "auc",
    "auc_from_ranking",
    "rank_scores",
    "roc_curve",
    "roc_summary",
    "summary_from_ascending",
    "top_q_precision",
    "top_q_precision_from_ranking",
    "tpr_at_fpr",
]

_DEFAULT_FPR = (0.1, 0.01, 0.001)


@dataclass(frozen=True)
class Ranked:
    """The pooled scores sorted once, summarised per distinct score.

    ``values`` holds the distinct pooled scores in decreasing order; ``tp[i]`` / ``fp[i]`` count the
    members / non-members with score >= ``values[i]`` (int64, non-decreasing). ``median`` is the
    numpy-convention median of the pooled scores (mean of the two middle ones when n is even).
    All tensors live on the member scores' device.
    """

    values: torch.Tensor
    tp: torch.Tensor
    fp: torch.Tensor
    median: torch.Tensor
    n1: int
    n0: int
    n_dropped_member: int
    n_dropped_nonmember: int

    @property
    def fpr(self) -> torch.Tensor:
        """False-positive rate at each distinct threshold (without the leading 0)."""
        return self.fp.to(torch.float64) / self.n0

    @property
    def tpr(self) -> torch.Tensor:
        """True-positive rate at each distinct threshold (without the leading 0)."""
        return self.tp.to(torch.float64) / self.n1


def _one_dim(
    scores: Any, *, name: str, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    t, dropped = as_scores(scores, name=name, device=device)
    if t.shape[1] != 1:
        raise ValueError(
            f"{name} must be one score per record, shape (n,) or (n, 1), got d = {t.shape[1]} "
            "dimensions; reduce the scores to one dimension first"
        )
    return t[:, 0], dropped


def _sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x sorted in decreasing order and the sorting indices. On the CPU numpy's argsort is
    several times faster than torch.sort for the few thousand scores of an audit (and than two
    sorts plus a binary search for the members); elsewhere torch.sort on the device."""
    if x.device.type == "cpu":
        values = to_numpy(x)
        order = np.argsort(-values)
        return torch.from_numpy(values[order]), torch.from_numpy(order)
    return torch.sort(x, descending=True)


def rank_scores(member_scores: Any, nonmember_scores: Any) -> Ranked:
    """Validate, pool, sort once and count members / non-members per distinct score."""
    pos, d1 = _one_dim(member_scores, name="member_scores")
    neg, d0 = _one_dim(nonmember_scores, name="nonmember_scores", device=pos.device)
    return _rank_sorted(*_sort_descending(torch.cat([pos, neg])), pos.shape[0], d1, d0)


def _rank_sorted(
    sorted_scores: torch.Tensor, order: torch.Tensor, n1: int, d1: int = 0, d0: int = 0
) -> Ranked:
    """The ranking of finite 1-D scores whose first ``n1`` are the members, from their
    :func:`_sort_descending`."""
    n = sorted_scores.shape[0]
    values, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = torch.cumsum(counts, 0)  # records with a score >= each distinct score
    tp = torch.cumsum(order < n1, 0)[ends - 1]  # members come first in pooled
    fp = ends - tp
    # Halve before adding so the midpoint of two huge finite scores cannot overflow; this equals
    # numpy's (a + b) / 2 bit for bit unless that overflows or the halves are subnormal.
    median = sorted_scores[(n - 1) // 2] / 2 + sorted_scores[n // 2] / 2
    return Ranked(values, tp, fp, median, n1, n - n1, d1, d0)


def _negated(r: Ranked) -> Ranked:
    """The ranking of the negated scores, without sorting again: distinct scores reverse, and
    the members with −score >= −v are those not strictly above v."""
    tp0 = _with_origin(r.tp)[:-1]  # members strictly above each distinct score
    fp0 = _with_origin(r.fp)[:-1]
    return Ranked(
        values=-r.values.flip(0),
        tp=(r.n1 - tp0).flip(0),
        fp=(r.n0 - fp0).flip(0),
        median=-r.median,
        n1=r.n1,
        n0=r.n0,
        n_dropped_member=r.n_dropped_member,
        n_dropped_nonmember=r.n_dropped_nonmember,
    )


# --- metrics read off a Ranked (shared by the public functions and roc_summary) -----------------


def _two_u(r: Ranked) -> int:
    return int(_two_u_tensor(_with_origin(r.tp), _with_origin(r.fp), r.n0))


def _two_u_tensor(tp0: torch.Tensor, fp0: torch.Tensor, n0: int) -> torch.Tensor:
    # Mann–Whitney U with mid-ranks, grouped by distinct score: each member in a group with h_g
    # non-members beats the non-members strictly below and ties with h_g of them, so
    # 2U = sum_g m_g * (2 * below_g + h_g). Integer arithmetic: exact for any number of ties.
    # tp0 / fp0: the cumulative counts with a leading 0.
    m_g, h_g = tp0.diff(), fp0.diff()
    below = n0 - fp0[1:]
    return torch.sum(m_g * (2 * below + h_g))


def auc_from_ranking(r: Ranked) -> float:
    """The AUC of a ranking (Mann–Whitney U with mid-ranks, exact)."""
    return _two_u(r) / (2 * r.n1 * r.n0)


def _roc_from(r: Ranked) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    zero = r.values.new_zeros(1)
    fpr = torch.cat([zero, r.fpr])
    tpr = torch.cat([zero, r.tpr])
    thresholds = torch.cat([r.values.new_full((1,), math.inf), r.values])
    return to_numpy(fpr), to_numpy(tpr), to_numpy(thresholds)


def _with_origin(counts: torch.Tensor) -> torch.Tensor:
    """Cumulative counts with the (0, 0) point (threshold +inf) prepended at index 0."""
    return torch.cat([counts.new_zeros(1), counts])


def _fpr_points(r: Ranked, targets: list[float]) -> torch.Tensor:
    # fpr and tpr are non-decreasing along the curve, so the largest TPR with FPR <= t sits at the
    # last point with FPR <= t: its index into the counts with the origin prepended.
    fpr = r.fpr
    return torch.searchsorted(fpr, fpr.new_tensor(targets), right=True)


def _median_point(r: Ranked) -> torch.Tensor:
    """Number of distinct scores strictly above the median tau, shape (1,)."""
    return (r.values > r.median).sum().reshape(1)


def _tpr_at_fpr_from(r: Ranked, targets: list[float]) -> list[float]:
    # int / int gives the same float as tp.to(float64) / n1
    return [tp / r.n1 for tp in _with_origin(r.tp)[_fpr_points(r, targets)].tolist()]


def _accuracy_at_median_from(r: Ranked) -> float:
    k = _median_point(r)
    tp, fp = torch.cat([_with_origin(r.tp)[k], _with_origin(r.fp)[k]]).tolist()
    return (tp + (r.n0 - fp)) / (r.n1 + r.n0)


def top_q_precision_from_ranking(r: Ranked, qs: np.ndarray) -> np.ndarray:
    """The top-q precision of a ranking at each checked quantile of ``qs`` (see
    :func:`top_q_precision`)."""
    n = r.n1 + r.n0
    x = qs * n
    # k = ceil(q * n), robust to q * n landing a rounding error above an integer (0.3 * 10).
    nearest = np.round(x)
    k = np.where(np.abs(x - nearest) <= 1e-9 * np.maximum(x, 1.0), nearest, np.ceil(x))
    k = np.clip(k, 1, n).astype(np.int64)
    kt = torch.as_tensor(k, device=r.values.device)
    count = r.tp + r.fp  # records with score >= values[i]
    g = torch.searchsorted(count, kt)  # the distinct score whose group holds the k-th record
    count0 = torch.cat([count.new_zeros(1), count])
    tp0 = torch.cat([r.tp.new_zeros(1), r.tp])
    above, members_above = count0[g], tp0[g]  # records strictly above the cut group
    group_size = count0[g + 1] - above
    group_members = tp0[g + 1] - members_above
    taken = (kt - above).to(torch.float64)
    expected = members_above.to(torch.float64) + taken * group_members / group_size
    return to_numpy(expected / kt)


def _fpr_key(f: float) -> str:
    return f"tpr@fpr={f!r}"


# --- public API ----------------------------------------------------------------------------------


def auc(member_scores: Any, nonmember_scores: Any) -> float:
    """Area under the ROC curve: P(member score > non-member score) + 1/2 P(tie).

    Computed as the Mann–Whitney U statistic with mid-ranks for tied scores, divided by
    n_members * n_nonmembers, in O(n log n). Exact for any pattern of ties (integer arithmetic);
    equals ``sklearn.metrics.roc_auc_score`` on the pooled scores with members labelled 1.
    NaN / infinite scores are dropped before ranking.

    The arguments are the two score sets, not scikit-learn's ``(y_true, y_score)``: for labels
    and scores call ``privmon.auc(y_score[y_true == 1], y_score[y_true == 0])``. A call in the
    scikit-learn order (a 0/1 first argument as long as a second one with other values) is
    refused rather than answered wrongly.

    Raises:
        ValueError: a score argument is empty, has no finite value, or has more than one
            dimension per record (the message names the argument); the arguments look like
            scikit-learn's ``(y_true, y_score)``.

    Examples:
        >>> import torch
        >>> from privmon import auc
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> nonmembers = torch.randn(500, generator=gen)
        >>> auc(members, nonmembers)
        0.649208
    """
    check_not_label_order(member_scores, nonmember_scores, fn="auc")
    return auc_from_ranking(rank_scores(member_scores, nonmember_scores))


def roc_curve(
    member_scores: Any, nonmember_scores: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROC curve ``(fpr, tpr, thresholds)`` of the rule "member when score >= threshold".

    Same convention as ``sklearn.metrics.roc_curve(..., drop_intermediate=False)``: the first
    point is (0, 0) with threshold +inf, then one point per distinct finite score, thresholds
    decreasing, ending at (1, 1). Arrays are float64 numpy arrays of equal length.

    Like :func:`auc` it takes the two score sets, not ``(y_true, y_score)``: call
    ``privmon.roc_curve(y_score[y_true == 1], y_score[y_true == 0])``; the scikit-learn order is
    refused with a ValueError that says so.

    Examples:
        >>> import torch
        >>> from privmon import roc_curve
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> nonmembers = torch.randn(500, generator=gen)
        >>> fpr, tpr, thresholds = roc_curve(members, nonmembers)
        >>> fpr.shape, fpr[[0, -1]].tolist(), tpr[[0, -1]].tolist(), float(thresholds[0])
        ((1001,), [0.0, 1.0], [0.0, 1.0], inf)
    """
    check_not_label_order(member_scores, nonmember_scores, fn="roc_curve")
    return _roc_from(rank_scores(member_scores, nonmember_scores))


def tpr_at_fpr(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    fpr: float | Sequence[float] = _DEFAULT_FPR,
) -> dict[float, float]:
    """True-positive rate at low false-positive rates (Carlini et al., LiRA).

    For each target ``fpr`` the largest TPR among the ROC points (see :func:`roc_curve`) whose
    FPR is <= the target; no interpolation between points, so the value is achievable by an
    actual threshold. With n0 non-members, a target below 1/n0 can only be met by the (0, 0)
    point and so reads 0 unless some member scores above every non-member: use at least ~10/fpr
    non-members for a stable reading.

    Args:
        fpr: one target or a sequence of targets, each in the open interval (0, 1).

    Returns:
        ``{target: tpr}`` keyed by the targets as floats, in the order given.

    Examples:
        >>> import torch
        >>> from privmon import tpr_at_fpr
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> nonmembers = torch.randn(500, generator=gen)
        >>> tpr_at_fpr(members, nonmembers, fpr=[0.1, 0.01])
        {0.1: 0.2, 0.01: 0.026}
    """
    targets = check_fprs(fpr)
    values = _tpr_at_fpr_from(rank_scores(member_scores, nonmember_scores), targets)
    return dict(zip(targets, values, strict=True))


def accuracy_at_median(member_scores: Any, nonmember_scores: Any) -> float:
    """Accuracy of the DOMIAS median-threshold attack.

    DOMIAS (App. A, algorithm steps 4-5): tau = median of the pooled test scores (numpy
    convention: the mean of the two middle scores when their number is even), predict "member"
    when score > tau. Returns the plain accuracy over the pooled set: members are correct when
    score > tau, non-members when score <= tau.

    Tie rule: a score equal to tau is predicted non-member (the strict inequality of DOMIAS). With
    many scores tied at the median this leans towards "non-member"; in the extreme where every
    score is equal the result is n_nonmembers / n_total.

    Examples:
        >>> import torch
        >>> from privmon import accuracy_at_median
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> nonmembers = torch.randn(500, generator=gen)
        >>> accuracy_at_median(members, nonmembers)
        0.612
    """
    return _accuracy_at_median_from(rank_scores(member_scores, nonmember_scores))


def top_q_precision(
    member_scores: Any, nonmember_scores: Any, *, q: float | Sequence[float]
) -> float | np.ndarray:
    """Precision of the attacker that only claims its top q-quantile (DOMIAS App. D).

    DOMIAS defines P(A, D_test, q) = mean membership of {x : score(x) > Quantile(scores, 1 - q)}.
    Here that set is made exact and tie-aware: it is the k = ceil(q * n) highest-scoring records
    of the n pooled ones (k >= 1). When a group of tied scores straddles the cut, only part of it
    can be taken; the tied group then contributes its member fraction times the number of
    records taken from it, i.e. the expected precision of a uniformly random tie-break. Without
    ties this is the fraction of members among the top k records.

    Args:
        q: a quantile in (0, 1], or a sequence of them. ``q = 1`` gives the member fraction.

    Returns:
        A float for a scalar ``q``, else a float64 numpy array with one value per ``q``.

    Examples:
        >>> import torch
        >>> from privmon import top_q_precision
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> nonmembers = torch.randn(500, generator=gen)
        >>> top_q_precision(members, nonmembers, q=0.1)
        0.66
        >>> top_q_precision(members, nonmembers, q=[0.1, 1.0]).tolist()
        [0.66, 0.5]
    """
    qs, scalar = check_quantiles(q)
    out = top_q_precision_from_ranking(rank_scores(member_scores, nonmember_scores), qs)
    return float(out[0]) if scalar else out


def roc_summary(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    fpr: float | Sequence[float] = _DEFAULT_FPR,
    higher_is_member: bool | None = True,
) -> dict[str, float]:
    """AUC, TPR at each target FPR and accuracy at the median from a single sort.

    ``higher_is_member``: True reads the scores as given; False reads their negation (for
    scores such as a loss, low on members); None picks whichever orientation has AUC >= 0.5 (the
    one an attacker would pick; the given one on a tie). Either way the scores are sorted once.

    Returns ``{"auc": ..., "tpr@fpr=0.1": ..., "tpr@fpr=0.01": ..., "tpr@fpr=0.001": ...,
    "accuracy_at_median": ...}`` (one ``tpr@fpr=<repr(target)>`` key per target). The values
    are identical to those of :func:`auc`, :func:`tpr_at_fpr` and :func:`accuracy_at_median`.

    Examples:
        >>> import torch
        >>> from privmon import roc_summary
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> nonmembers = torch.randn(500, generator=gen)
        >>> roc_summary(members, nonmembers)
        {'auc': 0.649208, 'tpr@fpr=0.1': 0.2, 'tpr@fpr=0.01': 0.026, 'tpr@fpr=0.001': 0.008,
         'accuracy_at_median': 0.612}
        >>> roc_summary(-members, -nonmembers, higher_is_member=False)["auc"]  # e.g. a loss
        0.649208
    """
    targets = check_fprs(fpr)
    if higher_is_member not in (True, False, None):
        raise ValueError(f"higher_is_member must be True, False or None, got {higher_is_member!r}")
    pos, _ = _one_dim(member_scores, name="member_scores")
    neg, _ = _one_dim(nonmember_scores, name="nonmember_scores", device=pos.device)
    pooled = torch.cat([pos, neg])
    if higher_is_member is False:  # rank the negated scores (exact) instead of negating a ranking
        pooled = -pooled
    return _summary(*_sort_descending(pooled), pos.shape[0], targets, higher_is_member)


def summary_from_ascending(
    values: torch.Tensor,
    order: torch.Tensor,
    n1: int,
    *,
    higher_is_member: bool | None,
    fpr: Sequence[float] = _DEFAULT_FPR,
) -> dict[str, float]:
    """:func:`roc_summary` (arguments already checked) from finite 1-D scores sorted ascending
    (``values``) and their sorting indices (``order``), the first ``n1`` pooled scores being the
    members: the analysis shares this sort with the grid's range. Tied scores may come in any
    order: every figure is read per distinct score."""
    if higher_is_member is False:  # descending −x is −(ascending x), in the same order
        return _summary(-values, order, n1, list(fpr), higher_is_member)
    return _summary(values.flip(0), order.flip(0), n1, list(fpr), higher_is_member)


def _summary(
    sorted_scores: torch.Tensor,
    order: torch.Tensor,
    n1: int,
    targets: list[float],
    higher_is_member: bool | None,
) -> dict[str, float]:
    """:func:`roc_summary` from the :func:`_sort_descending` of the finite 1-D scores (negated
    when ``higher_is_member`` is False) whose first ``n1`` are the members (arguments already
    checked): every figure in one device transfer."""
    r = _rank_sorted(sorted_scores, order, n1)
    pairs2 = 2 * r.n1 * r.n0
    if higher_is_member is None and 2 * _two_u(r) < pairs2:
        # negating the scores swaps "above" and "below" and keeps ties: 2U' = 2·n1·n0 − 2U
        r = _negated(r)
    tp0, fp0 = _with_origin(r.tp), _with_origin(r.fp)
    at = torch.cat([_fpr_points(r, targets), _median_point(r)])
    two_u, *counts = torch.cat(
        [_two_u_tensor(tp0, fp0, r.n0).reshape(1), tp0[at], fp0[at]]
    ).tolist()
    tps, fps = counts[: len(at)], counts[len(at) :]
    out = {"auc": two_u / pairs2}
    for target, tp in zip(targets, tps[:-1], strict=True):
        out[_fpr_key(target)] = tp / r.n1
    out["accuracy_at_median"] = (tps[-1] + r.n0 - fps[-1]) / (r.n1 + r.n0)
    return out
