"""Metric-based membership inference attacks (Song & Mittal, "Systematic Evaluation of Privacy
Risks of Machine Learning Models", §3.1).

Each attack reduces a classifier's softmax output on a labelled record (x, y) to one number and
compares it with a threshold: correctness (eq. 5) and the confidence p_y (eq. 6) call a member
above it, the entropy (eq. 7) and the modified entropy (eq. 8) below it
(:data:`HIGHER_IS_MEMBER`). :class:`MetricAttack` fits the thresholds, one per class or one for
all, to maximize the accuracy at a prior. :class:`privmon.queries.ModifiedEntropyQuery` uses the
same modified-entropy code (:func:`modified_entropy_from_logits`).

The formulas, the clipping inside modified entropy and the exact threshold search: docs, Theory
page, *Metric attacks*.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch

from privmon._shown import positions, shown
from privmon._validation import check_open_unit, to_numpy

__all__ = [
    "HIGHER_IS_MEMBER",
    "METRICS",
    "MetricAttack",
    "confidence",
    "correctness",
    "entropy",
    "logit_confidence_from_logits",
    "metric_values",
    "modified_entropy",
    "modified_entropy_from_logits",
]

MetricName = Literal["mentr", "entropy", "confidence", "correctness"]
METRICS: tuple[str, ...] = ("mentr", "entropy", "confidence", "correctness")
HIGHER_IS_MEMBER: dict[str, bool] = {
    "mentr": False,
    "entropy": False,
    "confidence": True,
    "correctness": True,
}

# Modified entropy clips probabilities into [1e-30, 1 - 1e-30] inside its logs.
_CLIP = 1e-30
_LOG_LO = math.log(_CLIP)
_LOG_HI = math.log1p(-_CLIP)
_SUM_TOL = 1e-2  # rows of probs must sum to 1 within this (float16 softmax included)


# --- the modified entropy core (shared with ModifiedEntropyQuery) ------------------------------


def _logsumexp_excluding(z: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp of z (n, C) over all columns except idx (n,)."""
    return z.scatter(1, idx[:, None], float("-inf")).logsumexp(dim=1)


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a <= 0, accurate on both sides of -log 2."""
    a = a.clamp(max=0.0)
    return torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def modified_entropy_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Song & Mittal's eq. 8 from logits (n, C) and class indices (n,), in the logits' dtype.

    ``log p_i`` by log-softmax, ``log(1 − p_i)`` by log1mexp, and for the arg-max class k exactly
    as ``logsumexp_{j≠k} z_j − logsumexp z``; logs clipped to [log 1e-30, log(1 − 1e-30)].
    Logits may be −inf (probability 0). Finite for finite (or −inf) logits.
    """
    lse = logits.logsumexp(dim=1)
    logp = logits - lse[:, None]
    p = logp.exp()
    log1m = _log1mexp(logp)
    k = logits.argmax(dim=1)
    log1m_k = _logsumexp_excluding(logits, k) - lse
    log1m = log1m.scatter(1, k[:, None], log1m_k[:, None])
    yi = labels[:, None]
    true_term = -log1m.gather(1, yi).exp() * logp.gather(1, yi).clamp(_LOG_LO, _LOG_HI)
    other = p * log1m.clamp(_LOG_LO, _LOG_HI)
    other = other.scatter(1, yi, 0.0)
    return (true_term.squeeze(1) - other.sum(dim=1)).to(logits.dtype)


