"""Membership advantage under generalized metrics (MACE §2.6, §3.2-3.3, §4.2, §6, App. B, D).

A generalized metric (MACE eq. 4, after Koyejo et al. 2014, MACE ref. [20]) is a ratio of linear
forms in the joint confusion probabilities

    ℓ = (a0 + a11·TP + a10·FP + a01·FN + a00·TN) / (b0 + b11·TP + b10·FP + b01·FN + b00·TN),

TP = P(m=1, Ŷ=1), FP = P(m=0, Ŷ=1), FN = P(m=1, Ŷ=0), TN = P(m=0, Ŷ=0) in the membership
experiment at prior p (so TP + FN = p and FP + TN = 1 − p). The optimal adversary is a threshold on
the posterior η(q) = P(m=1 | q) = p·P(q) / (p·P(q) + (1−p)·Q(q)) = (1 + f_p(q)) / 2 (eq. 5): predict
"member" when η ≥ t_ℓ. For *linear* metrics (b11 = b01 and b10 = b00: the denominator is the
constant b0 + b11·p + b10·(1−p)) Theorem 1 gives t_ℓ in closed form; otherwise t_ℓ depends on the
optimal value ℓ* and is fitted on data (Algorithm 2, step 3).

:func:`generalized_advantage` implements Algorithm 2 with the posterior of
:func:`~privmon.estimators.risk.individual_risk` (one estimator for η, f_p and Song & Mittal's risk
score), Lemma 7's per-record intervals combined as in App. D, and a certified lower bound.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from privmon._validation import as_scores, check_open_unit
from privmon.estimators.density import bandwidth_factor
from privmon.estimators.estimates import Estimate
from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper
from privmon.estimators.methods import Method, check_method
from privmon.estimators.risk import individual_risk

__all__ = [
    "ACC",
    "F1",
    "PPV",
    "TNR",
    "TPR",
    "WA",
    "GeneralizedEstimate",
    "GeneralizedMetric",
    "generalized_advantage",
]

_COEFFS = ("a0", "a11", "a10", "a01", "a00", "b0", "b11", "b10", "b01", "b00")
_PRESETS = ("acc", "ppv", "precision", "tpr", "recall", "tnr", "am", "wa", "f1")
_TOL = 1e-12


@dataclass(frozen=True, kw_only=True)
class GeneralizedMetric:
    """The coefficients of a generalized metric ℓ (MACE eq. 4; all default 0): a record that
    :func:`generalized_advantage` reads, not a stateful metric object (privmon has no
    ``update`` / ``compute`` metrics). Formerly ``privmon.Metric`` (a deprecated alias).

    ``name`` labels the metric in estimates. ``prior`` is set only for metrics whose coefficients
    were built for one prior (AM, :meth:`am`); :func:`generalized_advantage` refuses to use such a
    metric at another prior.

    Presets (MACE App. B, §3.3): :data:`ACC`, :data:`PPV`, :data:`TPR`, :data:`TNR`, :data:`F1`,
    :data:`WA` (weights 2, 2, 1, 1), ``GeneralizedMetric.am(prior)``,
    ``GeneralizedMetric.wa(w1, w2, w3, w4)``, or by name with :meth:`preset`.
    """

    a0: float = 0.0
    a11: float = 0.0
    a10: float = 0.0
    a01: float = 0.0
    a00: float = 0.0
    b0: float = 0.0
    b11: float = 0.0
    b10: float = 0.0
    b01: float = 0.0
    b00: float = 0.0
    name: str = "custom"
    prior: float | None = field(default=None)

    def __post_init__(self) -> None:
        for key in _COEFFS:
            raw = getattr(self, key)
            try:
                v = float(raw)
            except (TypeError, ValueError):
                raise ValueError(
                    f"metric coefficient {key} must be a finite number, got {raw!r}"
                ) from None
            if not math.isfinite(v):
                raise ValueError(f"metric coefficient {key} must be a finite number, got {raw!r}")
            object.__setattr__(self, key, v)
        if self.prior is not None:
            object.__setattr__(self, "prior", check_open_unit(self.prior, name="prior"))

    # -- evaluation ---------------------------------------------------------------------------
    def value(self, tp: Any, fp: Any, fn: Any, tn: Any) -> float | np.ndarray:
        """ℓ(TP, FP, FN, TN) of MACE eq. 4, vectorized (numpy broadcasting).

        The arguments are joint probabilities (they sum to 1). Where the denominator is 0 the
        metric is undefined and NaN is returned (e.g. PPV of a rule that never predicts member).
        """
        tp, fp, fn, tn = (np.asarray(v, dtype=np.float64) for v in (tp, fp, fn, tn))
        num = self.a0 + self.a11 * tp + self.a10 * fp + self.a01 * fn + self.a00 * tn
        den = self.b0 + self.b11 * tp + self.b10 * fp + self.b01 * fn + self.b00 * tn
        out = np.where(den != 0, num / np.where(den != 0, den, 1.0), np.nan)
        return float(out) if out.ndim == 0 else out

    @property
    def is_linear(self) -> bool:
        """b11 == b01 and b10 == b00 (MACE Thm 1): the denominator is a constant at any prior."""
        return self.b11 == self.b01 and self.b10 == self.b00

    def denominator_at(self, prior: float) -> float:
        """b0 + b11·p + b10·(1−p): the (constant) denominator of a linear metric at prior p."""
        if not self.is_linear:
            raise ValueError(f"metric {self.name} is not linear (Thm 1): its denominator varies")
        return self.b0 + self.b11 * prior + self.b10 * (1 - prior)

    def _threshold_terms(self) -> tuple[float, float, float, float]:
        # t(ℓ*) = (α0 + α1·ℓ*) / (γ0 + γ1·ℓ*): Thm 1 applied to the coefficients a − ℓ*·b.
        alpha0 = self.a00 - self.a10
        alpha1 = self.b10 - self.b00
        gamma0 = self.a11 - self.a10 - self.a01 + self.a00
        gamma1 = -(self.b11 - self.b10 - self.b01 + self.b00)
        return alpha0, alpha1, gamma0, gamma1

    @property
    def has_closed_form_threshold(self) -> bool:
        """True when the Bayes threshold does not depend on the optimal value ℓ*.

        Always for linear metrics (Thm 1); also for some others, e.g. WA with w1·w3 = w2·w4 (the
        paper's WA(2, 2, 1, 1) has t = 1/2, §3.3).
        """
        a0_, a1_, g0, g1 = self._threshold_terms()
        scale = max(1.0, abs(a0_), abs(a1_), abs(g0), abs(g1)) ** 2
        return self.is_linear or abs(a0_ * g1 - a1_ * g0) <= _TOL * scale

    def bayes_threshold(self, optimum: float | None = None) -> float:
        """The Bayes-optimal threshold t_ℓ on η = P(m=1 | q): predict member when η ≥ t_ℓ (eq. 5).

        Linear metrics: Thm 1, t = (a00 − a10) / (a11 − a10 − a01 + a00) (ACC 1/2, TPR 0, TNR 1,
        AM at prior p: p). Any metric: at the optimum ℓ*, ℓ ≤ ℓ* for every rule, i.e. the optimal
        rule maximizes the linear metric num − ℓ*·den (den > 0), so t = Thm 1 applied to the
        coefficients a − ℓ*·b (Koyejo et al. 2014, MACE ref. [20]; PPV: t = ℓ*, F1: t = ℓ*/2). When
        that does not depend on ℓ* (:attr:`has_closed_form_threshold`, e.g. WA(2, 2, 1, 1):
        t = 1/2) ``optimum`` is not needed; otherwise pass the optimal value as ``optimum``.

        Raises ValueError if the rule is not "η ≥ t" (the metric rewards wrong guesses).
        """
        alpha0, alpha1, gamma0, gamma1 = self._threshold_terms()
        if optimum is None:
            if not self.has_closed_form_threshold:
                raise ValueError(
                    f"metric {self.name}: the Bayes threshold depends on the optimal value ℓ*; "
                    "pass optimum=ℓ* (generalized_advantage fits it on data instead)"
                )
            num, den = (alpha0, gamma0) if gamma0 != 0 else (alpha1, gamma1)
        else:
            opt = float(optimum)
            if not math.isfinite(opt):
                raise ValueError(f"optimum must be a finite number, got {optimum!r}")
            num, den = alpha0 + alpha1 * opt, gamma0 + gamma1 * opt
        if not den > 0:
            raise ValueError(
                f"metric {self.name}: a11 − a10 − a01 + a00 (after subtracting ℓ*·b) must be > 0 "
                "for the optimal rule to be 'member when η ≥ t'; this metric rewards wrong guesses"
            )
        return num / den

    # -- presets (MACE App. B, §3.3) ------------------------------------------------------------
    @classmethod
    def am(cls, prior: float) -> GeneralizedMetric:
        """AM = (TPR + TNR)/2 = TP/(2p) + TN/(2(1−p)) at prior p: linear, Thm 1 threshold t = p.

        TPR = TP/p depends on the prior, so AM is a metric of eq. 4 only once p is fixed.
        """
        p = check_open_unit(prior, name="prior")
        return cls(a11=1 / (2 * p), a00=1 / (2 * (1 - p)), b0=1.0, name=f"AM(p={p:g})", prior=p)

    @classmethod
    def wa(
        cls, w1: float = 2.0, w2: float = 2.0, w3: float = 1.0, w4: float = 1.0
    ) -> GeneralizedMetric:
        """Weighted accuracy (w1·TP + w2·TN) / (w1·TP + w2·TN + w3·FP + w4·FN) (MACE App. B).

        Not linear in Thm 1's sense; its threshold is ℓ*-free (t = w2/(w1 + w2)) when
        w1·w3 = w2·w4, e.g. the default 2, 2, 1, 1 (t = 1/2, §3.3).
        """
        for k, w in (("w1", w1), ("w2", w2), ("w3", w3), ("w4", w4)):
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ValueError(f"{k} must be a finite number >= 0, got {w!r}")
        name = "WA" if (w1, w2, w3, w4) == (2, 2, 1, 1) else f"WA({w1:g},{w2:g},{w3:g},{w4:g})"
        return cls(a11=w1, a00=w2, b11=w1, b00=w2, b10=w3, b01=w4, name=name)

    @classmethod
    def preset(cls, name: str, *, prior: float | None = None) -> GeneralizedMetric:
        """A preset by name: acc, ppv (precision), tpr (recall), tnr, am (needs prior), wa, f1."""
        key = name.lower() if isinstance(name, str) else None
        if key not in _PRESETS:
            raise ValueError(
                f"metric must be a GeneralizedMetric or one of {_PRESETS}, got {name!r}"
            )
        if key == "am":
            if prior is None:
                raise ValueError("metric 'am' depends on the prior: pass prior=p")
            return cls.am(prior)
        return {
            "acc": ACC,
            "ppv": PPV,
            "precision": PPV,
            "tpr": TPR,
            "recall": TPR,
            "tnr": TNR,
            "wa": WA,
            "f1": F1,
        }[key]


ACC = GeneralizedMetric(a11=1, a00=1, b11=1, b10=1, b01=1, b00=1, name="ACC")
"""Accuracy (TP + TN)/(TP + FP + FN + TN); Thm 1 threshold 1/2; equals (1 + Adv_p)/2 (eq. 2)."""
PPV = GeneralizedMetric(a11=1, b11=1, b10=1, name="PPV")
"""Positive predictive value (precision) TP/(TP + FP); not linear (t = ℓ*)."""
TPR = GeneralizedMetric(a11=1, b11=1, b01=1, name="TPR")
"""Recall TP/(TP + FN) = TP/p; linear, Thm 1 threshold 0 (always say member)."""
TNR = GeneralizedMetric(a00=1, b10=1, b00=1, name="TNR")
"""Specificity TN/(FP + TN); linear, Thm 1 threshold 1."""
F1 = GeneralizedMetric(a11=2, b11=2, b10=1, b01=1, name="F1")
"""F1 = 2TP/(2TP + FP + FN); not linear (t = ℓ*/2)."""
WA = GeneralizedMetric.wa()
"""Weighted accuracy (2TP + 2TN)/(2TP + 2TN + FP + FN) (MACE §3.3); threshold 1/2."""


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


# -- helpers -----------------------------------------------------------------------------------
def _resolve_metric(metric: Any, prior: float) -> GeneralizedMetric:
    if isinstance(metric, str):
        return GeneralizedMetric.preset(metric, prior=prior)
    if not isinstance(metric, GeneralizedMetric):
        raise ValueError(f"metric must be a GeneralizedMetric or one of {_PRESETS}, got {metric!r}")
    if metric.prior is not None and abs(metric.prior - prior) > 1e-12:
        raise ValueError(
            f"metric {metric.name} was built for prior={metric.prior:g} but prior={prior:g}: "
            f"build it at this prior (GeneralizedMetric.am({prior:g}) or metric='am')"
        )
    return metric


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
    best = np.flatnonzero(vals >= np.nanmax(vals) - _TOL)
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


def _local(metric: GeneralizedMetric, eta: np.ndarray, member: np.ndarray):
    """Lemma 7's numerator and denominator divided by x·p + y·(1−p): functions of η only.

    n(η) = a0 + I·(a11·η + a10·(1−η)) + (1−I)·(a01·η + a00·(1−η)), d likewise with b.
    """
    i = member.astype(np.float64)
    n = metric.a0 + i * (metric.a11 * eta + metric.a10 * (1 - eta))
    n = n + (1 - i) * (metric.a01 * eta + metric.a00 * (1 - eta))
    d = metric.b0 + i * (metric.b11 * eta + metric.b10 * (1 - eta))
    d = d + (1 - i) * (metric.b01 * eta + metric.b00 * (1 - eta))
    return n, d


def _lemma7_candidates(metric: GeneralizedMetric, t: float, eta_lo: np.ndarray, eta_hi: np.ndarray):
    """Per record (rows), the 4 points where Lemma 7's objective can reach its extremes.

    Lemma 7's objective is homogeneous of degree 0 in (x, y), so it depends on the box only through
    η = x·p/(x·p + y·(1−p)), which is increasing in x and decreasing in y: over the box η sweeps
    exactly [η(x_lo, y_hi), η(x_hi, y_lo)] = [(1 + f_lo)/2, (1 + f_hi)/2] (Lemma 5 / 6's corners).
    The indicator I = 1{x ≥ (1−p)t/((1−t)p)·y} is 1{η ≥ t}: the switching line is η = t. On each
    side of it n(η)/d(η) is a linear-fractional function of η, hence monotone, so its extremes
    are at the ends of the pieces: η_lo, η_hi and t approached from each side (t with I = 0 is a
    limit, a supremum / infimum, which is what a bound needs).
    """
    below = eta_lo < t  # the I = 0 piece [η_lo, min(η_hi, t))
    above = eta_hi >= t  # the I = 1 piece [max(η_lo, t), η_hi]
    eta = np.stack([eta_lo, np.minimum(eta_hi, t), np.maximum(eta_lo, t), eta_hi], axis=1)
    ind = np.broadcast_to(np.array([False, False, True, True]), eta.shape)
    valid = np.stack([below, below, above, above], axis=1)
    n, d = _local(metric, eta, ind)
    return n, d, valid


def _ratio_of_sums_max(n, d, valid, w) -> float:
    """max over per-record choices c_i of Σ w_i·n_ic / Σ w_i·d_ic, by Dinkelbach's iteration.

    F(λ) = max_choice Σ w·(n − λ·d) is separable over records (one vectorized argmax per step);
    from a feasible λ, λ ← N/D of the maximizing choice increases until F(λ) = 0, where λ is the
    maximal ratio (finite and superlinear: a handful of steps). Requires d >= 0, and n = 0 where
    d = 0 (such options drop out: PPV where the rule says non-member); NaN otherwise.
    """
    if (valid & ((d < 0) | ((d == 0) & (n != 0)))).any():
        return math.nan
    pos = valid & (d > 0)
    if not pos.any():
        return math.nan
    lam = float((n[pos] / d[pos]).min())  # the ratio of a feasible choice: a start below the max
    nv, dv = np.where(valid, n, -np.inf), np.where(valid, d, 0.0)
    rows = np.arange(n.shape[0])
    for _ in range(100):
        pick = np.argmax(nv - lam * dv, axis=1)
        num, den = float(w @ n[rows, pick]), float(w @ d[rows, pick])
        if den <= 0 or num - lam * den <= 0:
            break  # F(λ) <= 0: no choice beats λ
        lam = num / den
    return lam


def _lemma7_bounds(metric: GeneralizedMetric, t: float, eta_lo, eta_hi, w) -> tuple[float, float]:
    """MACE Lemma 7 per record, combined over the evaluation records as in App. D.

    Linear metrics (population form, denominator the constant D): ℓ is the weighted average of
    the per-record risks, and the bounds are exactly App. D's average of the per-record Lemma-7
    bounds. Other metrics: ℓ = E[n]/E[d] (a ratio of averages, not an average of ratios), bounded
    over the same per-record intervals by :func:`_ratio_of_sums_max`; App. D's plain average of
    per-record ratios would bound a different quantity (and PPV's per-record risk is 0/0 wherever
    the rule says non-member).
    """
    n, d, valid = _lemma7_candidates(metric, t, eta_lo, eta_hi)
    if metric.b11 == metric.b10 == metric.b01 == metric.b00 == 0.0:
        lo = float(w @ np.where(valid, n, np.inf).min(axis=1)) / metric.b0
        hi = float(w @ np.where(valid, n, -np.inf).max(axis=1)) / metric.b0
        return (lo, hi) if metric.b0 > 0 else (hi, lo)
    hi = _ratio_of_sums_max(n, d, valid, w)
    lo = -_ratio_of_sums_max(-n, d, valid, w)
    return lo, hi


# -- the estimator -----------------------------------------------------------------------------
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

    Algorithm 2, with the experiment's prior p (not the sample ratio N1 : N2):

    1. Members and non-members are each split at random into three parts (a local
       ``torch.Generator`` seeded with ``seed``; the global RNG is never touched).
    2. η(q) = p·P/(p·P + (1−p)·Q) = (1 + f_p)/2 is the posterior of
       :func:`~privmon.estimators.risk.individual_risk` (``method``: histogram, Lemma 5; kde,
       Lemma 6 / 11) fitted on part 1.
    3. Threshold: if ℓ's Bayes threshold is known in closed form
       (:meth:`GeneralizedMetric.bayes_threshold`: Thm 1 for linear metrics, and e.g.
       WA(2,2,1,1)) it is used, no data are needed to choose it, and η is fitted on parts 1 + 2
       together. Otherwise t maximizes the empirical ℓ of "member when η̂ ≥ t" on part 2 over
       every distinct η̂ there (η fitted on part 1 only).
    4. ``value``: ℓ of that rule on part 3, TP = p·TPR̂, FP = (1−p)·FPR̂, FN = p·(1−TPR̂),
       TN = (1−p)·(1−FPR̂). NaN where ℓ is 0/0 (PPV of a rule that never says member).

    Intervals (both use only part 3, which neither η̂ nor t has seen):

    * ``certified_lower``: exact Clopper–Pearson bounds on the rule's TPR and FPR on part 3 plugged
      into ℓ (one-sided at δ/2 each for linear metrics, where ℓ is monotone in each; for others
      the least corner of a two-sided δ/2 box, valid because ℓ(TPR, FPR) is linear-fractional).
      Holds with probability >= 1 − δ for the learned rule, whose ℓ is at most the optimal ℓ*,
      so it is a certified lower bound on ℓ*.
    * ``lemma7_lower`` / ``lemma7_upper``: MACE Lemma 7 for each part-3 record, with the P / Q
      intervals of Lemma 5 / 6 at level 1 − δ and the threshold t, combined over part 3 with the
      experiment's weights (p/N1 per member, (1−p)/N2 per non-member) as App. D: for linear metrics
      the average of per-record bounds; otherwise the exact bounds on the ratio of averages (see
      :func:`_lemma7_bounds`), clipped to the range of ℓ at prior p. Not certified: App. D
      averages per-record intervals that each hold at 1 − δ but not jointly, Lemma 11 (kde) is a
      normal approximation that ignores the KDE's bias, and for metrics without a closed-form
      threshold t is itself an estimate.

    ``lower`` is ``certified_lower`` (for every metric: linear metrics use the monotone plug-in,
    others the box corners), falling back to ``lemma7_lower`` only where the certificate is not
    finite (a custom metric whose denominator can vanish on the box). ``upper`` is
    ``lemma7_upper``. Both are widened to contain ``value`` when it is finite (widening never
    invalidates a bound).

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
    """
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    metric = _resolve_metric(metric, prior)
    check_method(method)
    if bins is not None and (isinstance(bins, bool) or not isinstance(bins, int) or bins < 1):
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    bandwidth_factor(bandwidth, n=2, d=1)
    if metric.is_linear and not metric.denominator_at(prior) > 0:
        raise ValueError(
            f"metric {metric.name} has denominator b0 + b11·p + b10·(1−p) = "
            f"{metric.denominator_at(prior):g} <= 0 at prior={prior:g}"
        )
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

    gen = torch.Generator().manual_seed(seed)
    parts_m = [i.to(m.device) for i in _split(m.shape[0], gen)]
    parts_h = [i.to(m.device) for i in _split(h.shape[0], gen)]
    known = metric.has_closed_form_threshold
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
        queries,
        m[fit_m],
        h[fit_h],
        prior=prior,
        method=method,
        delta=delta,
        bins=bins,
        bandwidth=bandwidth,
    )
    eta = np.split(risk.posterior, np.cumsum(sizes)[:-1])
    if risk.signed_lower is None or risk.signed_upper is None:  # individual_risk sets both
        raise RuntimeError("individual_risk returned no signed interval")
    eta_lo = (1 + risk.signed_lower[-(sizes[2] + sizes[3]) :]) / 2
    eta_hi = (1 + risk.signed_upper[-(sizes[2] + sizes[3]) :]) / 2

    t = metric.bayes_threshold() if known else _search_threshold(metric, prior, eta[0], eta[1])

    n1, n2 = sizes[2], sizes[3]
    k1, k2 = int((eta[2] >= t).sum()), int((eta[3] >= t).sum())
    value = float(metric.value(*_confusion(prior, k1 / n1, k2 / n2)))
    certified = _certified_lower(metric, prior, k1, n1, k2, n2, delta)

    pop = _population_form(metric, prior)
    w = np.concatenate([np.full(n1, prior / n1), np.full(n2, (1 - prior) / n2)])
    lo7, hi7 = _lemma7_bounds(pop, t, eta_lo, eta_hi, w)
    eta3 = np.concatenate([eta[2], eta[3]])
    num, den = _local(pop, eta3, eta3 >= t)
    sd = float(w @ den)
    plugin = float(w @ num) / sd if sd != 0 else math.nan
    lo_range, hi_range = _metric_range(metric, prior)
    lo7, hi7, plugin = (float(np.clip(v, lo_range, hi_range)) for v in (lo7, hi7, plugin))

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


def deprecated_alias(module: str, name: str) -> Any:
    """``<module>.Metric``, the old name of :class:`GeneralizedMetric`, with a DeprecationWarning
    pointing at the code that asked for it (kept for one release); AttributeError for any other
    name. Called from a module's ``__getattr__``."""
    if name == "Metric":
        warnings.warn(
            "privmon.Metric is renamed privmon.GeneralizedMetric (the coefficients of a MACE "
            "eq. 4 metric); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=3,  # past this function and the module's __getattr__
        )
        return GeneralizedMetric
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name)
