"""Per-record membership risk in the *specific* setup, its *average* counterpart, and the
comparison between the two.

Krčo, Guépin, Meeus, de Montjoye, "Lost in the Averages: A New Specific Setup to Evaluate
Membership Inference Attacks Against Machine Learning Models" (section numbers below refer to
it). The usual *average* evaluation (§3.2) trains each evaluation model on a dataset resampled
from a pool, so a record's risk is averaged over datasets; the *specific* setup (§3.3) keeps the
released model's training set fixed and varies only the training randomness, each target
swapped for a reference record in half of the models. :func:`specific` and :func:`average` train
``n_models`` models shared by all targets and score every target under each, giving its AUC and
TPR at a low FPR (:class:`~privmon.audit.results.AuditResult`);
:func:`~privmon.audit.results.compare` counts the high-risk records the average setup misses
(§3.4). Everything derives from ``seed``; the global RNGs are seeded for each ``train_fn`` /
``score_fn`` call and restored afterwards. Why the setups differ and how the models are shared:
docs, Theory page, *Specific and average setups*.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from privmon._digest import digest
from privmon._validation import (
    check_callable,
    check_flag,
    check_indices,
    check_int,
    check_open_unit,
)
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

    Examples:
        >>> import torch
        >>> from privmon.audit import default_score
        >>> _ = torch.manual_seed(0)
        >>> model, x, y = torch.nn.Linear(3, 2), torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        >>> torch.allclose(default_score(model, x, y), -losses)
        True
    """
    from privmon.queries import LossQuery

    return -_classifier_score(LossQuery, model, x, y)


def logit_score(model: Any, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """LiRA's statistic: the logit-scaled confidence ``log(p_y / (1 − p_y))`` of a classifier
    (:class:`privmon.queries.LogitConfidenceQuery`), the default ``score_fn`` of the LiRA
    attacks. Same model requirements and mode handling as :func:`default_score`.

    Examples:
        >>> import torch
        >>> from privmon.audit import logit_score
        >>> _ = torch.manual_seed(0)
        >>> model, x, y = torch.nn.Linear(3, 2), torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> p_y = model(x).softmax(dim=1)[torch.arange(4), y]
        >>> torch.allclose(logit_score(model, x, y), torch.log(p_y / (1 - p_y)))
        True
    """
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
       index, by a reference record (§3.3); non-target records never change;
    3. ``model = train_fn(x, y, model_seed)`` with ``model_seed`` derived from ``(seed, k)``
       (the global RNGs are also seeded with it during the call, then restored);
    4. ``score_fn(model, x_targets, y_targets)`` scores the targets' **original** records.

    Per target, the risk is the AUC / TPR at ``fpr`` of its scores, the models with the target
    in being the members and the others the non-members (App. C, Algorithm 1). The paper found
    ~100-200 evaluation models per setup give a stable AUC (App. B); a few dozen give a coarse
    screening. The models are shared by all targets: keep the targets a small fraction of the
    dataset, since about half of them are swapped out in each model.

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
        reference_draw: ``"per_model"`` (default): the reference records swapped in are drawn
            afresh for each model, without replacement within a model (§3.3 and §6);
            ``"fixed"``: target ``j`` is always replaced by ``reference`` record ``j``.
        attack: ``"threshold"`` (default): the risk reads the ``score_fn`` scores directly.
            ``"lira"`` / ``"lira_offline"``: each score is the LiRA score of the ``score_fn``
            statistic against other models as shadow models (offline: all the others; online:
            the other fold of the target's models split in halves, the figures averaged over
            the folds); ``score_fn`` then defaults to :func:`logit_score`.
        checkpoint_dir: a folder (created when missing) where each model's scores are saved as
            soon as it is scored; a later call with the same folder reads them and trains only
            the other models. A folder of another audit (fingerprint: the data, targets and
            reference bytes, ``reference_draw``, ``seed``, ``n_models``, the qualified names of
            ``train_fn`` and ``score_fn``) is refused, naming what differs. None: nothing saved.
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

    Examples:
        >>> import torch
        >>> from privmon.audit import specific
        >>> gen = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(40, 5, generator=gen), torch.randint(0, 2, (40,), generator=gen)
        >>> reference = torch.randn(8, 5, generator=gen), torch.randint(0, 2, (8,), generator=gen)
        >>> def train_fn(x, y, seed):  # privmon seeds the global RNGs with seed around the call
        ...     model = torch.nn.Linear(5, 2)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        ...     for _ in range(30):
        ...         optimizer.zero_grad()
        ...         torch.nn.functional.cross_entropy(model(x), y).backward()
        ...         optimizer.step()
        ...     return model
        >>> result = specific(train_fn, (x, y), [0, 1, 2], reference=reference, n_models=8, seed=0)
        >>> result.auc.shape, result.mask.shape  # per target; per model and target
        ((3,), (8, 3))
        >>> print(result.table(top=2))
        rank  target    AUC   TPR@0.1   in  out
           1       2  1.000     1.000    4    4
           2       1  0.938     0.750    4    4
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

    Examples:
        >>> import torch
        >>> from privmon.audit import average
        >>> pool = torch.randn(60, 3, generator=torch.Generator().manual_seed(0))  # unlabelled
        >>> def train_fn(x, y, seed):  # a "model" that memorizes: its training records
        ...     return x
        >>> def score_fn(model, x, y):  # minus the distance to the nearest training record
        ...     return -torch.cdist(x, model).min(dim=1).values
        >>> result = average(train_fn, pool, [0, 1], n_models=6, seed=0, score_fn=score_fn)
        >>> result.setup, result.auc
        ('average', array([1., 1.]))
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