def logit_confidence_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LiRA's logit-scaled confidence ``log(p_y / (1 − p_y)) = z_y − logsumexp_{i≠y} z_i``
    from logits (..., C) and class indices (...), any leading shape.

    Computed by the identity on the right, so it stays finite (100 for logits [50, −50]) where
    ``p_y`` rounds to 1; ``p_y = sigmoid(φ)`` and the cross-entropy ``−log p_y = softplus(−φ)``.
    """
    yi = labels.unsqueeze(-1)
    zy = logits.gather(-1, yi).squeeze(-1)
    return zy - logits.scatter(-1, yi, float("-inf")).logsumexp(dim=-1)


# --- input checks ------------------------------------------------------------------------------


def check_metric(metric: Any) -> str:
    if not isinstance(metric, str) or metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {shown(metric)}")
    return metric


def check_min_records(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"min_class_records must be an integer >= 1, got {shown(value)}")
    return int(value)


def as_probs(probs: Any, *, name: str, device: torch.device | None = None) -> torch.Tensor:
    """``probs`` as a float64 tensor (n, C), C >= 2, on its own device (or ``device``).

    Rows that are not finite are kept (their metric is NaN); finite rows must be probabilities.
    """
    if isinstance(probs, torch.Tensor):
        t = probs.detach()
    else:
        try:
            arr = np.asarray(probs, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a numeric array of shape (n, C)") from None
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if device is not None:
        t = t.to(device)
    if t.is_complex():
        raise ValueError(f"{name} must be real probabilities, got a complex array")
    t = t.to(torch.float64)
    if t.ndim != 2 or t.shape[1] < 2:
        raise ValueError(
            f"{name} must have shape (n, C) with C >= 2 classes, got shape {tuple(t.shape)} "
            "(a binary classifier's p(class 1) as (n,): pass torch.stack([1 - p, p], 1))"
        )
    if t.shape[0] == 0:
        raise ValueError(f"{name} is empty: at least one record is needed")
    finite = torch.isfinite(t).all(dim=1)
    off = (t < 0).any(dim=1) | (t > 1 + _SUM_TOL).any(dim=1) | ((t.sum(dim=1) - 1).abs() > _SUM_TOL)
    bad = finite & off
    if bool(bad.any()):
        raise ValueError(
            f"{name} must hold probabilities (softmax rows in [0, 1] summing to 1); rows "
            f"{positions(bad)} do not: pass softmax(logits)"
        )
    return t


def as_labels(
    labels: Any, *, n: int, n_classes: int, name: str, device: torch.device
) -> torch.Tensor:
    """Class indices as an int64 tensor (n,) on ``device``, checked against ``n_classes``."""
    if isinstance(labels, torch.Tensor):
        y = labels.detach().to(device)
    else:
        arr = np.asarray(labels)
        if arr.dtype == object or not (
            np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
        ):
            raise ValueError(f"{name} must be integer class indices, got dtype {arr.dtype}")
        y = torch.as_tensor(np.ascontiguousarray(arr), device=device)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y.reshape(-1)
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(
            f"{name} must have shape ({n},), one class index per record, got {tuple(y.shape)}"
        )
    if y.is_complex():
        raise ValueError(f"{name} must be class indices, got complex values")
    if y.is_floating_point():
        if not bool(torch.all(y == torch.round(y))):
            raise ValueError(f"{name} must be class indices, got non-integer values")
    y = y.long()
    bad = (y < 0) | (y >= n_classes)
    if bool(bad.any()):
        raise ValueError(
            f"{name} must lie in [0, {n_classes - 1}] for {n_classes} classes; "
            f"{positions(bad)} do not"
        )
    return y


def prepare_pair(
    member_probs: Any, member_labels: Any, nonmember_probs: Any, nonmember_labels: Any
):
    """Checked member and non-member (probs, labels), on the member probs' device, with the
    same number of classes."""
    pm, ym = prepare_inputs(member_probs, member_labels, name="member_")
    ph, yh = prepare_inputs(nonmember_probs, nonmember_labels, name="nonmember_", device=pm.device)
    if ph.shape[1] != pm.shape[1]:
        raise ValueError(
            f"member_probs has {pm.shape[1]} classes but nonmember_probs {ph.shape[1]}"
        )
    return pm, ym, ph, yh


def prepare_inputs(
    probs: Any, labels: Any, *, name: str, device=None, n_classes: int | None = None
):
    p = as_probs(probs, name=f"{name}probs", device=device)
    if n_classes is not None and p.shape[1] != n_classes:
        raise ValueError(f"{name}probs has {p.shape[1]} classes, but the fit saw {n_classes}")
    y = as_labels(labels, n=p.shape[0], n_classes=p.shape[1], name=f"{name}labels", device=p.device)
    return p, y


def metric_tensor(metric: str, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The metric of checked probabilities ``p`` (n, C) float64 and labels ``y`` (n,) int64, as a
    float64 tensor on their device; NaN for rows of ``p`` that are not finite."""
    finite = torch.isfinite(p).all(dim=1)
    q = torch.where(finite[:, None], p, 1.0 / p.shape[1])
    if metric == "mentr":
        out = modified_entropy_from_logits(torch.log(q), y)
    elif metric == "entropy":
        out = 0.0 - torch.xlogy(q, q).sum(dim=1)  # 0.0 - (+0) = +0, not -0
    elif metric == "confidence":
        out = q.gather(1, y[:, None]).squeeze(1)
    else:
        out = (q.argmax(dim=1) == y).to(torch.float64)
    return torch.where(finite, out, float("nan"))


# --- public metric functions -----------------------------------------------------------------


