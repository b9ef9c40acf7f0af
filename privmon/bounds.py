"""Differential privacy <-> membership advantage.

* :func:`tanh_bound` — the ceiling an (ε, δ)-DP training algorithm puts on membership inference
  (MACE Theorem 4, eq. 14, extended to δ > 0 by the (ε, δ) hypothesis-testing region).
* :func:`epsilon_lower_bound` — the smallest ε consistent with an observed advantage (inverse of
  eq. 14).
* :func:`epsilon_from_counts` / :func:`epsilon_audit` — statistical ε lower bounds from an attack's
  confusion matrix (Jagielski et al. 2020, Nasr et al. 2021), with Clopper–Pearson intervals.
* :func:`epsilon_from_opacus` — ε spent so far, read from an Opacus ``PrivacyEngine`` or accountant.

Notation: prior p = P(member), λ = log(p / (1 − p)); the accuracy advantage of an attack is
Adv = 2p·TPR − 2(1−p)·FPR + 1 − 2p (MACE eq. 7), at least |2p − 1|. Every ceiling assumes members
and non-members are exchangeable: a shifted held-out set looks like leakage, and an "advantage"
above the ceiling may then reflect the shift, not a broken DP guarantee. Derivations: Theory,
*Differential privacy and the membership advantage*.
"""

from __future__ import annotations

import math
from typing import Any, overload

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray

from privmon._shown import shown
from privmon._validation import (
    as_float_array,
    as_scores,
    check_count,
    check_epsilons,
    check_half_open_interval,
    check_open_unit,
    to_numpy,
)
from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper

__all__ = [
    "epsilon_audit",
    "epsilon_from_counts",
    "epsilon_from_opacus",
    "epsilon_lower_bound",
    "tanh_bound",
]


def _out(arr: NDArray[np.float64], like: NDArray[np.float64]) -> float | NDArray[np.float64]:
    """A Python float for 0-d input, an array of the input's shape otherwise."""
    return float(arr) if like.ndim == 0 else np.asarray(arr, dtype=np.float64)


def _abs_lambda(prior: float) -> float:
    """|λ| = |log(p / (1 − p))|."""
    return abs(math.log(prior) - math.log1p(-prior))


# --------------------------------------------------------------------------------------------------
# ceilings


def _theorem4(eps: NDArray[np.float64], prior: float) -> NDArray[np.float64]:
    # max(|tanh((ε+λ)/2)|, |tanh((λ−ε)/2)|) = tanh((ε+|λ|)/2) for ε ≥ 0 (tanh is odd, increasing).
    # With q = max(p, 1−p), e^|λ| = q/(1−q) and eq. (17) give (q − (1−q)e^−ε) / (q + (1−q)e^−ε):
    # exact |2p − 1| at ε = 0 and 1 at ε = inf, no overflow.
    q = max(prior, 1.0 - prior)
    e = np.exp(-eps)
    return (q - (1.0 - q) * e) / (q + (1.0 - q) * e)


def _lp_ceiling(eps: NDArray[np.float64], prior: float, delta: float) -> NDArray[np.float64]:
    # Best accuracy advantage over the (ε, δ) region: 1 − (1 − δ)·(1 − max(tanh(ε/2), |2p − 1|)).
    return 1.0 - (1.0 - delta) * (1.0 - np.maximum(np.tanh(eps / 2.0), abs(2.0 * prior - 1.0)))


