"""Per-record membership risk in the *specific* setup, its *average* counterpart, and the
comparison between the two.

Source: Krčo, Guépin, Meeus, de Montjoye, "Lost in the Averages: A New Specific Setup to Evaluate
Membership Inference Attacks Against Machine Learning Models" (section numbers below refer to
it).

Why. The usual (*average*, §3.2) evaluation trains each evaluation model on a dataset resampled
from a larger pool, with the target record in half of them. Its per-record risk is the risk
averaged over datasets, and the risk of a record depends strongly on the dataset it sits in
(outliers of one sample are often not outliers of another). The *specific* setup (§3.3) keeps the
released model's training set ``D`` fixed and uses the training randomness (seed / weight
initialisation) as the only source of randomness: half of the evaluation models are trained on
``D``, the other half on ``D`` with the target swapped for a reference record. On the paper's
datasets 67-100 % of the records that are high-risk in the specific setup are classified low-risk
by the average one (Tables 1-2, the *miss rate* of §3.4).

What this module computes.

* :func:`specific` (§3.3, App. C Algorithm 1). ``dataset`` is fixed. For model ``k`` a seeded
  balanced mask decides for every target whether it is *in* (its own record at its index) or
  *out* (a reference record swapped in at its index); the model is trained on the resulting set
  with a training seed derived from ``(seed, k)``, then every target's **original** record is
  scored. All targets share the same models, so the cost is ``n_models`` trainings in total, not
  ``2 * n_models`` per target. Consequence: in one model about half the targets are swapped at
  once, so keep the targets a small fraction of the dataset (the paper audits one target at a
  time; sharing models trades a slightly perturbed ``D`` for a cost independent of the number of
  targets).
* :func:`average` (§3.2, App. C Algorithm 2). Same mask and training seeds, but model ``k``'s
  training set is drawn afresh from ``pool``: ``dataset_size`` records, the *in* targets plus
  non-target records sampled without replacement.
* Per target, the attack's performance over the models (§3.1 "privacy risk"): members are the
  models trained with the target, non-members those trained without it; the risk is the ROC AUC
  (:func:`privmon.estimators.roc.auc`) and the TPR at FPR 0.1
  (:func:`privmon.estimators.roc.tpr_at_fpr`). The attack is a score threshold, by default the
  loss attack (negative cross-entropy, higher = member).
* :func:`~privmon.audit.results.compare` (§3.4): miss rate, RMSE and Pearson correlation
  between the per-target risks of the two setups, plus the §6 Theorem 1 reference value
  ``sqrt(var_avg / var_spec)``.

Randomness. Everything derives from ``seed`` through ``numpy.random.SeedSequence`` (one stream
for the mask, one per model for the reference draw / dataset sampling, one per model for the
training seed), so a result reproduces from its seed. The global RNGs (``random``, numpy's
legacy global, torch CPU and CUDA) are saved before each ``train_fn`` / ``score_fn`` call,
seeded with that model's training seed for the call (so a ``train_fn`` that never seeds anything
is still reproducible) and restored afterwards: the caller's global RNG state is left untouched.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from privmon._validation import (
    check_callable,
    check_flag,
    check_indices,
    check_int,
    check_open_unit,
)
from privmon.audit.checkpoints import digest
from privmon.audit.evaluation_models import (
    EvaluationModels,
    ScoreFn,
    TrainFn,
    balanced_mask,
    evaluation_scores,
)
from privmon.audit.per_target import audit_result
from privmon.audit.records import as_xy
from privmon.audit.results import AuditResult
from privmon.audit.seeding import TAG_DATA, stream, training_seeds

__all__ = ["average", "default_score", "logit_score", "specific"]

_ATTACKS = ("threshold", "lira", "lira_offline")
# online LiRA's folds each need two members and two non-members of a target; offline LiRA
# scores a model against the others (leave one out), two of them out
_MIN_MODELS = {"threshold": 2, "lira": 8, "lira_offline": 4}


def default_score(model: Any, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """Loss attack: the negative per-record cross-entropy of a classifier (higher = member).

    ``model`` must be an ``nn.Module`` returning logits ``(n, C)`` (or one logit per record for
    a binary classifier, read as ``[0, z]`` as in :mod:`privmon.queries`). It is run in eval mode
    under ``torch.no_grad()`` and its train / eval modes are restored afterwards.
    """
    from privmon.queries import LossQuery

    return -_classifier_score(LossQuery, model, x, y)


def logit_score(model: Any, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """LiRA's statistic: the logit-scaled confidence ``log(p_y / (1 − p_y))`` of a classifier
    (:class:`privmon.queries.LogitConfidenceQuery`), the default ``score_fn`` of the LiRA
    attacks. Same model requirements and mode handling as :func:`default_score`."""
    from privmon.queries import LogitConfidenceQuery

    return _classifier_score(LogitConfidenceQuery, model, x, y)


def _classifier_score(query: Any, model: Any, x: torch.Tensor, y: torch.Tensor | None):
    if not isinstance(model, nn.Module):
        raise TypeError(
            "the default score_fn needs train_fn to return a torch.nn.Module classifier, got "
            f"{type(model).__name__}; pass score_fn=lambda model, x, y: scores"
        )
    if y is None:
        raise ValueError(
            "the default score_fn (loss or logit attack) needs labels: pass dataset = (x, y)"
        )
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return query(model)((x, y))
    finally:
        for m, mode in modes:
            m.training = mode


def _common_checks(
    train_fn: Any, score_fn: Any, n_models: Any, seed: Any, fpr: Any, attack: Any
) -> tuple[ScoreFn, int, int, float]:
    check_callable(train_fn, name="train_fn")
    if attack not in _ATTACKS:
        raise ValueError(f"attack must be one of {_ATTACKS}, got {attack!r}")
    if score_fn is None:
        score_fn = default_score if attack == "threshold" else logit_score
    check_callable(score_fn, name="score_fn")
    return (
        score_fn,
        # LiRA scores a target in a model against the other models with it in and out
        check_int(n_models, name="n_models", minimum=_MIN_MODELS[attack]),
        check_int(seed, name="seed"),
        check_open_unit(fpr, name="fpr"),
    )


def specific(
    train_fn: TrainFn,
    dataset: Any,
    targets: Sequence[int] | np.ndarray,
    *,
    n_models: int,
    seed: int,
    reference: Any = None,
    score_fn: ScoreFn | None = None,
    progress: bool = False,
    fpr: float = 0.1,
    reference_draw: str = "per_model",
    attack: str = "threshold",
    checkpoint_dir: str | os.PathLike[str] | None = None,
    distributed: bool = True,
) -> AuditResult:
    """Per-record membership risk of a model trained on *this* dataset (specific setup, §3.3).

    The training set is fixed; only the training seed varies. For model ``k = 0 .. n_models-1``:

    1. the mask row ``k`` says, for each target, *in* or *out* (seeded, balanced per target,
       marginally Bernoulli(0.5); see :attr:`AuditResult.mask`);
    2. the training set is ``dataset`` with every *out* target's row replaced, at the same
       index, by a reference record (§3.3: "D with x swapped out for a reference record x'");
       the *in* targets keep their own record; non-target records never change;
    3. ``model = train_fn(x, y, model_seed)`` with ``model_seed`` derived from ``(seed, k)``
       (the global RNGs are also seeded with it during the call, then restored);
    4. ``score_fn(model, x_targets, y_targets)`` scores the targets' **original** records.

    Per target, the risk is the AUC / TPR at ``fpr`` of its scores, the models with the target
    in being the members and the others the non-members (App. C, Algorithm 1, with the loss
    attack in place of a trained meta-classifier unless ``score_fn`` says otherwise). The paper
    found ~100-200 evaluation models per setup give a stable AUC (App. B); a few dozen give a
    coarse screening.

    Args:
        train_fn: ``train_fn(x, y, seed) -> model``: trains a fresh model on the given set
            (``y`` is None for an unlabelled dataset). It receives copies; it may seed and use
            the global RNGs freely.
        dataset: the fixed training set ``D``: a tuple ``(x, y)`` of arrays / tensors with one
            row per record (always read as features and labels), a ``TensorDataset``, a single
            array (unlabelled), or a list / map-style dataset of ``(x_i, y_i)`` records.
        targets: indices into ``dataset`` of the records to audit (distinct).
        n_models: number of evaluation models (>= 2; >= 4 with LiRA), shared by all targets:
            the cost is ``n_models`` trainings whatever the number of targets.
        seed: non-negative integer; the mask, the reference draws and the training seeds derive
            from it, so the result reproduces from it.
        reference: the replacement records, same format and feature shape as ``dataset`` and
            disjoint from it (e.g. held-out records of the same distribution); at least
            ``len(targets)`` records. Required.
        score_fn: ``score_fn(model, x, y) -> scores`` of shape ``(len(targets),)``, higher =
            more likely a member. Default: :func:`default_score` (negative cross-entropy).
        progress: show a progress bar (tqdm) on stderr when it is a terminal.
        fpr: the low false-positive rate of the TPR figure (the paper's 0.1).
        attack: ``"threshold"`` (default): the per-target risk reads the ``score_fn`` scores
            directly (§3.1's threshold on one score). ``"lira"`` / ``"lira_offline"``: LiRA
            (Carlini et al., "Membership Inference Attacks From First Principles", eq. 4 and
            §VI-A), as the paper's §5 audits ML models: in model ``k`` a target's score is the
            LiRA score of its ``score_fn`` statistic against other models as shadow models (the
            ones with the target in / out). ``"lira_offline"``: against all the other models
            (:func:`privmon.attacks.reference.leave_one_out`). ``"lira"`` (online): against
            the other fold of a split of each target's members and non-members in halves, the
            per-target AUC / TPR taken within each fold and averaged (leaving only the scored
            model out biases an online per-target AUC low, to 0.44 at 64 models where nothing
            leaks: ``benchmarks/specific_null.py``). A fixed variance below 64 shadow models
            per fit. ``score_fn`` then defaults to :func:`logit_score` (the logit-scaled
            confidence).
        reference_draw: ``"per_model"`` (default): for each model, the reference records swapped
            in are drawn at random, without replacement within a model (the paper samples the
            reference record, §3.3 and §6); ``"fixed"``: target ``j`` is always replaced by
            ``reference`` record ``j``.
        checkpoint_dir: a folder (created when missing) where each model's scores of the
            targets are saved as soon as it is scored, with its seed, mask row and reference
            draw and the audit's fingerprint (the data, targets and reference records' bytes,
            ``reference_draw``, ``seed``, ``n_models``, and the qualified names of ``train_fn``
            and ``score_fn``: a changed body under the same name goes unnoticed); a later call
            with the same folder reads the saved scores and trains only the other models. A
            folder of another audit is refused, naming what differs. None (default): nothing
            is saved.
        distributed: True (default): called on every rank of an initialised default process
            group with the same arguments, the models are split over the ranks
            (:func:`privmon.audit.train_ensemble` explains how) and every rank returns the
            result of one process; False: every model in this process.

    Returns:
        An :class:`AuditResult` with ``setup="specific"``.

    Raises:
        ValueError / TypeError naming the argument: ``n_models < 2``, a negative or
            non-integer ``seed``, targets out of range or repeated, ``reference`` missing,
            smaller than ``len(targets)`` or of another feature shape, a non-callable
            ``train_fn`` / ``score_fn``, a ``score_fn`` returning the wrong shape.
    """
    start = time.perf_counter()
    score_fn, n_models, seed, fpr = _common_checks(train_fn, score_fn, n_models, seed, fpr, attack)
    distributed = check_flag(distributed, name="distributed")
    if reference_draw not in ("per_model", "fixed"):
        raise ValueError(f"reference_draw must be 'per_model' or 'fixed', got {reference_draw!r}")
    x, y = as_xy(dataset, name="dataset")
    t = check_indices(targets, x.shape[0], what="dataset")
    if reference is None:
        raise ValueError(
            "reference is required: records (same format as dataset) swapped in for a target "
            f"when it is out; at least len(targets) = {t.size} of them"
        )
    rx, ry = as_xy(reference, name="reference")
    if rx.shape[0] < t.size:
        raise ValueError(
            f"reference must hold at least len(targets) = {t.size} records, got {rx.shape[0]}"
        )
    if rx.shape[1:] != x.shape[1:]:
        raise ValueError(
            f"reference records must have the dataset's feature shape {tuple(x.shape[1:])}, "
            f"got {tuple(rx.shape[1:])}"
        )
    if (y is None) != (ry is None) or (
        y is not None and ry is not None and ry.shape[1:] != y.shape[1:]
    ):
        raise ValueError("reference must be labelled like dataset (both (x, y) or both unlabelled)")
    rx = rx.to(device=x.device, dtype=x.dtype)
    if y is not None and ry is not None:  # both or neither (checked above)
        ry = ry.to(device=y.device, dtype=y.dtype)

    mask = balanced_mask(seed, n_models, t.size)
    model_seeds = training_seeds(seed, n_models)
    n_ref = rx.shape[0]
    replacement = np.full((n_models, t.size), -1, dtype=np.int64)
    for k in range(n_models):
        if reference_draw == "fixed":
            chosen = np.arange(t.size)
        else:
            chosen = stream(seed, TAG_DATA, k).choice(n_ref, size=t.size, replace=False)
        replacement[k] = np.where(mask[k], -1, chosen)

    def build(k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = ~mask[k]
        pos = torch.as_tensor(t[out], device=x.device)
        src = torch.as_tensor(replacement[k][out], device=x.device)
        x_k = x.clone()
        x_k[pos] = rx[src]
        y_k = None
        if y is not None and ry is not None:
            y_k = y.clone()
            y_k[pos] = ry[src]
        return x_k, y_k

    recipe = {"reference": digest(rx, ry), "reference_draw": reference_draw, "seed": str(seed)}
    models = EvaluationModels(checkpoint_dir, distributed, recipe, replacement)
    scores = evaluation_scores(
        "specific", build, train_fn, score_fn, (x, y), t, mask, model_seeds, progress, models
    )
    return audit_result(
        "specific", t, mask, scores, fpr, seed, model_seeds, replacement, start, attack
    )


def average(
    train_fn: TrainFn,
    pool: Any,
    targets: Sequence[int] | np.ndarray,
    *,
    n_models: int,
    seed: int,
    dataset_size: int | None = None,
    score_fn: ScoreFn | None = None,
    progress: bool = False,
    fpr: float = 0.1,
    attack: str = "threshold",
    checkpoint_dir: str | os.PathLike[str] | None = None,
    distributed: bool = True,
) -> AuditResult:
    """Per-record membership risk averaged over datasets (the usual *average* setup, §3.2).

    The counterpart of :func:`specific` in which the dataset varies too (App. C, Algorithm 2).
    For model ``k``: the same balanced in/out mask as :func:`specific` with the same ``seed``
    (and the same training seeds), and a training set of ``dataset_size`` records drawn afresh
    from ``pool``: the *in* targets plus ``dataset_size - n_in`` non-target records sampled
    without replacement, in random order. Per-target AUC / TPR at ``fpr`` as in :func:`specific`.

    To compare the two setups with :func:`~privmon.audit.results.compare`, audit the same
    records in the same order (``targets`` here index ``pool``, there ``dataset``) and use
    ``dataset_size = len(dataset)``.

    Args:
        pool: the evaluation pool (same formats as ``dataset`` in :func:`specific`); the paper's
            pool contains the target dataset (§3.1).
        targets: indices into ``pool`` of the records to audit.
        dataset_size: records per training set; default ``len(pool) // 2``. Must lie in
            ``[len(targets), len(pool) - len(targets)]`` so that every draw is possible.
        checkpoint_dir: as in :func:`specific` (the fingerprint covers the pool's bytes and
            ``dataset_size`` in place of the dataset and reference records).
        Others: as in :func:`specific`.

    Returns:
        An :class:`AuditResult` with ``setup="average"`` (``replacement`` is None).
    """
    start = time.perf_counter()
    score_fn, n_models, seed, fpr = _common_checks(train_fn, score_fn, n_models, seed, fpr, attack)
    distributed = check_flag(distributed, name="distributed")
    x, y = as_xy(pool, name="pool")
    n = x.shape[0]
    t = check_indices(targets, n, what="pool")
    if dataset_size is None:
        dataset_size = n // 2
    size = check_int(dataset_size, name="dataset_size", minimum=1)
    if not t.size <= size <= n - t.size:
        raise ValueError(
            f"dataset_size must lie in [len(targets), len(pool) - len(targets)] = "
            f"[{t.size}, {n - t.size}], got {size}"
        )
    mask = balanced_mask(seed, n_models, t.size)
    model_seeds = training_seeds(seed, n_models)
    others = np.setdiff1d(np.arange(n), t)

    def build(k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        rng = stream(seed, TAG_DATA, k)
        members = t[mask[k]]
        drawn = rng.choice(others, size=size - members.size, replace=False)
        idx = torch.as_tensor(rng.permutation(np.concatenate([members, drawn])), device=x.device)
        return x[idx].clone(), None if y is None else y[idx].clone()

    models = EvaluationModels(
        checkpoint_dir, distributed, {"dataset_size": str(size), "seed": str(seed)}, None
    )
    scores = evaluation_scores(
        "average", build, train_fn, score_fn, (x, y), t, mask, model_seeds, progress, models
    )
    return audit_result("average", t, mask, scores, fpr, seed, model_seeds, None, start, attack)