def metric_values(probs: Any, labels: Any, metric: MetricName = "mentr") -> np.ndarray:
    """The named metric of each record, shape (n,) float64 (NaN where a probs row is not finite).

    ``probs``: softmax outputs (n, C), numpy or torch on any device; ``labels``: class indices (n,).

    Examples:
        >>> import torch
        >>> from privmon.attacks import metric_values
        >>> probs = torch.tensor([[0.9, 0.05, 0.05], [0.2, 0.5, 0.3]])
        >>> metric_values(probs, torch.tensor([0, 2]), "confidence").round(2)
        array([0.9, 0.3])
    """
    check_metric(metric)
    p, y = prepare_inputs(probs, labels, name="")
    return to_numpy(metric_tensor(metric, p, y))


def correctness(probs: Any, labels: Any) -> np.ndarray:
    """1.0 where the arg-max class (the first one on ties) equals the label, else 0.0 (eq. 5).

    Examples:
        >>> import torch
        >>> from privmon.attacks import correctness
        >>> probs = torch.tensor([[0.9, 0.05, 0.05], [0.2, 0.5, 0.3]])
        >>> correctness(probs, torch.tensor([0, 2]))
        array([1., 0.])
    """
    return metric_values(probs, labels, "correctness")


def confidence(probs: Any, labels: Any) -> np.ndarray:
    """The probability of the true class, p_y (eq. 6).

    Examples:
        >>> import torch
        >>> from privmon.attacks import confidence
        >>> probs = torch.tensor([[0.9, 0.05, 0.05], [0.2, 0.5, 0.3]])
        >>> confidence(probs, torch.tensor([0, 2])).round(2)
        array([0.9, 0.3])
    """
    return metric_values(probs, labels, "confidence")


def entropy(probs: Any, labels: Any = None) -> np.ndarray:
    """Prediction entropy −Σ_i p_i log p_i, with 0·log 0 = 0 (eq. 7). Labels are not used.

    Examples:
        >>> import torch
        >>> from privmon.attacks import entropy
        >>> entropy(torch.tensor([[1.0, 0.0], [0.5, 0.5]])).round(4)
        array([0.    , 0.6931])
    """
    if labels is None:
        p = as_probs(probs, name="probs")
        y = torch.zeros(p.shape[0], dtype=torch.long, device=p.device)
        return to_numpy(metric_tensor("entropy", p, y))
    return metric_values(probs, labels, "entropy")


def modified_entropy(probs: Any, labels: Any) -> np.ndarray:
    """Song & Mittal's modified entropy (eq. 8), −(1 − p_y) log p_y − Σ_{i≠y} p_i log(1 − p_i).

    Probabilities are clipped into [1e-30, 1 − 1e-30] inside the logs: 0 for a perfectly
    confident correct prediction, finite (2·69.08 for a one-hot wrong one) and never NaN.

    Examples:
        >>> import torch
        >>> from privmon.attacks import modified_entropy
        >>> probs = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
        >>> modified_entropy(probs, torch.tensor([0, 0, 0])).round(2)
        array([  0.  ,   0.69, 138.16])
    """
    return metric_values(probs, labels, "mentr")


# --- threshold search --------------------------------------------------------------------------


