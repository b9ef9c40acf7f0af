"""The training loops of :func:`privmon.audit.train_ensemble`: k models stacked and stepped
together, or one after another, with the same protocol.

The protocol, for model i with seed ``s_i`` (:attr:`~privmon.models.Ensemble.seeds`, derived
from ``seed`` and i) and members ``r_i`` (the indices where ``masks[i]`` is True, in increasing
order): the global RNGs (python, numpy, torch CPU and CUDA) are seeded with ``s_i`` and
``model_fn()`` initialises the model, which moves to the data's device (the caller's RNG state is
restored afterwards); ``opt = optimizer(params)``; every epoch the members are shuffled with
``torch.randperm`` from a generator seeded with ``s_i`` (skipped when one batch holds them all)
and cut into consecutive batches of ``batch_size``; per batch ``opt.zero_grad()``,
``loss_fn(model(x[b]), y[b]).mean()``, ``backward()``, ``opt.step()``.

Stacked, the loss is the sum of the k per-model means and ``optimizer`` steps the stacked
tensors, which equals k separate optimizers only for updates that are elementwise given the
gradient (SGD with momentum, weight decay or nesterov, Adam, AdamW, RMSprop, Adagrad, Adamax;
not LARS, LAMB, clipping by norm, or a closure as LBFGS's). Stacked models must be deterministic
in training mode and keep no running statistics (no dropout, no BatchNorm tracking running
stats: ``stacked=False`` trains those one by one, their global RNGs seeded with ``s_i``), and
need the same number of batches per epoch; shorter batches are padded with their own first
record, the padded rows dropped before the loss (so a non-finite loss spoils only the models
that train on its record). The stacked path runs with the global RNGs seeded with ``seed``
(restored afterwards) and reproduces ``stacked=False`` up to floating-point reassociation.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.func import stack_module_state

from privmon.audit.seeding import seed_global_rngs, seeded_global_rng
from privmon.models.linear_stack import stacked_forward

__all__ = [
    "LossFn",
    "OptimizerFn",
    "check_stackable",
    "initialised_model",
    "step_shapes",
    "train_one",
    "train_stacked",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFn = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _per_record_loss(loss: Any, n: int) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.shape != (n,):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return one loss per record, shape ({n},), got {shape}: use a "
            "per-record loss such as lambda out, y: F.cross_entropy(out, y, reduction='none')"
        )
    return loss


def _batches(n: int, batch_size: int, g: torch.Generator) -> list[torch.Tensor]:
    """Positions 0..n-1 cut into batches (shuffled by ``g`` unless one batch holds them all)."""
    if batch_size >= n:
        return [torch.arange(n)]
    return list(torch.randperm(n, generator=g).split(batch_size))


def check_stackable(model: nn.Module, *, padded: bool) -> None:
    """Modules the stacked path cannot train as each model trains alone; ``padded``: some
    models' batches are padded (unequal member counts)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            raise ValueError(
                f"model_fn builds a {type(m).__name__} with running statistics, which vmap "
                "cannot update in place: pass stacked=False to train the models one by one"
            )
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and padded:
            raise ValueError(
                f"model_fn builds a {type(m).__name__}, whose batch statistics would include the "
                "padding of the models with fewer records: use equal member counts "
                "(random_halves) or stacked=False"
            )
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            raise ValueError(
                f"model_fn builds a {type(m).__name__}(p={m.p}), random in training: the "
                "stacked models would not match their one-by-one training; pass stacked=False"
            )


def initialised_model(
    model_fn: Callable[[], nn.Module], seed: int, device: torch.device
) -> nn.Module:
    """``model_fn()`` built with the global RNGs seeded with ``seed``; the caller saves and
    restores them once around all k models (0.7 ms a model when done around each)."""
    seed_global_rngs(seed)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    return model.to(device).train()


def train_one(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    rows: torch.Tensor,
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFn,
    epochs: int,
    batch_size: int,
    seed: int,
) -> None:
    """Train ``model`` alone on records ``rows`` of ``(x, y)`` with the protocol above, its
    global RNGs seeded with ``seed`` for the whole training."""
    opt = optimizer(list(model.parameters()))
    g = torch.Generator().manual_seed(seed)
    n = rows.shape[0]
    full = [(x[rows], y[rows])] if batch_size >= n else None  # the same batch every epoch
    with seeded_global_rng(seed):  # dropout and other training randomness: seeded too
        for _ in range(epochs):
            if full is None:
                batches = [rows[b.to(rows.device)] for b in _batches(n, batch_size, g)]
            for xb, yb in full or ((x[r], y[r]) for r in batches):
                opt.zero_grad(set_to_none=True)
                loss = _per_record_loss(loss_fn(model(xb), yb), yb.shape[0]).mean()
                loss.backward()
                opt.step()