@overload
def tanh_bound(epsilon: float, prior: float = ..., delta: float = ...) -> float: ...
@overload
def tanh_bound(
    epsilon: NDArray[Any], prior: float = ..., delta: float = ...
) -> NDArray[np.float64]: ...
def tanh_bound(
    epsilon: ArrayLike, prior: float = 0.5, delta: float = 0.0
) -> float | NDArray[np.float64]:
    r"""Ceiling on membership advantage (and per-record risk) allowed by (ε, δ)-DP.

    δ = 0: MACE Theorem 4, eq. (14): ε-DP training gives |f_p(z)| ≤ tanh((ε + |λ|)/2) for every
    record z, hence the same bound on every attack's advantage; ``tanh_bound(0, prior=p)`` is
    |2p − 1|. δ > 0: the larger of that and the maximum advantage over the (ε, δ)
    hypothesis-testing region (Kairouz, Oh & Viswanath 2015), a linear program whose value is
    1 − (1 − δ)·(1 − max(tanh(ε/2), |2p − 1|)); continuous as δ → 0 and non-decreasing in ε and
    δ. Derivation: Theory, *Differential privacy and the membership advantage*.

    The ceiling compares like with like only when members and non-members are exchangeable; a
    held-out set drawn from a shifted distribution can exceed it without any DP violation.

    Args:
        epsilon: ε ≥ 0 (``inf`` allowed and gives 1.0); a scalar or an array (then an array of the
            same shape is returned).
        prior: membership prior p in (0, 1).
        delta: δ in [0, 1).

    Returns:
        The ceiling in [|2p − 1|, 1], a float (or an array for array ``epsilon``).

    Raises:
        ValueError: epsilon negative or NaN, prior outside (0, 1), delta outside [0, 1).

    Examples:
        >>> import numpy as np
        >>> from privmon import tanh_bound
        >>> round(tanh_bound(1.0), 4), round(tanh_bound(1.0, delta=1e-5), 4)
        (0.4621, 0.4621)
        >>> tanh_bound(np.array([0.5, 1.0, 2.0])).round(3).tolist()
        [0.245, 0.462, 0.762]
    """
    eps = check_epsilons(epsilon)
    p = check_open_unit(prior, name="prior")
    d = check_half_open_interval(delta, name="delta", low=0, high=1)
    out = _theorem4(eps, p)
    if d > 0.0:
        out = np.maximum(out, _lp_ceiling(eps, p, d))
    return _out(np.clip(out, 0.0, 1.0), eps)


@overload
def epsilon_lower_bound(advantage: float, prior: float = ...) -> float: ...
@overload
def epsilon_lower_bound(advantage: NDArray[Any], prior: float = ...) -> NDArray[np.float64]: ...
def epsilon_lower_bound(advantage: ArrayLike, prior: float = 0.5) -> float | NDArray[np.float64]:
    r"""Smallest ε consistent with an observed advantage: the inverse of eq. (14) (MACE Thm 4).

    ε ≥ 2·artanh(Adv) − |λ|, floored at 0 (an advantage up to |2p − 1| needs no leakage); Adv ≥ 1
    gives ``inf``, and ``epsilon_lower_bound(tanh_bound(ε, prior=p), prior=p) == ε``. It inverts
    the per-record ceiling, so it is conservative for an average advantage. Pass a certified
    *lower* confidence bound on the advantage (not a plug-in estimate) to get a certified ε
    bound. Only meaningful when members and non-members are exchangeable.

    Args:
        advantage: advantage in [0, 1], scalar or array.
        prior: membership prior p in (0, 1).

    Returns:
        ε lower bound ≥ 0 (float, or array for array input).

    Raises:
        ValueError: advantage outside [0, 1] or NaN, prior outside (0, 1).

    Examples:
        >>> from privmon import epsilon_lower_bound, tanh_bound
        >>> round(epsilon_lower_bound(0.2), 3)
        0.405
        >>> round(epsilon_lower_bound(tanh_bound(1.0)), 6)
        1.0
        >>> epsilon_lower_bound(0.3, prior=0.3)  # below the floor |2p − 1| = 0.4: no leakage
        0.0
    """
    if isinstance(advantage, torch.Tensor):
        advantage = to_numpy(advantage)
    adv = as_float_array(advantage, name="advantage", valid="[0, 1]")
    if np.isnan(adv).any() or (adv < 0).any() or (adv > 1).any():
        raise ValueError(f"advantage must be in [0, 1], got {shown(advantage)}")
    p = check_open_unit(prior, name="prior")
    with np.errstate(divide="ignore"):
        # 2·artanh(a) = log((1 + a)/(1 − a))
        eps = np.log1p(adv) - np.log1p(-np.minimum(adv, 1.0)) - _abs_lambda(p)
    eps = np.where(adv >= 1.0, np.inf, np.maximum(eps, 0.0))
    return _out(eps, adv)


# --------------------------------------------------------------------------------------------------
# auditing: epsilon lower bounds from an attack's confusion matrix


