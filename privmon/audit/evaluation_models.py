"""The evaluation models of the specific and average setups (:mod:`privmon.audit.specific`):
the seeded in/out mask of the targets, and the driver that trains and scores each model (the
models split over torch.distributed ranks, each model's scores saved to a checkpoint folder)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from privmon._digest import digest
from privmon.audit.checkpoints import CheckpointFolder, qualified_name
from privmon.audit.distributed import exchange, plan
from privmon.audit.seeding import TAG_MASK, seeded_global_rng, stream

__all__ = ["EvaluationModels", "ScoreFn", "TrainFn", "balanced_mask", "evaluation_scores"]

TrainFn = Callable[[torch.Tensor, Any, int], Any]
ScoreFn = Callable[[Any, torch.Tensor, Any], Any]


def balanced_mask(seed: int, n_models: int, n_targets: int) -> np.ndarray:
    """(n_models, n_targets) in/out mask; each column a random arrangement of a balanced vector.

    Every entry is marginally Bernoulli(0.5) (the extra model of an odd ``n_models`` goes to
    "in" or "out" with probability 1/2 per target); each target is in exactly n_models // 2
    or n_models // 2 + 1 models, so both member and non-member sides are never empty.
    """
    rng = stream(seed, TAG_MASK)
    half = n_models // 2
    mask = np.zeros((n_models, n_targets), dtype=bool)
    extra = rng.random(n_targets) < 0.5 if n_models % 2 else np.zeros(n_targets, dtype=bool)
    for j in range(n_targets):
        col = np.zeros(n_models, dtype=bool)
        col[: half + int(extra[j])] = True
        mask[:, j] = rng.permutation(col)
    return mask


def _scores_row(out: Any, n_targets: int) -> np.ndarray:
    if isinstance(out, torch.Tensor):
        arr = out.detach().to("cpu", torch.float64).numpy()
    else:
        try:
            arr = np.asarray(out, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"score_fn must return {n_targets} numeric scores, got {type(out).__name__}"
            ) from None
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.shape != (n_targets,):
        raise ValueError(
            f"score_fn must return one score per target, shape ({n_targets},), "
            f"got shape {arr.shape}"
        )
    return arr


class EvaluationModels(NamedTuple):
    """How :func:`evaluation_scores` trains and records the models: the checkpoint folder (or
    None), whether to split them over the ranks, what the setup adds to the recipe's fingerprint
    and, in the specific setup, each model's reference draw (part of its fingerprint)."""

    checkpoint_dir: Any
    distributed: bool
    recipe: dict[str, str]
    draws: np.ndarray | None


def _fingerprint(
    k: int, model_seeds: np.ndarray, mask: np.ndarray, draws: np.ndarray | None
) -> dict[str, Any]:
    """What makes an evaluation model model k, as its checkpoint file records it."""
    out: dict[str, Any] = {"seed": int(model_seeds[k]), "mask": mask[k]}
    if draws is not None:
        out["draw"] = draws[k]
    return out


def evaluation_scores(
    setup: str,
    build: Callable[[int], tuple[torch.Tensor, torch.Tensor | None]],
    train_fn: TrainFn,
    score_fn: ScoreFn,
    records: tuple[torch.Tensor, torch.Tensor | None],
    targets: np.ndarray,
    mask: np.ndarray,
    model_seeds: np.ndarray,
    progress: bool,
    models: EvaluationModels,
) -> np.ndarray:
    """Train and score the evaluation models of ``setup``: model k trains on ``build(k)`` with
    seed ``model_seeds[k]`` (the global RNGs seeded with it for the call) and scores the records
    ``targets`` (indices into ``records``, the dataset or the pool). Returns the scores
    (n_models, n_targets), the same on every rank."""
    n_models, n_targets = mask.shape
    x, y = records
    t_torch = torch.as_tensor(targets, device=x.device)
    target_x, target_y = x[t_torch], None if y is None else y[t_torch]
    what = f"privmon.audit.{setup}"
    recipe = {
        "data": digest(x, y),
        "targets": digest(targets),
        **models.recipe,
        "train_fn": qualified_name(train_fn),
        "score_fn": qualified_name(score_fn),
        "n_models": str(n_models),
    }
    folder = None
    if models.checkpoint_dir is not None:
        folder = CheckpointFolder(models.checkpoint_dir, kind=setup, recipe=recipe, what=what)
    work = plan(
        n_models,
        {**recipe, "checkpoint_dir": str(folder is not None)},
        folder.present(n_models) if folder is not None else [],
        distributed=models.distributed,
        what=what,
    )
    rows: dict[int, np.ndarray] = {}
    error = None
    # tqdm on stderr; disable=None turns it off when stderr is not a terminal (CI logs, pipes)
    bar = tqdm(
        total=len(work.train),
        desc=f"privmon {setup} audit",
        unit="model",
        disable=None if progress else True,
    )
    try:
        if folder is not None:  # (without one on any rank, nothing is saved: work.load is empty)
            for k in work.load:
                fingerprint = _fingerprint(k, model_seeds, mask, models.draws)
                rows[k] = folder.load(k, fingerprint)["scores"].numpy()
        for k in work.train:
            x_k, y_k = build(k)
            s = int(model_seeds[k])
            with seeded_global_rng(s):
                model = train_fn(x_k, y_k, s)
                out = score_fn(
                    model, target_x.clone(), None if target_y is None else target_y.clone()
                )
            rows[k] = _scores_row(out, n_targets)
            del model, out
            if folder is not None:
                fingerprint = _fingerprint(k, model_seeds, mask, models.draws)
                folder.save(k, fingerprint, {"scores": rows[k]})
            bar.update(1)
    except Exception as err:
        error = err
    finally:
        bar.close()
    every = exchange(rows, error, world=work.world, stage=f"the {setup} audit's models")
    return np.stack([every[k] for k in range(n_models)])