class _Step(NamedTuple):
    """One stacked step: the k models' inputs and targets (k, B, ...); where rows are padded,
    the flat positions of the real rows (``real``); each model's batch length."""

    x: torch.Tensor
    y: torch.Tensor
    real: torch.Tensor | None
    lengths: torch.Tensor


def step_shapes(sizes: list[int], batch_size: int) -> list[tuple[int, bool]]:
    """Per step of an epoch, the stacked batch length and whether any model's batch is shorter
    (padded), from the member counts of *all* the models: a shard of them, or the models a
    checkpoint folder lacks, then trains on the same shapes as the whole ensemble."""
    shapes = []
    for j in range(math.ceil(max(sizes) / batch_size)):
        lengths = [min(batch_size, n - j * batch_size) for n in sizes]
        shapes.append((max(lengths), min(lengths) != max(lengths)))
    return shapes


def _stacked_batch(
    x: torch.Tensor, y: torch.Tensor, pos: list[torch.Tensor], longest: int, padded: bool
) -> _Step:
    """The k models' batches as (k, ``longest``, ...) inputs and targets. When ``padded``, a
    shorter batch is padded with its own first record, so padding never reads another model's
    records, and the real rows are listed so that the loss never sees a padded one."""
    lengths = [p.shape[0] for p in pos]
    count = torch.tensor(lengths, dtype=x.dtype if x.is_floating_point() else torch.float32)
    count = count.to(x.device)
    if not padded:
        idx = torch.stack(pos)
        return _Step(x[idx], y[idx], None, count)
    idx = torch.stack([torch.cat([p, p[:1].expand(longest - p.shape[0])]) for p in pos])
    real = torch.cat([torch.arange(n) + i * longest for i, n in enumerate(lengths)])
    return _Step(x[idx], y[idx], real.to(x.device), count)


def train_stacked(
    models: list[nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    rows: list[torch.Tensor],
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFn,
    epochs: int,
    batch_size: int,
    seeds: np.ndarray,
    shapes: list[tuple[int, bool]],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train ``models`` together, model i on records ``rows[i]`` of ``(x, y)``, on the batch
    ``shapes`` of :func:`step_shapes`: their stacked parameters and buffers, trained."""
    k = len(models)
    params, buffers = stack_module_state(models)
    forward = stacked_forward(copy.deepcopy(models[0]).train(), x.ndim, shared=False)
    opt = optimizer(list(params.values()))
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    sizes = [r.shape[0] for r in rows]
    dev = x.device
    fixed: _Step | None = None
    for _ in range(epochs):
        if fixed is not None:
            steps = [fixed]
        else:
            per_model = [_batches(n, batch_size, g) for n, g in zip(sizes, gens, strict=True)]
            steps = []
            for j, (longest, padded) in enumerate(shapes):
                pos = [rows[i][per_model[i][j].to(dev)] for i in range(k)]
                steps.append(_stacked_batch(x, y, pos, longest, padded))
            if all(batch_size >= n for n in sizes):  # full batch: the same step every epoch
                fixed = steps[0]
        for xb, yb, real, lengths in steps:
            try:
                out = forward(params, buffers, xb)
            except RuntimeError as err:
                if "randomness" not in str(err):
                    raise
                raise ValueError(
                    "model_fn's forward draws random numbers in training (e.g. F.dropout): the "
                    "stacked models would not match their one-by-one training; pass stacked=False"
                ) from err
            b = xb.shape[1]
            out, yb = out.reshape(k * b, *out.shape[2:]), yb.reshape(k * b, *yb.shape[2:])
            if real is None:
                losses = _per_record_loss(loss_fn(out, yb), k * b).reshape(k, b)
                per_model_mean = losses.mean(dim=1)
            else:
                # padded rows are dropped before the loss, not weighted out after it: a
                # non-finite loss of theirs would survive a zero weight (0 * nan = nan)
                picked = loss_fn(out[real], yb[real])
                picked = _per_record_loss(picked, real.shape[0])
                losses = picked.new_zeros(k * b).index_copy(0, real, picked).reshape(k, b)
                per_model_mean = losses.sum(dim=1) / lengths
            opt.zero_grad(set_to_none=True)
            per_model_mean.sum().backward()
            opt.step()
    return params, buffers