def _epsilon_from_count_arrays(
    tp: NDArray[Any],
    fn: NDArray[Any],
    fp: NDArray[Any],
    tn: NDArray[Any],
    *,
    delta: float,
    alpha: float,
) -> NDArray[np.float64]:
    """Vectorized core of :func:`epsilon_from_counts` (no validation)."""
    n1 = tp + fn
    n0 = fp + tn
    half = alpha / 2.0
    tpr_lo = clopper_pearson_lower(tp, n1, half)
    fpr_hi = clopper_pearson_upper(fp, n0, half)
    # Same two one-sided events, read through complements (Beta symmetry makes these exact):
    tnr_lo = clopper_pearson_lower(tn, n0, half)  # == 1 - fpr_hi
    fnr_hi = clopper_pearson_upper(fn, n1, half)  # == 1 - tpr_lo

    def _log_ratio(num: NDArray[np.float64], den: NDArray[np.float64]) -> NDArray[np.float64]:
        num = num - delta
        with np.errstate(divide="ignore", invalid="ignore"):
            val = np.log(np.where(num > 0, num, 1.0) / den)
        return np.where(num > 0, val, 0.0)

    eps = np.maximum(_log_ratio(tpr_lo, fpr_hi), _log_ratio(tnr_lo, fnr_hi))
    return np.maximum(eps, 0.0)


def epsilon_from_counts(
    *,
    true_positives: int,
    false_negatives: int,
    false_positives: int,
    true_negatives: int,
    delta: float = 0.0,
    alpha: float = 0.05,
) -> float:
    r"""Certified lower bound on ε from one membership test's confusion matrix.

    (Jagielski et al. 2020; Nasr et al. 2021.) "Positive" = the attack says *member*. An (ε, δ)-DP
    mechanism has TPR ≤ e^ε FPR + δ and TNR ≤ e^ε FNR + δ, hence
    ε ≥ max(log((TPR_lo − δ) / FPR_hi), log((TNR_lo − δ) / FNR_hi)), floored at 0, with
    one-sided Clopper–Pearson bounds at alpha/2 each: with probability at least 1 − alpha the
    value does not exceed the true ε.

    Args:
        true_positives, false_negatives: members flagged / missed (need a member, ≥ 1 in total).
        false_positives, true_negatives: non-members flagged / passed (≥ 1 in total).
        delta: δ in [0, 1).
        alpha: total failure probability in (0, 1).

    Returns:
        ε lower bound ≥ 0.

    Raises:
        ValueError: a count negative or non-integer, no members or no non-members, delta or alpha
            out of range.

    Examples:
        >>> from privmon import epsilon_from_counts
        >>> eps = epsilon_from_counts(
        ...     true_positives=90, false_negatives=10, false_positives=10, true_negatives=90
        ... )
        >>> round(eps, 3)
        1.542
    """
    tp = check_count(true_positives, name="true_positives")
    fn = check_count(false_negatives, name="false_negatives")
    fp = check_count(false_positives, name="false_positives")
    tn = check_count(true_negatives, name="true_negatives")
    if tp + fn == 0:
        raise ValueError("true_positives + false_negatives must be >= 1 (at least one member)")
    if fp + tn == 0:
        raise ValueError("false_positives + true_negatives must be >= 1 (at least one non-member)")
    d = check_half_open_interval(delta, name="delta", low=0, high=1)
    a = check_open_unit(alpha, name="alpha")
    arr = _epsilon_from_count_arrays(
        np.asarray(tp), np.asarray(fn), np.asarray(fp), np.asarray(tn), delta=d, alpha=a
    )
    return float(arr)


def _scores_1d(scores: Any, name: str) -> NDArray[np.float64]:
    t, _ = as_scores(scores, name=name)
    if t.shape[1] != 1:
        raise ValueError(f"{name} must be one score per record, shape (n,) or (n, 1); got (n, d>1)")
    return np.sort(to_numpy(t[:, 0]))


