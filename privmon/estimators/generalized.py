"""Membership advantage under generalized metrics (MACE §2.6, §3.2-3.3, §4.2, §6, App. B, D):
:func:`generalized_advantage` implements Algorithm 2 for a
:class:`~privmon.estimators.generalized_metric.GeneralizedMetric`, with the posterior of
:func:`~privmon.estimators.risk.individual_risk` (one estimator for η, f_p and Song & Mittal's risk
score), Lemma 7's per-record intervals combined as in App. D
(:mod:`~privmon.estimators.lemma7`), and a certified lower bound (Theory, *Generalized metrics*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from privmon._validation import as_scores, check_open_unit
from privmon.estimators.density import bandwidth_factor
from privmon.estimators.estimates import Estimate
from privmon.estimators.generalized_metric import METRIC_TOL, GeneralizedMetric, resolve_metric
from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper
from privmon.estimators.lemma7 import lemma7_bounds, record_terms
from privmon.estimators.methods import Method, check_method
from privmon.estimators.risk import individual_risk

__all__ = ["GeneralizedEstimate", "generalized_advantage"]


@dataclass(frozen=True)
class GeneralizedEstimate(Estimate):
    """Optimal membership advantage under a generalized metric (MACE Def. 3, Algorithm 2).

    ``value``: ℓ of the learned Bayes rule sgn(η̂ − t) measured on the held-out part 3 (from its
    empirical TPR / FPR at the experiment's prior). ``lower``: see :func:`generalized_advantage`
    (the certified bound when it is finite). ``upper``: Lemma 7 + App. D (not certified).
    ``plugin``: ℓ of the rule computed from η̂ alone (no labels of part 3).
    ``certified_lower``: Clopper–Pearson bound on the learned rule's ℓ (level 1 − delta).
    ``lemma7_lower`` / ``lemma7_upper``: MACE Lemma 7 per record, combined over part 3 (App. D).
    ``threshold``: t used. ``metric``: the metric's name.

    Examples:
        >>> import torch
        >>> from privmon import generalized_advantage
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> est = generalized_advantage(members, torch.randn(500, generator=gen), metric="ppv")
        >>> est.metric, round(est.value, 3), round(est.certified_lower, 3)
        ('PPV', 0.571, 0.357)
        >>> est.lower <= est.value <= est.upper
        True
    """

    value: float
    lower: float
    upper: float
    plugin: float
    certified_lower: float
    lemma7_lower: float
    lemma7_upper: float
    threshold: float
    metric: str
    prior: float
    method: str
    delta: float
    n_members: int
    n_nonmembers: int
    n_dropped: int


def _population_form(metric: GeneralizedMetric, prior: float) -> GeneralizedMetric:
    """A linear metric with its constant denominator D = b0 + b11·p + b10·(1−p) moved into b0.

    Equal to ``metric`` on every confusion at prior p (TP + FN = p, FP + TN = 1 − p), and the form
    in which the average of per-record risks (Def. 4, App. D) is the metric itself: each record's
    denominator is then D, not b0 + b11·η + b10·(1−η) (which would make TPR average to P(Ŷ=1)).
    """
    if not metric.is_linear:
        return metric
    return replace(metric, b0=metric.denominator_at(prior), b11=0.0, b10=0.0, b01=0.0, b00=0.0)


def _split(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A seeded random split of range(n) into three parts (sizes n − 2⌊n/3⌋, ⌊n/3⌋, ⌊n/3⌋)."""
    perm = torch.randperm(n, generator=gen)
    k = n // 3
    return perm[: n - 2 * k], perm[n - 2 * k : n - k], perm[n - k :]


def _rates(eta: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """#{η ≥ t} for every threshold (vectorized by a sorted search)."""
    s = np.sort(eta)
    return len(s) - np.searchsorted(s, thresholds, side="left")


def _confusion(prior: float, tpr, fpr):
    """Joint confusion probabilities at the experiment's prior: TP, FP, FN, TN."""
    return prior * tpr, (1 - prior) * fpr, prior * (1 - tpr), (1 - prior) * (1 - fpr)


def _search_threshold(
    metric: GeneralizedMetric, prior: float, eta_m: np.ndarray, eta_h: np.ndarray
):
    """Algorithm 2 step 3: argmax over t of the empirical ℓ of "member when η̂ ≥ t" on part 2.

    Candidates: 0 (all member), the midpoints between consecutive distinct η̂, and 1; ties on
    the maximum are broken by the middle candidate. Vectorized over candidates.
    """
    u = np.unique(np.concatenate([eta_m, eta_h]))
    cand = np.unique(np.concatenate([[0.0], (u[:-1] + u[1:]) / 2, [1.0]]))
    tpr = _rates(eta_m, cand) / len(eta_m)
    fpr = _rates(eta_h, cand) / len(eta_h)
    vals = np.asarray(metric.value(*_confusion(prior, tpr, fpr)))
    if not np.isfinite(vals).any():
        raise ValueError(f"metric {metric.name} is undefined (0/0) at every threshold")
    best = np.flatnonzero(vals >= np.nanmax(vals) - METRIC_TOL)
    return float(cand[best[len(best) // 2]])


def _num_den(metric: GeneralizedMetric, tp, fp, fn, tn):
    num = metric.a0 + metric.a11 * tp + metric.a10 * fp + metric.a01 * fn + metric.a00 * tn
    den = metric.b0 + metric.b11 * tp + metric.b10 * fp + metric.b01 * fn + metric.b00 * tn
    return num, den


def _ratio_min(num: np.ndarray, den: np.ndarray) -> float:
    """min of num/den over points where ℓ is defined; −inf if it is unbounded below."""
    if (den > 0).any() and (den < 0).any():
        return -math.inf  # the denominator vanishes inside: ℓ is unbounded
    side = 1.0 if (den >= 0).all() else -1.0  # the sign of den next to its zeros
    with np.errstate(divide="ignore", invalid="ignore"):
        vals = np.where(
            den != 0, num / den, np.where(num == 0, np.nan, side * np.sign(num) * np.inf)
        )
    vals = vals[~np.isnan(vals)]
    return float(vals.min()) if vals.size else math.nan


def _metric_range(metric: GeneralizedMetric, prior: float) -> tuple[float, float]:
    """The least and greatest ℓ of any rule at prior p: ℓ over the corners of (TPR, FPR) ∈ [0, 1]²
    (quasi-linearity, see :func:`_certified_lower`). Lemma-7 figures are clipped to it."""
    tt, ff = np.meshgrid([0.0, 1.0], [0.0, 1.0])
    num, den = _num_den(metric, *_confusion(prior, tt.ravel(), ff.ravel()))
    return _ratio_min(num, den), -_ratio_min(-num, den)


def _certified_lower(
    metric: GeneralizedMetric, prior: float, k1, n1, k2, n2, delta: float
) -> float:
    """Level 1 − δ lower bound on ℓ of a fixed rule from its part-3 hits (exact binomial).

    ℓ(TPR, FPR) at prior p is linear-fractional in (TPR, FPR), hence quasi-linear: over a box its
    extremes sit at the corners (where the denominator keeps its sign). Linear metrics: ℓ is
    affine, so one-sided Clopper–Pearson bounds at δ/2 on TPR and on FPR (on the side that lowers
    ℓ) suffice. Other metrics: two-sided boxes at δ/2 each (δ/4 per tail) and the least corner.
    0/0 corners (e.g. PPV at TPR = FPR = 0) are skipped: ℓ is constant along the edges there.
    """
    if metric.is_linear:
        c1 = metric.a11 - metric.a01  # sign of ∂ℓ/∂TPR (denominator > 0, checked by the caller)
        c2 = metric.a10 - metric.a00  # sign of ∂ℓ/∂FPR
        a = delta / 2
        tpr = clopper_pearson_lower(k1, n1, a) if c1 >= 0 else clopper_pearson_upper(k1, n1, a)
        fpr = clopper_pearson_upper(k2, n2, a) if c2 < 0 else clopper_pearson_lower(k2, n2, a)
        return float(metric.value(*_confusion(prior, float(tpr), float(fpr))))
    a = delta / 4
    tpr = np.array([clopper_pearson_lower(k1, n1, a), clopper_pearson_upper(k1, n1, a)], float)
    fpr = np.array([clopper_pearson_lower(k2, n2, a), clopper_pearson_upper(k2, n2, a)], float)
    tt, ff = np.meshgrid(tpr, fpr)
    return _ratio_min(*_num_den(metric, *_confusion(prior, tt.ravel(), ff.ravel())))


# -- the estimator -----------------------------------------------------------------------------
def _check_options(*, bins: int | None, seed: int, bandwidth: str | float) -> None:
    """:func:`generalized_advantage`'s estimator options, checked."""
    if bins is not None and (isinstance(bins, bool) or not isinstance(bins, int) or bins < 1):
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    bandwidth_factor(bandwidth, n=2, d=1)


def generalized_advantage(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    metric: GeneralizedMetric | str,
    prior: float = 0.5,
    method: Method = "histogram",
    delta: float = 0.05,
    bins: int | None = None,
    bandwidth: str | float = "scott",
    seed: int = 0,
) -> GeneralizedEstimate:
    """Optimal membership advantage under a generalized metric ℓ (MACE Def. 3, eq. 9; Algorithm 2).

    Members and non-members are each split at random into three parts: the posterior
    η = (1 + f_p)/2 of :func:`~privmon.estimators.risk.individual_risk` is fitted on part 1, the
    threshold of the rule "member when η̂ ≥ t" is the metric's Bayes threshold when it has a
    closed form (:meth:`GeneralizedMetric.bayes_threshold`; η then fitted on parts 1 + 2), else
    the one maximising ℓ on part 2, and ``value`` is ℓ of that rule on part 3 at the experiment's
    prior (NaN where ℓ is 0/0). ``lower`` is the certified lower bound (Clopper–Pearson bounds on
    the rule's TPR and FPR on part 3: level 1 − δ), falling back to MACE Lemma 7's bound where
    that is not finite; ``upper`` is Lemma 7 + App. D, not certified. Both contain ``value``.
    Algorithm and intervals: Theory, *Generalized metrics*.

    Args:
        member_scores, nonmember_scores: query outputs, numpy or torch on any device, (n,) or
            (n, d); NaN / inf rows are dropped and counted. Each class needs >= 6 finite rows.
        metric: a :class:`GeneralizedMetric` or a preset name ("acc", "ppv", "tpr", "tnr", "am",
            "wa", "f1"); "am" is built at ``prior``.
        prior: P(member) in the experiment, in (0, 1).
        method: "histogram" or "kde", the estimator of P, Q and η (as in ``individual_risk``).
        delta: 1 − confidence level, in (0, 1).
        bins: histogram cells per dimension (default 100). bandwidth: KDE factor (scipy rule).
        seed: seed of the split.

    Returns:
        :class:`GeneralizedEstimate`.

    Examples:
        >>> import torch
        >>> from privmon import generalized_advantage
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> est = generalized_advantage(members, torch.randn(500, generator=gen), metric="am")
        >>> est.metric, round(est.value, 3), round(est.lower, 3), est.threshold
        ('AM(p=0.5)', 0.611, 0.533, 0.5)
    """
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    metric = resolve_metric(metric, prior)
    check_method(method)
    _check_options(bins=bins, seed=seed, bandwidth=bandwidth)
    if metric.is_linear and not metric.denominator_at(prior) > 0:
        raise ValueError(
            f"metric {metric.name} has denominator b0 + b11·p + b10·(1−p) = "
            f"{metric.denominator_at(prior):g} <= 0 at prior={prior:g}"
        )
    m, dm, h, dh = _class_scores(member_scores, nonmember_scores)
    known = metric.has_closed_form_threshold
    sizes, eta, eta_lo, eta_hi = _posteriors(
        m, h, known=known, seed=seed, prior=prior, method=method, delta=delta, bins=bins,
        bandwidth=bandwidth,
    )  # fmt: skip
    t = metric.bayes_threshold() if known else _search_threshold(metric, prior, eta[0], eta[1])

    n1, n2 = sizes[2], sizes[3]
    k1, k2 = int((eta[2] >= t).sum()), int((eta[3] >= t).sum())
    value = float(metric.value(*_confusion(prior, k1 / n1, k2 / n2)))
    certified = _certified_lower(metric, prior, k1, n1, k2, n2, delta)

    lo7, hi7, plugin = _lemma7_figures(metric, prior, t, eta, eta_lo, eta_hi)

    lower = certified if math.isfinite(certified) else lo7
    upper = hi7
    if math.isfinite(value):
        lower = min(lower, value) if not math.isnan(lower) else lower
        upper = max(upper, value) if not math.isnan(upper) else upper
    return GeneralizedEstimate(
        value=value,
        lower=float(lower),
        upper=float(upper),
        plugin=plugin,
        certified_lower=float(certified),
        lemma7_lower=float(lo7),
        lemma7_upper=float(hi7),
        threshold=float(t),
        metric=metric.name,
        prior=prior,
        method=method,
        delta=delta,
        n_members=int(m.shape[0]),
        n_nonmembers=int(h.shape[0]),
        n_dropped=dm + dh,
    )


def _class_scores(member_scores, nonmember_scores):
    """The member / non-member scores (finite rows) and the rows dropped, at least 6 each."""
    m, dm = as_scores(member_scores, name="member_scores")
    h, dh = as_scores(nonmember_scores, name="nonmember_scores", device=m.device)
    if m.shape[1] != h.shape[1]:
        raise ValueError(
            f"member_scores and nonmember_scores must have the same dimension d, got "
            f"{m.shape[1]} and {h.shape[1]}"
        )
    for t_, name in ((m, "member_scores"), (h, "nonmember_scores")):
        if t_.shape[0] < 6:
            raise ValueError(f"{name} needs at least 6 finite scores (3 parts), got {t_.shape[0]}")
    return m, dm, h, dh


def _posteriors(m, h, *, known: bool, seed, prior, method, delta, bins, bandwidth):
    """η of the tuning and evaluation parts (sizes, the four parts' η, the evaluation parts'
    η bounds), fitted on part 1 (parts 1 + 2 when the threshold is ``known``)."""
    gen = torch.Generator().manual_seed(seed)
    parts_m = [i.to(m.device) for i in _split(m.shape[0], gen)]
    parts_h = [i.to(m.device) for i in _split(h.shape[0], gen)]
    if known:  # no threshold to fit: parts 1 + 2 both estimate η
        fit_m, fit_h = torch.cat(parts_m[:2]), torch.cat(parts_h[:2])
        tune_m = tune_h = parts_m[2][:0]
    else:
        fit_m, fit_h = parts_m[0], parts_h[0]
        tune_m, tune_h = parts_m[1], parts_h[1]
    eval_m, eval_h = parts_m[2], parts_h[2]
    sizes = [len(tune_m), len(tune_h), len(eval_m), len(eval_h)]
    queries = torch.cat([m[tune_m], h[tune_h], m[eval_m], h[eval_h]])
    risk = individual_risk(
        queries, m[fit_m], h[fit_h], prior=prior, method=method, delta=delta, bins=bins,
        bandwidth=bandwidth,
    )  # fmt: skip
    eta = np.split(risk.posterior, np.cumsum(sizes)[:-1])
    if risk.signed_lower is None or risk.signed_upper is None:  # individual_risk sets both
        raise RuntimeError("individual_risk returned no signed interval")
    eta_lo = (1 + risk.signed_lower[-(sizes[2] + sizes[3]) :]) / 2
    eta_hi = (1 + risk.signed_upper[-(sizes[2] + sizes[3]) :]) / 2
    return sizes, eta, eta_lo, eta_hi


def _lemma7_figures(metric: GeneralizedMetric, prior: float, t, eta, eta_lo, eta_hi):
    """Lemma 7's bounds and the plug-in of the rule η ≥ ``t`` on the evaluation parts, each
    clipped to the metric's range."""
    n1, n2 = len(eta[2]), len(eta[3])
    pop = _population_form(metric, prior)
    w = np.concatenate([np.full(n1, prior / n1), np.full(n2, (1 - prior) / n2)])
    lo7, hi7 = lemma7_bounds(pop, t, eta_lo, eta_hi, w)
    eta3 = np.concatenate([eta[2], eta[3]])
    num, den = record_terms(pop, eta3, eta3 >= t)
    sd = float(w @ den)
    plugin = float(w @ num) / sd if sd != 0 else math.nan
    lo_range, hi_range = _metric_range(metric, prior)
    return tuple(float(np.clip(v, lo_range, hi_range)) for v in (lo7, hi7, plugin))
