"""Song & Mittal's privacy risk score (§4.1, eq. 12-15) and its calibration check (§4.2.1).

The privacy risk score of a labelled record is the posterior probability that it is a member
given one metric of the model's output on it (modified entropy by default), measured per class
(eq. 14). It is MACE's individual risk, r = (1 + f_p) / 2, so :class:`PrivacyRiskScore` computes
it with :func:`privmon.individual_risk` on the metric's quantile scale, intervals included.
:func:`calibration` checks a score on records it was not fitted on.

The cells, the interpolated resolution, the per-class fallback and what the calibration
measures: docs, Theory page, *Privacy risk score*.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import torch

from privmon._shown import positions, shown
from privmon._validation import check_flag, check_open_unit, to_numpy
from privmon.attacks.metric import (
    HIGHER_IS_MEMBER,
    MetricName,
    check_metric,
    check_min_records,
    metric_tensor,
    prepare_inputs,
    prepare_pair,
)
from privmon.estimators.binned_scores import BinnedScores
from privmon.estimators.methods import check_method
from privmon.estimators.risk import IndividualRisk, individual_risk, risk_from_probabilities

__all__ = ["Calibration", "PrivacyRiskScore", "calibration"]

RECORDS_PER_CELL = 200
MAX_CELLS = 100
_FIELDS = ("value", "lower", "upper", "signed", "posterior", "signed_lower", "signed_upper")


class _Group:
    """One fitted estimate: the sorted fitting values (the empirical CDF), their CDF values and
    the interpolation nodes (the mean CDF value of the fitting records of each occupied cell of
    :func:`privmon.individual_risk`'s grid, increasing)."""

    def __init__(self, m: torch.Tensor, h: torch.Tensor, bins: int | None) -> None:
        self.ref = torch.sort(torch.cat([m, h])).values
        self.n = self.ref.shape[0]
        self.u_min = float(self._cdf(self.ref[:1])[0])
        self.u_m = torch.sort(self._cdf(m)).values
        self.u_h = torch.sort(self._cdf(h)).values
        self.bins = bins if bins is not None else _auto_bins(self.n)
        # the grid individual_risk bins on (the same state, so the same cells)
        grid = BinnedScores(bins=self.bins, margin=0.0, device=self.u_m.device)
        grid.update(self.u_m, self.u_h)
        u = torch.cat([self.u_m, self.u_h])
        cell, _ = grid.cell_index(u[:, None])
        count = torch.bincount(cell, minlength=self.bins)
        mean = torch.bincount(cell, weights=u, minlength=self.bins) / count.clamp_min(1)
        # a mean rounded past its cell's records (1 + 2^-52 from ties at 1) leaves the cell
        low, high = (
            u.new_zeros(self.bins).scatter_reduce(0, cell, u, how, include_self=False)
            for how in ("amin", "amax")
        )
        self.nodes = torch.minimum(torch.maximum(mean, low), high)[count > 0]

    @property
    def kde_ok(self) -> bool:
        """A Gaussian KDE needs two distinct values on each side."""
        return all(u.shape[0] >= 2 and bool(u[0] < u[-1]) for u in (self.u_m, self.u_h))

    def _cdf(self, x: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.ref, x.contiguous(), right=True).double() / self.n

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Empirical CDF of x, clipped into the fitted range; NaN stays NaN."""
        u = self._cdf(torch.nan_to_num(x)).clamp(self.u_min, 1.0)
        return torch.where(torch.isfinite(x), u, float("nan"))


def _auto_bins(n: int) -> int:
    return int(min(max(n // RECORDS_PER_CELL, 2), MAX_CELLS))


def _interpolated_risk(g: _Group, u: torch.Tensor, *, prior: float, delta: float) -> IndividualRisk:
    """Lemma 5 at the group's nodes (at δ/2), read between them by linear interpolation of f_p
    and its bounds; flat beyond the first and last node; NaN where u is NaN."""
    at_nodes = individual_risk(g.nodes, g.u_m, g.u_h, prior=prior, delta=delta / 2, bins=g.bins)
    x, nodes = to_numpy(u), to_numpy(g.nodes)
    # individual_risk always sets the signed bounds (Optional fields of IndividualRisk)
    f, f_lo, f_hi = (
        np.interp(x, nodes, np.asarray(a, dtype=np.float64))
        for a in (at_nodes.signed, at_nodes.signed_lower, at_nodes.signed_upper)
    )
    # Member / non-member masses proportional to r/p and (1 − r)/(1 − p) have posterior r at
    # prior p: Lemma 5's |f_p| interval from the interpolated f_p bounds, one formula for both.
    out = risk_from_probabilities(
        (1 + f) / (2 * prior),
        (1 + f_lo) / (2 * prior),
        (1 + f_hi) / (2 * prior),
        (1 - f) / (2 * (1 - prior)),
        (1 - f_hi) / (2 * (1 - prior)),
        (1 - f_lo) / (2 * (1 - prior)),
        prior=prior,
        method="histogram",
        delta=delta,
        n_dropped=int(np.isnan(x).sum()),
    )
    # a NaN mass reads as "no evidence" there (the prior): NaN rows stay NaN instead
    masked: dict[str, Any] = {k: np.where(np.isnan(x), np.nan, getattr(out, k)) for k in _FIELDS}
    return dataclasses.replace(out, **masked)


class PrivacyRiskScore:
    """Privacy risk score r(z) = P(member | metric, label) (Song & Mittal §4.1, eq. 13-15).

    ``fit`` takes records of known membership (a shadow model's training and test data, or the
    audited model's own member / non-member reference records); ``score`` and ``risk`` read other
    records (scoring the fitting records overstates the calibration). Inputs are softmax outputs
    (n, C) and class indices (n,), numpy or torch on any device. Non-finite probability rows are
    dropped at fit time (``n_dropped_``) and score NaN.

    Args:
        prior: P(member) in (0, 1); the paper's eq. 13 is prior 0.5.
        metric: "mentr" (eq. 15, default), "entropy", "confidence" or "correctness".
        class_conditional: per-label distributions (eq. 14); a class with fewer than
            ``min_class_records`` fitting members or non-members, or a label unseen at fit time,
            gets the pooled estimate (``class_fitted_`` says which have their own). False: pooled.
        method: "histogram" (default; MACE Lemma 5 intervals) or "kde" (Gaussian KDE on the
            quantile scale, Lemma 6/11 intervals; O(n·m) time).
        bins: cells per estimate (histogram), or None for about 200 fitting records per cell.
        interpolate: histogram only: read the score between the cells by linear interpolation;
            False (default) gives one score per cell, as the paper's code does.
        min_class_records: fitting members and non-members a class needs for its own estimate.
        delta: 1 − level of the intervals returned by :meth:`risk`.

    Examples:
        >>> import torch
        >>> from privmon.attacks import PrivacyRiskScore
        >>> gen = torch.Generator().manual_seed(0)
        >>> y = torch.randint(0, 2, (3, 1000), generator=gen)
        >>> def softmax_outputs(y, margin):  # members: a larger margin on their label
        ...     logits = torch.randn(len(y), 2, generator=gen)
        ...     return (logits + margin * torch.nn.functional.one_hot(y, 2)).softmax(dim=1)
        >>> prs = PrivacyRiskScore()
        >>> _ = prs.fit(softmax_outputs(y[0], 3.0), y[0], softmax_outputs(y[1], 1.0), y[1])
        >>> prs.class_fitted_
        array([ True,  True])
        >>> scores = prs.score(softmax_outputs(y[2], 3.0), y[2])  # members, not fitted on
        >>> round(float(scores.mean()), 2)
        0.66
    """

    def __init__(
        self,
        prior: float = 0.5,
        metric: MetricName = "mentr",
        class_conditional: bool = True,
        *,
        method: str = "histogram",
        bins: int | None = None,
        interpolate: bool = False,
        min_class_records: int = 100,
        delta: float = 0.05,
    ) -> None:
        self.prior = check_open_unit(prior, name="prior")
        self.metric = check_metric(metric)
        self.class_conditional = check_flag(class_conditional, name="class_conditional")
        self.method = check_method(method)
        if bins is not None and (
            isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1
        ):
            raise ValueError(f"bins must be a positive integer or None, got {shown(bins)}")
        self.bins = None if bins is None else int(bins)
        self.interpolate = check_flag(interpolate, name="interpolate")
        self.min_class_records = check_min_records(min_class_records)
        self.delta = check_open_unit(delta, name="delta")
        self._pooled: _Group | None = None
        self._groups: dict[int, _Group] = {}
        self._device: torch.device | None = None
        self.n_classes_: int | None = None
        self.class_fitted_: np.ndarray | None = None
        self.n_dropped_: int = 0

    def __repr__(self) -> str:
        return (
            f"PrivacyRiskScore(prior={self.prior}, metric={self.metric!r}, "
            f"class_conditional={self.class_conditional}, method={self.method!r})"
        )

    def fit(
        self, member_probs: Any, member_labels: Any, nonmember_probs: Any, nonmember_labels: Any
    ) -> PrivacyRiskScore:
        """Measure the member / non-member metric distributions. Returns ``self``."""
        pm, ym, ph, yh = prepare_pair(
            member_probs, member_labels, nonmember_probs, nonmember_labels
        )
        vm, vh = metric_tensor(self.metric, pm, ym), metric_tensor(self.metric, ph, yh)
        fm, fh = torch.isfinite(vm), torch.isfinite(vh)
        if not bool(fm.any()) or not bool(fh.any()):
            raise ValueError("fit needs at least one member and one non-member with finite probs")
        self.n_dropped_ = int((~fm).sum() + (~fh).sum())
        vm, ym, vh, yh = vm[fm], ym[fm], vh[fh], yh[fh]
        c = pm.shape[1]
        kde = self.method == "kde"
        pooled = _Group(vm, vh, self.bins)
        if kde and not pooled.kde_ok:
            raise ValueError(
                "method='kde' needs at least two distinct metric values among the members and "
                "among the non-members; use method='histogram'"
            )
        groups = {}
        if self.class_conditional:
            k1 = torch.bincount(ym, minlength=c)
            k0 = torch.bincount(yh, minlength=c)
            ok = (k1 >= self.min_class_records) & (k0 >= self.min_class_records)
            for cls in torch.nonzero(ok).flatten().tolist():
                g = _Group(vm[ym == cls], vh[yh == cls], self.bins)
                if not kde or g.kde_ok:
                    groups[cls] = g
        self._pooled, self._groups = pooled, groups
        self.class_fitted_ = np.zeros(c, dtype=bool)
        self.class_fitted_[list(self._groups)] = True
        self.n_classes_ = c
        self._device = pm.device
        return self

    def risk(self, probs: Any, labels: Any) -> IndividualRisk:
        """The full individual-risk estimate per record, in input order: ``posterior`` is the
        privacy risk score, ``signed`` = 2·posterior − 1 = f_p, ``value`` = |f_p|, with the
        Lemma 5 (histogram) or Lemma 6/11 (KDE) intervals at level 1 − delta."""
        if self._pooled is None:
            raise RuntimeError("PrivacyRiskScore is not fitted: call fit(...) first")
        p, y = prepare_inputs(
            probs, labels, name="", device=self._device, n_classes=self.n_classes_
        )
        v = metric_tensor(self.metric, p, y)
        n = v.shape[0]
        out = {k: np.full(n, np.nan) for k in _FIELDS}
        rest = torch.ones(n, dtype=torch.bool, device=v.device)
        parts = [(g, y == cls) for cls, g in self._groups.items()]
        for _, sel in parts:
            rest &= ~sel
        parts.append((self._pooled, rest))
        n_dropped = 0
        for g, sel in parts:
            if not bool(sel.any()):
                continue
            u = g.transform(v[sel])
            if self.method == "histogram" and self.interpolate:
                r = _interpolated_risk(g, u, prior=self.prior, delta=self.delta)
            else:
                r = individual_risk(
                    u,
                    g.u_m,
                    g.u_h,
                    prior=self.prior,
                    method=self.method,
                    delta=self.delta,
                    bins=g.bins if self.method == "histogram" else None,
                )
            idx = to_numpy(torch.nonzero(sel).flatten())
            for k in _FIELDS:
                out[k][idx] = getattr(r, k)
            n_dropped += r.n_dropped
        return IndividualRisk(
            **out,
            prior=self.prior,
            method=self.method,
            delta=self.delta,
            n_dropped=n_dropped,
        )

    def score(self, probs: Any, labels: Any) -> np.ndarray:
        """Privacy risk score of each record, in [0, 1] (NaN where its probs are not finite)."""
        return self.risk(probs, labels).posterior

    @property
    def higher_is_member(self) -> bool:
        """Direction of the underlying metric (the score itself is always higher = member)."""
        return HIGHER_IS_MEMBER[self.metric]


class Calibration(NamedTuple):
    """Reliability curve of a membership score (Song & Mittal §4.2.1, Fig. 3).

    ``centers`` (bins,) bin centers on [0, 1]; ``observed`` (bins,) the member fraction of the
    records whose score falls in the bin (NaN when empty); ``counts`` (bins,) records per bin;
    ``rmse`` the root mean square gap between each record's bin member fraction and the bin's
    mean score, i.e. sqrt(Σ_b counts_b·(observed_b − mean score_b)² / Σ_b counts_b).

    Examples:
        >>> import numpy as np
        >>> from privmon.attacks import calibration
        >>> rng = np.random.default_rng(0)
        >>> scores = rng.random(2000)
        >>> curve = calibration(scores, rng.random(2000) < scores, bins=4)
        >>> curve.centers
        array([0.125, 0.375, 0.625, 0.875])
        >>> curve.observed.round(2)
        array([0.12, 0.4 , 0.61, 0.89])
    """

    centers: np.ndarray
    observed: np.ndarray
    counts: np.ndarray
    rmse: float


def calibration(scores: Any, is_member: Any, *, bins: int = 10) -> Calibration:
    """Binned reliability curve of membership probabilities and its RMSE (§4.2.1).

    ``scores``: predicted P(member) in [0, 1], shape (n,), e.g. :meth:`PrivacyRiskScore.score` of
    records the score was *not* fitted on; ``is_member``: their true membership (bool or 0/1);
    ``bins``: equal-width bins on [0, 1] (a score of exactly 1 goes to the last). Records with a
    NaN score are left out. The RMSE compares each bin's member fraction with the mean score of
    its records (not the bin center, which would add up to half a bin width of error to a
    perfectly calibrated score) and weights bins by their record counts, so sparsely populated
    bins do not dominate. The member fraction is comparable with the score when the share of
    members among the records equals the score's prior.

    Examples:
        >>> import numpy as np
        >>> from privmon.attacks import calibration
        >>> rng = np.random.default_rng(0)
        >>> scores = rng.random(1000)
        >>> is_member = rng.random(1000) < scores  # P(member | score) = score: calibrated
        >>> round(calibration(scores, is_member, bins=5).rmse, 2)
        0.03
        >>> round(calibration(np.full(1000, 0.9), is_member).rmse, 2)  # over-confident
        0.38
    """
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {shown(bins)}")
    s = to_numpy(scores).astype(np.float64) if isinstance(scores, torch.Tensor) else None
    if s is None:
        try:
            s = np.asarray(scores, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError("scores must be a numeric array of shape (n,)") from None
    m = to_numpy(is_member) if isinstance(is_member, torch.Tensor) else np.asarray(is_member)
    s, m = s.reshape(-1) if s.ndim == 2 and s.shape[1] == 1 else s, m.reshape(-1)
    if s.ndim != 1 or s.shape != m.shape:
        raise ValueError(
            f"scores and is_member must have the same shape (n,), got {s.shape} and {m.shape}"
        )
    if m.dtype != np.bool_:
        if not np.isin(m, (0, 1)).all():
            raise ValueError("is_member must hold booleans or 0 / 1")
        m = m.astype(bool)
    outside = (s < 0) | (s > 1)  # NaN is neither
    if outside.any():
        raise ValueError(f"scores must lie in [0, 1]; {positions(outside)} do not")
    keep = ~np.isnan(s)
    s, m = s[keep], m[keep]
    if s.size == 0:
        raise ValueError("scores has no non-NaN values")
    b = np.minimum((s * bins).astype(np.int64), bins - 1)
    counts = np.bincount(b, minlength=bins)
    members = np.bincount(b, weights=m.astype(np.float64), minlength=bins)
    sums = np.bincount(b, weights=s, minlength=bins)
    full = counts > 0
    observed = np.full(bins, np.nan)
    observed[full] = members[full] / counts[full]
    mean = sums[full] / counts[full]
    rmse = float(np.sqrt(np.sum(counts[full] * (observed[full] - mean) ** 2) / counts.sum()))
    centers = (np.arange(bins) + 0.5) / bins
    return Calibration(centers=centers, observed=observed, counts=counts, rmse=rmse)
