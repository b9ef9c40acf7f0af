"""Shadow models trained together: k small models of one architecture as one batched ensemble.

Reference-model attacks (:mod:`privmon.attacks.reference`) need many shadow models, each trained
on its own subset of the data. :func:`train_ensemble` stacks their parameters
(``torch.func.stack_module_state``) and steps them together under ``torch.vmap``, each on its own
mini-batches (a linear stack runs as batched matrix products, :mod:`privmon.models.linear_stack`),
instead of paying the per-step overhead k times. The training protocol, stacked or one model
after another: :mod:`privmon.audit.loops`. Past one process it splits the models over the ranks
of a torch.distributed group (:mod:`privmon.audit.distributed`) and saves each to a checkpoint
folder (:mod:`privmon.audit.checkpoints`); a rank's share gives each model the parameters the
whole ensemble gives it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from privmon._digest import digest
from privmon._validation import as_mask, check_callable, check_flag, check_int
from privmon.audit.checkpoints import CheckpointFolder, code_digest, portable, qualified_name
from privmon.audit.distributed import exchange, plan
from privmon.audit.loops import (
    LossFn,
    OptimizerFn,
    check_stackable,
    initialised_model,
    step_shapes,
    train_one,
    train_stacked,
)
from privmon.audit.records import as_xy
from privmon.audit.seeding import (
    TAG_HALVES,
    global_rngs_restored,
    seeded_global_rng,
    stream,
    training_seeds,
)
from privmon.models import Ensemble

__all__ = ["random_halves", "train_ensemble"]


def random_halves(n_records: int, n_models: int, *, seed: int) -> np.ndarray:
    """Membership masks (n_models, n_records): model i trains on a uniformly random subset of
    exactly ``n_records // 2`` records, independently of the other models, so each record is in
    about half of the models, as Carlini et al. train their shadow models. Reproducible from
    ``seed``.

    Examples:
        >>> from privmon.audit import random_halves
        >>> masks = random_halves(6, 4, seed=0)
        >>> masks.shape, masks.sum(axis=1)
        ((4, 6), array([3, 3, 3, 3]))
    """
    n = check_int(n_records, name="n_records", minimum=2)
    k = check_int(n_models, name="n_models", minimum=1)
    rng = stream(check_int(seed, name="seed"), TAG_HALVES)
    keys = rng.random((k, n))
    order = np.argsort(keys, axis=1)
    masks = np.zeros((k, n), dtype=bool)
    np.put_along_axis(masks, order[:, : n // 2], True, axis=1)
    return masks


_WHAT = "train_ensemble"


def train_ensemble(
    model_fn: Callable[[], nn.Module],
    data: Any,
    masks: Any,
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFn,
    epochs: int,
    batch_size: int | None = None,
    seed: int,
    stacked: bool = True,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    distributed: bool = True,
) -> Ensemble:
    """Train one model per row of ``masks``, each on its own records, all with one recipe.

    Past one process: called on every rank of an initialised default process group
    (``torchrun``; any backend) with the same arguments, the models are split over the ranks,
    each rank training its contiguous share as one batched ensemble on its own device (``x``'s),
    and every rank returns the whole ensemble, the one a single process trains (model i's seed
    and mask depend only on ``(seed, i)``). A failure on one rank raises on every rank; a rank
    that dies leaves the others with an error at the process group's timeout. Under NCCL set
    each rank's device first (``torch.cuda.set_device``): the models travel through it.

    Checkpoints: with ``checkpoint_dir``, every model is saved there as soon as it is trained
    (one file per model; stacked, when its share's training ends) with its seed, mask and
    initial parameters' digest and the recipe's fingerprint; a later call with the same folder
    loads the models it finds and trains only the others. A file from another recipe or model
    is refused, naming what differs. The fingerprint covers what can be read without running
    code: the data (bytes, dtype and shape of ``x`` and ``y``), the architecture (the module's
    repr, parameter and buffer names, shapes, dtypes), each model's initial parameters (bytes),
    seed and mask, the optimizer's class and hyperparameters (from ``optimizer`` called on the
    first model's parameters), ``loss_fn``'s qualified name (the main script's ``__main__``
    in every process: a folder ``mp.spawn`` ranks wrote resumes in one process) and its code's
    digest (another body under the same name is refused; a closure's captured values are not
    read), ``epochs``, the batch size and ``stacked``. Each file also holds a digest of all it
    holds: a damaged file (a flipped bit) is refused, naming it. Loading uses
    ``torch.load(weights_only=True)``. Under torch.distributed the folder may be shared by the
    ranks or local to each (a model saved in any rank's folder is not trained again).

    Args:
        model_fn: ``model_fn() -> nn.Module``, a fresh model (privmon seeds the global RNGs
            around the call, so its initialisation is model i's seed).
        data: the training records ``(x, y)`` (tensors / arrays with one row per record; also a
            ``TensorDataset`` or a list of ``(x_i, y_i)``); the models train on ``x``'s device.
        masks: (k, n) bool, ``masks[i, j]``: record j is in model i's training set (e.g.
            :func:`random_halves`). Every model needs at least one record.
        loss_fn: ``loss_fn(outputs, targets) -> (b,)`` per-record losses (e.g.
            ``lambda out, y: F.cross_entropy(out, y, reduction="none")``); privmon averages
            them over each model's batch.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` (e.g.
            ``lambda p: torch.optim.Adam(p, lr=1e-2)``); elementwise optimizers only when
            ``stacked`` (:mod:`privmon.audit.loops`).
        epochs: passes over each model's records (>= 1).
        batch_size: records per step (>= 1); None: full batch (one step per epoch).
        seed: non-negative integer; model i's seed derives from ``(seed, i)``.
        stacked: True (default): one vmapped ensemble; False: one model after another with the
            same protocol (any model, e.g. with dropout or BatchNorm).
        checkpoint_dir: a folder (created when missing) to save each trained model in and to
            resume from; None (default): nothing is saved.
        distributed: True (default): split the models over the ranks of the default process
            group when one is initialised (call on every rank); False: train them all in this
            process (e.g. on rank 0 only).

    Returns:
        An :class:`Ensemble` (parameters on ``x``'s device), the same on every rank.

    Raises:
        ValueError / TypeError naming the argument: malformed ``data`` or ``masks``, a model
            without records, ``epochs`` / ``batch_size`` out of range, a ``loss_fn`` that does
            not return one loss per record, with ``stacked`` models that cannot be stacked or
            member counts that give the models different numbers of batches per epoch; a
            ``checkpoint_dir`` holding models of another recipe, data or mask, or a damaged
            file; ranks called
            with different arguments. RuntimeError on every rank when training failed on one.

    Examples:
        >>> import torch
        >>> from privmon.audit import random_halves, train_ensemble
        >>> gen = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen)
        >>> ensemble = train_ensemble(
        ...     lambda: torch.nn.Linear(4, 2),
        ...     (x, y),
        ...     random_halves(32, 8, seed=0),  # model i trains on the records masks[i] marks
        ...     loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
        ...     optimizer=lambda params: torch.optim.Adam(params, lr=0.05),
        ...     epochs=20,
        ...     seed=0,
        ... )
        >>> ensemble(x).shape  # (models, records, classes)
        torch.Size([8, 32, 2])
        >>> ensemble.model(0)
        Linear(in_features=4, out_features=2, bias=True)
    """
    check_callable(model_fn, name="model_fn")
    check_callable(loss_fn, name="loss_fn")
    check_callable(optimizer, name="optimizer")
    epochs = check_int(epochs, name="epochs", minimum=1)
    stacked = check_flag(stacked, name="stacked")
    distributed = check_flag(distributed, name="distributed")
    seed = check_int(seed, name="seed")
    x, y = as_xy(data, name="data")
    if y is None:
        raise ValueError("data must be a pair (x, y): the loss needs targets")
    m = _checked_masks(masks, x.shape[0])
    sizes = m.sum(dim=1).tolist()
    bs = _checked_batch_size(batch_size, sizes, stacked=stacked)
    k = len(sizes)
    masks_np = m.cpu().numpy()
    seeds = training_seeds(seed, k)
    with global_rngs_restored():
        template = initialised_model(model_fn, int(seeds[0]), x.device)
    if stacked:
        check_stackable(template, padded=min(sizes) != max(sizes))
    recipe = _recipe_fingerprint(
        template, x, y, loss_fn, optimizer, epochs=epochs, bs=bs, stacked=stacked
    )
    folder = None
    if checkpoint_dir is not None:
        folder = CheckpointFolder(checkpoint_dir, kind="model", recipe=recipe, what=_WHAT)
    work = plan(
        k,
        {
            **recipe,
            "masks": digest(masks_np),
            "seed": str(seed),
            "checkpoint_dir": str(folder is not None),
        },
        folder.present(k) if folder is not None else [],
        distributed=distributed,
        what=_WHAT,
    )
    rows = [torch.nonzero(r).squeeze(1).to(x.device) for r in m]
    mine: dict[int, _Trained] = {}
    error = None
    try:
        if folder is not None:  # (without one on any rank, nothing is saved: work.load is empty)
            mine.update(_loaded(folder, work.load, model_fn, seeds, masks_np, x.device))
        if work.train:
            training = _Training(
                loss_fn, optimizer, epochs, bs, seed, stacked, step_shapes(sizes, bs), work.rank
            )
            trained = _train_share(
                model_fn, x, y, rows, work.train, seeds, masks_np, training, folder
            )
            mine.update(trained)
    except Exception as err:
        error = err
    if work.world > 1:  # CPU copies, each model's own (not views of a stacked tensor)
        mine = {i: _Trained(portable(p), portable(b), r) for i, (p, b, r) in mine.items()}
    every = exchange(mine, error, world=work.world, stage="training the shadow models")
    return _stacked_ensemble(every, template.eval(), seeds, masks_np, x.device)


def _checked_masks(masks: Any, n: int) -> torch.Tensor:
    """``masks`` as a (k, n) boolean tensor in which every model has a training record."""
    if not isinstance(masks, torch.Tensor):
        masks = np.asarray(masks)
    if masks.ndim != 2:
        raise ValueError(
            f"masks must be a boolean array of shape (k, {n}), one row per model, got shape "
            f"{tuple(masks.shape)}"
        )
    m = as_mask(masks, name="masks", shape=(len(masks), n))
    sizes = m.sum(dim=1).tolist()
    if min(sizes) == 0:
        raise ValueError(f"masks: model {sizes.index(0)} has no training record")
    return m


def _checked_batch_size(batch_size: Any, sizes: list[int], *, stacked: bool) -> int:
    """The records per step (None: the largest member count, full batch); stacked models step
    together, so their member counts must give them the same number of batches per epoch."""
    bs = max(sizes) if batch_size is None else check_int(batch_size, name="batch_size", minimum=1)
    if stacked:
        n_batches = sorted({math.ceil(s / bs) for s in sizes})
        if len(n_batches) > 1:
            raise ValueError(
                f"masks give the models {min(sizes)} to {max(sizes)} records, so {n_batches[0]} "
                f"to {n_batches[-1]} batches of batch_size {bs} per epoch; stacked models step "
                "together and need the same number: use equal member counts (random_halves), "
                "full batch (batch_size=None) or stacked=False"
            )
    return bs


class _Trained(NamedTuple):
    """One model's parameters and buffers (by name), and the rank that trained it (-1: loaded
    from the checkpoint folder)."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    rank: int


class _Training(NamedTuple):
    """How a rank trains its share (the arguments of :func:`train_ensemble` it reads)."""

    loss_fn: LossFn
    optimizer: OptimizerFn
    epochs: int
    batch_size: int
    seed: int
    stacked: bool
    shapes: list[tuple[int, bool]]
    rank: int


def _model_fingerprint(model: nn.Module, seed: Any, mask: np.ndarray) -> dict[str, Any]:
    """What makes a model model i, as its checkpoint file records it: seed, mask and the digest
    of its initial parameters and buffers (read before training)."""
    state = model.state_dict()
    return {"seed": int(seed), "mask": mask, "init": digest(*(state[k] for k in sorted(state)))}


def _recipe_fingerprint(
    template: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    optimizer: OptimizerFn,
    *,
    epochs: int,
    bs: int,
    stacked: bool,
) -> dict[str, str]:
    """The fingerprint of what every model of :func:`train_ensemble` shares (its docstring)."""
    layout = [(k, tuple(v.shape), str(v.dtype)) for k, v in template.state_dict().items()]
    probe = [p.detach().clone().requires_grad_(True) for p in template.parameters()]
    opt = optimizer(probe)
    groups = [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in opt.param_groups]
    return {
        "data": digest(x, y),
        "model": f"{template!r} {layout}",
        "optimizer": f"{qualified_name(type(opt))} {groups}",
        "loss_fn": qualified_name(loss_fn),
        "loss_fn code": code_digest(loss_fn),
        "training": f"epochs={epochs}, batch_size={bs}, stacked={stacked}",
    }


def _loaded(
    folder: CheckpointFolder,
    indices: list[int],
    model_fn: Callable[[], nn.Module],
    seeds: np.ndarray,
    masks: np.ndarray,
    device: torch.device,
) -> dict[int, _Trained]:
    """Models ``indices`` read from ``folder``, each checked against its fingerprint (the
    initial parameters of a model built again from its seed)."""
    loaded: dict[int, _Trained] = {}
    for i in indices:
        with global_rngs_restored():
            model = initialised_model(model_fn, int(seeds[i]), device)
        contents = folder.load(i, _model_fingerprint(model, seeds[i], masks[i]))
        loaded[i] = _Trained(contents["params"], contents["buffers"], -1)
    return loaded


def _train_share(
    model_fn: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    rows: list[torch.Tensor],
    indices: list[int],
    seeds: np.ndarray,
    masks: np.ndarray,
    training: _Training,
    folder: CheckpointFolder | None,
) -> dict[int, _Trained]:
    """Train models ``indices`` (stacked: together), saving each to ``folder`` once trained."""
    with global_rngs_restored():
        models = [initialised_model(model_fn, int(seeds[i]), x.device) for i in indices]
    # read before training; hashing every model's parameters is for checkpoints only
    fingerprints = [
        _model_fingerprint(models[j], seeds[i], masks[i]) if folder is not None else {}
        for j, i in enumerate(indices)
    ]
    trained: dict[int, _Trained] = {}

    def keep(j: int, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        i = indices[j]
        trained[i] = _Trained(params, buffers, training.rank)
        if folder is not None:
            folder.save(i, fingerprints[j], {"params": params, "buffers": buffers})

    if training.stacked:
        with seeded_global_rng(training.seed):  # a loss_fn drawing random numbers: seeded, restored
            params, buffers = train_stacked(
                models,
                x,
                y,
                [rows[i] for i in indices],
                loss_fn=training.loss_fn,
                optimizer=training.optimizer,
                epochs=training.epochs,
                batch_size=training.batch_size,
                seeds=seeds[indices],
                shapes=training.shapes,
            )
        for j in range(len(indices)):
            keep(
                j,
                {name: p[j].detach() for name, p in params.items()},
                {name: b[j].detach() for name, b in buffers.items()},
            )
        return trained
    for j, (model, i) in enumerate(zip(models, indices, strict=True)):
        train_one(
            model,
            x,
            y,
            rows[i],
            loss_fn=training.loss_fn,
            optimizer=training.optimizer,
            epochs=training.epochs,
            batch_size=training.batch_size,
            seed=int(seeds[i]),
        )
        keep(
            j,
            {name: p.detach() for name, p in model.named_parameters()},
            {name: b.detach() for name, b in model.named_buffers()},
        )
    return trained


def _stacked_ensemble(
    every: dict[int, _Trained],
    template: nn.Module,
    seeds: np.ndarray,
    masks: np.ndarray,
    device: torch.device,
) -> Ensemble:
    """The k models of ``every`` (model index -> trained model) stacked on ``device``."""
    k = len(seeds)
    params = {
        name: torch.stack([every[i].params[name].to(device) for i in range(k)])
        for name, _ in template.named_parameters()
    }
    buffers = {
        name: torch.stack([every[i].buffers[name].to(device) for i in range(k)])
        for name, _ in template.named_buffers()
    }
    trained_by = np.array([every[i].rank for i in range(k)], dtype=np.int64)
    return Ensemble(template, params, buffers, seeds, masks, trained_by=trained_by)
