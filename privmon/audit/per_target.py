"""Per-target membership risk from the evaluation models' scores (specific and average setups,
:mod:`privmon.audit.specific`): each target's AUC / TPR at a low FPR, with the threshold attack
or LiRA (online and cross-fitted, or offline and leave one out)."""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import torch

from privmon.attacks.reference import FIXED_VARIANCE_BELOW, leave_one_out, lira_tensor
from privmon.audit.records import frozen
from privmon.audit.results import AuditResult
from privmon.audit.seeding import TAG_FOLDS, stream
from privmon.estimators.roc import auc as _auc
from privmon.estimators.roc import tpr_at_fpr as _tpr_at_fpr

__all__ = ["audit_result"]


def _per_target_metrics(
    scores: np.ndarray, mask: np.ndarray, fpr: float
) -> tuple[np.ndarray, np.ndarray, int]:
    n_targets = scores.shape[1]
    aucs = np.full(n_targets, np.nan)
    tprs = np.full(n_targets, np.nan)
    finite = np.isfinite(scores)
    for j in range(n_targets):
        s, m, f = scores[:, j], mask[:, j], finite[:, j]
        members, nonmembers = s[m & f], s[~m & f]
        if members.size == 0 or nonmembers.size == 0:
            continue
        aucs[j] = _auc(members, nonmembers)
        tprs[j] = _tpr_at_fpr(members, nonmembers, fpr=fpr)[fpr]
    return aucs, tprs, int((~finite).sum())


def audit_result(
    setup: str,
    targets: np.ndarray,
    mask: np.ndarray,
    scores: np.ndarray,
    fpr: float,
    seed: int,
    model_seeds: np.ndarray,
    replacement: np.ndarray | None,
    start: float,
    attack: str,
) -> AuditResult:
    """The :class:`AuditResult` of ``setup`` from the models' scores (n_models, n_targets):
    each target's AUC and TPR at ``fpr`` under ``attack``."""
    if attack == "lira":
        scores, fold = _cross_fitted_lira(scores, mask, seed)
        per_fold = [
            _per_target_metrics(np.where(fold == f, scores, np.nan), mask, fpr) for f in (0, 1)
        ]
        with warnings.catch_warnings():  # a target neither fold could score: NaN, counted
            warnings.simplefilter("ignore", RuntimeWarning)
            aucs = np.nanmean([r[0] for r in per_fold], axis=0)
            tprs = np.nanmean([r[1] for r in per_fold], axis=0)
        n_bad = int((~np.isfinite(scores)).sum())
    else:
        if attack == "lira_offline":
            scores = leave_one_out(scores, mask, attack=attack)
        aucs, tprs, n_bad = _per_target_metrics(scores, mask, fpr)
    return AuditResult(
        setup=setup,
        targets=frozen(targets),
        mask=frozen(mask),
        scores=frozen(scores),
        auc=frozen(aucs),
        tpr=frozen(tprs),
        fpr=fpr,
        seed=seed,
        model_seeds=frozen(model_seeds),
        replacement=None if replacement is None else frozen(replacement),
        n_nonfinite=n_bad,
        attack=attack,
        elapsed_s=time.perf_counter() - start,
    )


def _cross_fitted_lira(
    statistic: np.ndarray, mask: np.ndarray, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Online LiRA (Carlini et al. eq. 4) per model and target, each model scored against the
    in and out Gaussians of the other fold: the scores (k, n) and the folds (k, n) in {0, 1}.

    For each target the models that trained on it, and those that did not, are split in
    halves at random (seeded by ``seed``; an odd one out goes to fold 1), so each fold holds
    half of the target's members and half of its non-members. Leaving only the scored model out (as
    :func:`~privmon.attacks.reference.leave_one_out` does) biases a per-target AUC low: the
    scored model's own statistic is missing from the fit of its side, which lowers a member's
    score and raises a non-member's (mean AUC 0.44 at 64 models on a statistic without
    signal). With disjoint folds the fits know nothing of the models they score, and the
    per-target AUC and TPR are taken within each fold and averaged
    (``benchmarks/specific_null.py``). Each fit sees about half of the models, with a fixed
    variance below 128 models (fewer than 64 per fit)."""
    rng = stream(seed, TAG_FOLDS)
    keys = rng.random(mask.shape)
    fold = np.zeros(mask.shape, dtype=np.int64)
    for side in (True, False):
        on_side = mask == side
        rank = np.argsort(np.argsort(np.where(on_side, keys, np.inf), axis=0), axis=0)
        fold[on_side & (rank >= on_side.sum(axis=0) // 2)] = 1
    stat = torch.as_tensor(statistic, dtype=torch.float64)
    m, f = torch.as_tensor(mask), torch.as_tensor(fold)
    fixed = stat.shape[0] // 2 < FIXED_VARIANCE_BELOW
    out = torch.full_like(stat, math.nan)
    for held in (0, 1):
        references = torch.where(f == held, math.nan, stat)  # the other fold's models only
        # one fit per fold; lira_tensor broadcasts the (n,) fits over all k models' statistics
        score = lira_tensor(stat, references, m, online=True, fixed_variance=fixed)
        out = torch.where(f == held, score, out)
    return out.numpy(), fold