def best_thresholds(
    s: torch.Tensor,
    group: torch.Tensor,
    member: torch.Tensor,
    n_groups: int,
    *,
    prior: float,
    n1: int,
    n0: int,
) -> torch.Tensor:
    """Per group g, the τ_g maximizing p·TP_g/N1 − (1 − p)·FP_g/N0 for the rule ``s >= τ_g``.

    ``s`` (n,) finite float64, higher = member; ``group`` (n,) int64 in [0, n_groups);
    ``member`` (n,) bool. All groups at once: one sort by (group, −s), cumulative counts, and a
    scatter-max. τ = +inf ("nobody") when no threshold gains over it (also for empty groups);
    −inf when every record of the group is called a member.
    """
    dev = s.device
    n = s.shape[0]
    inf = torch.full((n_groups,), math.inf, dtype=torch.float64, device=dev)
    if n == 0:
        return inf
    order = torch.argsort(s, descending=True, stable=True)
    order = order[torch.argsort(group[order], stable=True)]
    s_o, g_o, m_o = s[order], group[order], member[order]
    tp = torch.cumsum(m_o.to(torch.int64), 0)
    fp = torch.cumsum((~m_o).to(torch.int64), 0)
    counts = torch.bincount(g_o, minlength=n_groups)
    starts = torch.cumsum(counts, 0) - counts
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    tp_before = torch.cat([zero, tp])[starts][g_o]
    fp_before = torch.cat([zero, fp])[starts][g_o]
    gain = prior * (tp - tp_before).double() / n1 - (1 - prior) * (fp - fp_before).double() / n0
    # a threshold at s_o[i] calls every record down to the last one equal to it a member:
    # only the last record of each tie run (within its group) is a candidate
    same_next = torch.zeros(n, dtype=torch.bool, device=dev)
    same_next[:-1] = (g_o[1:] == g_o[:-1]) & (s_o[1:] == s_o[:-1])
    gain = torch.where(same_next, -math.inf, gain)
    best = torch.zeros(n_groups, dtype=torch.float64, device=dev)  # 0 = "nobody is a member"
    best = best.scatter_reduce(0, g_o, gain, "amax", include_self=True)
    hit = (gain == best[g_o]) & (best[g_o] > 0)
    idx = torch.arange(n, device=dev)
    pos = torch.full((n_groups,), n, dtype=torch.int64, device=dev)
    pos = pos.scatter_reduce(0, g_o[hit], idx[hit], "amin", include_self=True)
    chosen = pos < n
    pc = pos.clamp(max=n - 1)
    nxt = (pc + 1).clamp(max=n - 1)
    has_next = chosen & (pc + 1 < n) & (g_o[nxt] == g_o[pc])
    hi, lo = s_o[pc], s_o[nxt]
    mid = hi / 2 + lo / 2
    mid = torch.where(mid > lo, mid, hi)  # adjacent floats: keep the lower value out
    tau = torch.where(has_next, mid, -math.inf)
    return torch.where(chosen, tau, inf)


