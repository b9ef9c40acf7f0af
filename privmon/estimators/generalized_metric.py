"""The generalized metrics of MACE (eq. 4, §2.6, §3.2-3.3, App. B) as records:
:class:`GeneralizedMetric` and its presets.

A generalized metric is a ratio of linear forms in the joint confusion probabilities,
ℓ = (a0 + a11·TP + a10·FP + a01·FN + a00·TN) / (b0 + b11·TP + b10·FP + b01·FN + b00·TN), at
prior p (TP + FN = p). The optimal adversary predicts "member" when the posterior η(q) =
P(m=1 | q) reaches a threshold t_ℓ: in closed form for linear metrics (Thm 1), else a function
of the optimal value ℓ*. Theory, *Generalized metrics*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privmon._validation import check_open_unit

__all__ = [
    "ACC",
    "F1",
    "METRIC_TOL",
    "PPV",
    "PRESETS",
    "TNR",
    "TPR",
    "WA",
    "GeneralizedMetric",
    "resolve_metric",
]

_COEFFS = ("a0", "a11", "a10", "a01", "a00", "b0", "b11", "b10", "b01", "b00")
PRESETS = ("acc", "ppv", "precision", "tpr", "recall", "tnr", "am", "wa", "f1")
# the tolerance to which an ℓ*-free threshold and the ties on a metric's maximum are read
METRIC_TOL = 1e-12


@dataclass(frozen=True, kw_only=True)
class GeneralizedMetric:
    """The coefficients of a generalized metric ℓ (MACE eq. 4; all default 0): a record that
    :func:`generalized_advantage` reads, not a stateful metric object (privmon has no
    ``update`` / ``compute`` metrics).

    ``name`` labels the metric in estimates. ``prior`` is set only for metrics whose coefficients
    were built for one prior (AM, :meth:`am`); :func:`generalized_advantage` refuses to use such a
    metric at another prior.

    Presets (MACE App. B, §3.3): :data:`ACC`, :data:`PPV`, :data:`TPR`, :data:`TNR`, :data:`F1`,
    :data:`WA` (weights 2, 2, 1, 1), ``GeneralizedMetric.am(prior)``,
    ``GeneralizedMetric.wa(w1, w2, w3, w4)``, or by name with :meth:`preset`.

    Examples:
        >>> from privmon import GeneralizedMetric
        >>> f1 = GeneralizedMetric.preset("f1")
        >>> f1.is_linear, round(f1.value(tp=0.4, fp=0.1, fn=0.1, tn=0.4), 3)
        (False, 0.8)
        >>> GeneralizedMetric.am(0.3).bayes_threshold()
        0.3
        >>> balanced = GeneralizedMetric(a11=1, a00=1, b0=1, name="TP + TN")
        >>> balanced.value(0.4, 0.1, 0.1, 0.4)
        0.8
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
        return self.is_linear or abs(a0_ * g1 - a1_ * g0) <= METRIC_TOL * scale

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
        if key not in PRESETS:
            raise ValueError(
                f"metric must be a GeneralizedMetric or one of {PRESETS}, got {name!r}"
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


def resolve_metric(metric: Any, prior: float) -> GeneralizedMetric:
    """``metric`` (a :class:`GeneralizedMetric` or a preset name) checked for use at ``prior``."""
    if isinstance(metric, str):
        return GeneralizedMetric.preset(metric, prior=prior)
    if not isinstance(metric, GeneralizedMetric):
        raise ValueError(f"metric must be a GeneralizedMetric or one of {PRESETS}, got {metric!r}")
    if metric.prior is not None and abs(metric.prior - prior) > 1e-12:
        raise ValueError(
            f"metric {metric.name} was built for prior={metric.prior:g} but prior={prior:g}: "
            f"build it at this prior (GeneralizedMetric.am({prior:g}) or metric='am')"
        )
    return metric
