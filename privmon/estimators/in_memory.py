"""Stage 3, for scores kept in memory (beside the grid path of :mod:`~privmon.estimators.rules`):
above 2 dimensions the rule is learned by a classifier (:mod:`~privmon.estimators.learned`);
in 1-2 dimensions where a class's KDE bandwidth is below a grid cell, by exact Gaussian kernel
sums. Then certified and measured as on the grid."""

from __future__ import annotations

import math

import numpy as np
import torch

from privmon.estimators.certificate import certify
from privmon.estimators.density import GaussianKDE
from privmon.estimators.estimates import make_estimate
from privmon.estimators.folds import CERTIFY_FOLDS, fold_of
from privmon.estimators.learned import learned_rule_counts
from privmon.estimators.rules import bayes_rule

__all__ = [
    "KERNEL_SUM_RULE",
    "LEARNED_RULE",
    "KernelSumRule",
    "LearnedRule",
    "in_memory_estimate",
    "kde_rule_counts",
    "learned_rule",
    "rule_figures",
]


def kde_rule_counts(m, h, *, prior, bandwidth, ridge, folds, deltas):
    """The cross-fitted Gaussian-KDE rules' held-out true / false positives and the larger of
    the certificates (``CERTIFY_FOLDS``, at both δ) from exact kernel sums."""
    fm = fold_of(torch.arange(m.shape[0], device=m.device), folds)
    fh = fold_of(torch.arange(h.shape[0], device=m.device), folds)

    def predict(train_m, train_h, test, tie):
        """Rule on test points learned from the training records; (len(test),) in {0, tie, 1}."""
        kp = GaussianKDE(train_m, bandwidth=bandwidth, ridge=ridge, robust=True)
        kq = GaussianKDE(train_h, bandwidth=bandwidth, ridge=ridge, robust=True)
        diff = kp.log_density(test) + math.log(prior) - kq.log_density(test) - math.log(1 - prior)
        return bayes_rule(diff, diff.new_full((1,), tie), 1e-12)

    tp = fp = 0.0
    for k in range(folds):
        tm, th = m[fm != k], h[fh != k]
        if tm.shape[0] < 2 or th.shape[0] < 2:
            continue
        tp += float(predict(tm, th, m[fm == k], 0.5).sum())
        fp += float(predict(tm, th, h[fh == k], 0.5).sum())
    tie = float(prior > 0.5)
    counts = []  # each certificate's held-out members / non-members and its rule's positives
    for held_out in CERTIFY_FOLDS:
        folds_certified = torch.tensor(held_out, device=m.device)
        cm, ch = torch.isin(fm, folds_certified), torch.isin(fh, folds_certified)
        if int((~cm).sum()) < 2 or int((~ch).sum()) < 2:  # learns nothing: calls no member
            counts.append((float(cm.sum()), float(ch.sum()), 0.0, 0.0))
            continue
        tpc = float(predict(m[~cm], h[~ch], m[cm], tie).sum())
        fpc = float(predict(m[~cm], h[~ch], h[ch], tie).sum())
        counts.append((float(cm.sum()), float(ch.sum()), tpc, fpc))
    n1c, n2c, tpc, fpc = np.asarray(counts).T
    cert, cert_check = certify(tpc[None], n1c, fpc[None], n2c, prior, deltas)
    return tp, fp, float(cert[0]), float(cert_check[0])


def learned_rule(m, h, *, prior: float, folds: int, deltas: tuple[float, float], scale=None):
    """The learned rule (:mod:`privmon.estimators.learned`; densities lose most of a leak above
    2 dimensions): held-out true / false positives of the cross-fitted rules and the larger of
    the certificates at the run's δ share and at the call's δ. ``scale``: the scores' magnitude
    scaling (None: as given), which the rule's summaries divide out."""
    counts = learned_rule_counts(m, h, prior=prior, folds=folds, scale=scale)
    cert, cert_check = certify(
        np.asarray(counts.cert_tp)[None],
        np.asarray(counts.n1_cert),
        np.asarray(counts.cert_fp)[None],
        np.asarray(counts.n2_cert),
        prior,
        deltas,
    )
    return counts.tp, counts.fp, float(cert[0]), float(cert_check[0])


class LearnedRule:
    """The learned rule (:func:`learned_rule`): what every method measures above 2-D."""

    def figures(self, m, h, *, prior, folds, deltas, scale, bandwidth, ridge):
        """:func:`learned_rule` (``bandwidth`` and ``ridge`` unused)."""
        return learned_rule(m, h, prior=prior, folds=folds, deltas=deltas, scale=scale)


class KernelSumRule:
    """The Gaussian-KDE rule by exact kernel sums (:func:`kde_rule_counts`)."""

    def figures(self, m, h, *, prior, folds, deltas, scale, bandwidth, ridge):
        """:func:`kde_rule_counts` (``scale`` unused)."""
        return kde_rule_counts(
            m, h, prior=prior, bandwidth=bandwidth, ridge=ridge, folds=folds, deltas=deltas
        )


LEARNED_RULE = LearnedRule()
KERNEL_SUM_RULE = KernelSumRule()


def _extent(m: torch.Tensor, h: torch.Tensor):
    """The pooled scores' low corner, span (1 where a column is constant) and the tiny ridge
    that gives degenerate classes (point masses, dead units, collinear scores) a kernel without
    changing regular ones."""
    pooled = torch.cat([m, h])
    low, high = pooled.min(0).values, pooled.max(0).values
    span = torch.where(high > low, high - low, torch.ones_like(high))
    return low, span, 1e-6 * (span / 4) ** 2


def rule_figures(rule, m, h, *, prior, folds, deltas, scale, bandwidth):
    """``rule``'s figures (tp, fp, lower, lower_check) on the scores in memory."""
    ridge = _extent(m, h)[2]
    return rule.figures(
        m, h, prior=prior, folds=folds, deltas=deltas, scale=scale, bandwidth=bandwidth,
        ridge=ridge,
    )  # fmt: skip


def in_memory_estimate(
    m,
    h,
    *,
    method,
    prior,
    delta,
    lower_delta,
    bins,
    bandwidth,
    folds,
    n_samples,
    seed,
    n_dropped,
    scale=None,
    rule=None,
):
    """All scores in memory: ``method``'s (an :class:`~privmon.estimators.methods.
    EstimatorMethod`) rule (:meth:`memory_rule`: above 2 dimensions the learned rule, in 1-2
    dimensions with a bandwidth below one grid cell exact Gaussian kernel sums) and its
    plug-in as the paper defines it. ``scale``: the scores' magnitude scaling (None: as given);
    ``rule``: the rule's figures (tp, fp, lower, lower_check) when already learned."""
    deltas = (lower_delta, delta)
    low, span, ridge = _extent(m, h)
    if rule is None:
        rule = method.memory_rule(m.shape[1]).figures(
            m, h, prior=prior, folds=folds, deltas=deltas, scale=scale, bandwidth=bandwidth,
            ridge=ridge,
        )  # fmt: skip
    tp, fp, cert, cert_check = rule
    plugin = method.memory_plugin(
        m, h, prior=prior, bandwidth=bandwidth, bins=bins, low=low, span=span, ridge=ridge,
        n_samples=n_samples, seed=seed,
    )  # fmt: skip
    return make_estimate(
        plugin=plugin,
        tp=tp,
        fp=fp,
        n1=m.shape[0],
        n2=h.shape[0],
        cert=cert,
        cert_check=cert_check,
        prior=prior,
        delta=delta,
        lower_delta=lower_delta,
        method=method.name,
        n_dropped=n_dropped,
    )