class MetricAttack:
    """Threshold attack on one metric, class-dependent or not (Song & Mittal §3.1).

    ``fit`` learns thresholds from records of known membership, ``predict`` applies them and
    ``evaluate`` reports the accuracy ``p·TPR + (1 − p)·(1 − FPR)``, the advantage
    ``2·accuracy − 1`` (its trivial floor is |2p − 1|), TPR and FPR. Inputs are softmax outputs
    (n, C) and class indices (n,), numpy or torch on any device; the search runs on the member
    probs' device. Records whose probs are not finite are dropped (``n_dropped_`` counts them at
    fit time) and predicted non-members.

    Args:
        metric: "mentr" (default), "entropy", "confidence" or "correctness".
        class_conditional: one threshold per class label (τ_y, §3.1.2) or one for all.
        prior: P(member) in (0, 1) at which the accuracy is maximized and reported.
        min_class_records: fitting members and non-members a class needs for its own threshold;
            other classes (and labels never seen) use the class-independent one.

    After ``fit``: ``threshold_``, the class-independent threshold in metric units;
    ``thresholds_`` (n_classes,), the one each label uses; ``class_fitted_`` (n_classes,) bool,
    whether that class has its own. A record is a member when its metric is ``>= threshold``
    (correctness, confidence) or ``<= threshold`` (entropy, mentr), so a threshold of +inf (−inf
    for entropy, mentr) calls nobody a member and the opposite infinity everybody.

    Examples:
        >>> import torch
        >>> from privmon.attacks import MetricAttack
        >>> gen = torch.Generator().manual_seed(0)
        >>> y_in, y_out = torch.randint(0, 3, (2, 400), generator=gen)
        >>> def softmax_outputs(y, margin):  # members: a larger margin on their label
        ...     logits = torch.randn(len(y), 3, generator=gen)
        ...     return (logits + margin * torch.nn.functional.one_hot(y, 3)).softmax(dim=1)
        >>> p_in, p_out = softmax_outputs(y_in, 3.0), softmax_outputs(y_out, 1.0)
        >>> attack = MetricAttack("mentr").fit(p_in[:200], y_in[:200], p_out[:200], y_out[:200])
        >>> attack.thresholds_.shape
        (3,)
        >>> figures = attack.evaluate(p_in[200:], y_in[200:], p_out[200:], y_out[200:])
        >>> round(figures["advantage"], 2)
        0.52
    """

    def __init__(
        self,
        metric: MetricName = "mentr",
        *,
        class_conditional: bool = True,
        prior: float = 0.5,
        min_class_records: int = 1,
    ) -> None:
        self.metric = check_metric(metric)
        if not isinstance(class_conditional, (bool, np.bool_)):
            raise ValueError(
                f"class_conditional must be True or False, got {shown(class_conditional)}"
            )
        self.class_conditional = bool(class_conditional)
        self.prior = check_open_unit(prior, name="prior")
        self.min_class_records = check_min_records(min_class_records)
        self.higher_is_member = HIGHER_IS_MEMBER[self.metric]
        self._tau: torch.Tensor | None = None  # oriented (higher = member), per class
        self.threshold_: float | None = None
        self.thresholds_: np.ndarray | None = None
        self.class_fitted_: np.ndarray | None = None
        self.n_classes_: int | None = None
        self.n_dropped_: int = 0

    def __repr__(self) -> str:
        return (
            f"MetricAttack(metric={self.metric!r}, class_conditional={self.class_conditional}, "
            f"prior={self.prior})"
        )

    def _oriented(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        v = metric_tensor(self.metric, p, y)
        return v if self.higher_is_member else -v

    def fit(
        self, member_probs: Any, member_labels: Any, nonmember_probs: Any, nonmember_labels: Any
    ) -> MetricAttack:
        """Fit the thresholds on known members / non-members. Returns ``self``."""
        pm, ym, ph, yh = prepare_pair(
            member_probs, member_labels, nonmember_probs, nonmember_labels
        )
        c = pm.shape[1]
        s = torch.cat([self._oriented(pm, ym), self._oriented(ph, yh)])
        y = torch.cat([ym, yh])
        member = torch.cat(
            [
                torch.ones(len(ym), dtype=torch.bool, device=pm.device),
                torch.zeros(len(yh), dtype=torch.bool, device=pm.device),
            ]
        )
        finite = torch.isfinite(s)
        n1, n0 = int((finite & member).sum()), int((finite & ~member).sum())
        if n1 == 0 or n0 == 0:
            raise ValueError("fit needs at least one member and one non-member with finite probs")
        self.n_dropped_ = int((~finite).sum())
        s, y, member = s[finite], y[finite], member[finite]
        pooled = best_thresholds(s, torch.zeros_like(y), member, 1, prior=self.prior, n1=n1, n0=n0)
        tau = pooled.expand(c).clone()
        own = torch.zeros(c, dtype=torch.bool, device=s.device)
        if self.class_conditional:
            per = best_thresholds(s, y, member, c, prior=self.prior, n1=n1, n0=n0)
            k1 = torch.bincount(y[member], minlength=c)
            k0 = torch.bincount(y[~member], minlength=c)
            own = (k1 >= self.min_class_records) & (k0 >= self.min_class_records)
            tau = torch.where(own, per, tau)
        self._tau = tau
        sign = 1.0 if self.higher_is_member else -1.0
        self.threshold_ = sign * float(pooled[0])
        self.thresholds_ = sign * to_numpy(tau)
        self.class_fitted_ = to_numpy(own)
        self.n_classes_ = c
        return self

    def _check_fitted(self) -> torch.Tensor:
        if self._tau is None:
            raise RuntimeError("MetricAttack is not fitted: call fit(...) first")
        return self._tau

    def _predict_t(self, probs: Any, labels: Any, name: str = "") -> torch.Tensor:
        tau = self._check_fitted()
        p, y = prepare_inputs(
            probs, labels, name=name, device=tau.device, n_classes=self.n_classes_
        )
        return self._oriented(p, y) >= tau[y]  # NaN compares False: non-member

    def predict(self, probs: Any, labels: Any) -> np.ndarray:
        """Membership guesses, a bool array (n,)."""
        return to_numpy(self._predict_t(probs, labels))

    def evaluate(
        self, member_probs: Any, member_labels: Any, nonmember_probs: Any, nonmember_labels: Any
    ) -> dict[str, float]:
        """accuracy (p·TPR + (1 − p)·(1 − FPR)), advantage (2·accuracy − 1), tpr and fpr of the
        fitted thresholds on these records (rows with non-finite probs are left out)."""
        tau = self._check_fitted()
        rates = []
        for probs, labels, name in (
            (member_probs, member_labels, "member_"),
            (nonmember_probs, nonmember_labels, "nonmember_"),
        ):
            p, y = prepare_inputs(
                probs, labels, name=name, device=tau.device, n_classes=self.n_classes_
            )
            s = self._oriented(p, y)
            finite = torch.isfinite(s)
            n = int(finite.sum())
            if n == 0:
                raise ValueError(f"{name}probs has no finite rows")
            rates.append(int((s >= tau[y]).sum()) / n)
        tpr, fpr = rates
        acc = self.prior * tpr + (1 - self.prior) * (1 - fpr)
        return {"accuracy": acc, "advantage": 2 * acc - 1, "tpr": tpr, "fpr": fpr}