def epsilon_audit(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    delta: float = 0.0,
    alpha: float = 0.05,
    max_thresholds: int = 100,
) -> dict[str, float]:
    r"""Certified ε lower bound from member / non-member attack scores (threshold audit).

    Higher scores mean "more likely a member" (negate losses first). Each threshold t, up to
    ``max_thresholds`` distinct pooled-score quantiles, gives the attack "member iff score ≥ t"
    and its ε bound (:func:`epsilon_from_counts`, at alpha / the number of thresholds tried:
    Bonferroni); the best bound is returned, and it exceeds the true ε with probability at most
    alpha. The counts of all thresholds come from one sort.

    Args:
        member_scores: scores of members, shape (n1,) or (n1, 1); numpy or torch (NaN/inf dropped).
        nonmember_scores: scores of non-members, shape (n0,) or (n0, 1).
        delta: δ in [0, 1).
        alpha: total failure probability in (0, 1).
        max_thresholds: number of thresholds to try, ≥ 1.

    Returns:
        ``{"epsilon": ε lower bound, "threshold": t, "tpr": empirical TPR at t,
        "fpr": empirical FPR at t}`` (all floats) for the best threshold.

    Raises:
        ValueError: empty or multi-dimensional scores, delta / alpha / max_thresholds out of range.

    Examples:
        >>> import torch
        >>> from privmon import epsilon_audit
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(1000, generator=gen) + 2.0
        >>> audit = epsilon_audit(members, torch.randn(1000, generator=gen))
        >>> {key: round(value, 3) for key, value in audit.items()}
        {'epsilon': 2.946, 'threshold': 2.849, 'tpr': 0.199, 'fpr': 0.0}
    """
    d = check_half_open_interval(delta, name="delta", low=0, high=1)
    a = check_open_unit(alpha, name="alpha")
    if isinstance(max_thresholds, bool) or not isinstance(max_thresholds, (int, np.integer)):
        raise ValueError(f"max_thresholds must be an integer >= 1, got {max_thresholds!r}")
    if max_thresholds < 1:
        raise ValueError(f"max_thresholds must be an integer >= 1, got {max_thresholds!r}")
    mem = _scores_1d(member_scores, "member_scores")
    non = _scores_1d(nonmember_scores, "nonmember_scores")
    n1, n0 = mem.size, non.size

    pooled = np.sort(np.concatenate([mem, non]))
    k = int(max_thresholds)
    pos = np.floor(np.arange(1, k + 1) / (k + 1) * pooled.size).astype(np.int64)
    thresholds = np.unique(pooled[np.clip(pos, 0, pooled.size - 1)])
    m = thresholds.size

    tp = n1 - np.searchsorted(mem, thresholds, side="left")
    fp = n0 - np.searchsorted(non, thresholds, side="left")
    eps = _epsilon_from_count_arrays(tp, n1 - tp, fp, n0 - fp, delta=d, alpha=a / m)
    best = int(np.argmax(eps))
    return {
        "epsilon": float(eps[best]),
        "threshold": float(thresholds[best]),
        "tpr": float(tp[best] / n1),
        "fpr": float(fp[best] / n0),
    }


# --------------------------------------------------------------------------------------------------
# opacus


def epsilon_from_opacus(source: Any, *, delta: float) -> float:
    """ε spent so far according to an Opacus ``PrivacyEngine`` or accountant.

    ``source`` is anything with ``get_epsilon(delta)`` (``PrivacyEngine``, ``RDPAccountant``,
    ``PRVAccountant``, ``GaussianAccountant``, …) or with an ``.accountant`` that has it. Feed the
    result to :func:`tanh_bound` (with the same δ) for the advantage ceiling of eq. (14).

    Args:
        source: an Opacus ``PrivacyEngine`` or accountant.
        delta: target δ in (0, 1) (accountants need δ > 0).

    Returns:
        ε ≥ 0 as a Python float (0.0 before any step).

    Raises:
        TypeError: ``source`` has neither ``get_epsilon`` nor an ``accountant`` with one.
        ValueError: delta outside (0, 1), or the accountant returned a negative / NaN ε.

    Examples:
        >>> from opacus.accountants import RDPAccountant
        >>> from privmon import epsilon_from_opacus, tanh_bound
        >>> accountant = RDPAccountant()
        >>> for _ in range(100):  # 100 steps of DP-SGD
        ...     accountant.step(noise_multiplier=1.0, sample_rate=0.01)
        >>> eps = epsilon_from_opacus(accountant, delta=1e-5)
        >>> round(eps, 3), round(tanh_bound(eps, delta=1e-5), 3)
        (1.214, 0.542)
    """
    d = check_open_unit(delta, name="delta")
    getter = getattr(source, "get_epsilon", None)
    if not callable(getter):
        getter = getattr(getattr(source, "accountant", None), "get_epsilon", None)
    if not callable(getter):
        raise TypeError(
            "source must be an opacus PrivacyEngine or accountant (an object with "
            f"get_epsilon(delta) or an .accountant that has it), got {type(source).__name__}"
        )
    # No step accounted yet: nothing is spent. (Opacus' PRV accountant, the PrivacyEngine default,
    # raises on an empty history instead of returning 0.)
    accountant = getattr(source, "accountant", None)
    if accountant is None:
        accountant = source
    history = getattr(accountant, "history", None)
    if isinstance(history, list) and not history:
        return 0.0
    value = getter(d)
    if isinstance(value, (tuple, list)):  # some accountants return (eps, best_alpha)
        value = value[0]
    try:
        eps = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"accountant returned a non-numeric epsilon: {value!r}") from None
    if math.isnan(eps) or eps < 0:
        raise ValueError(f"accountant returned an invalid epsilon {eps!r} (must be >= 0)")
    return eps
