"""Shadow models trained together: k small models of one architecture as one batched ensemble.

Reference-model attacks (:mod:`privmon.attacks.reference`) need many shadow models, each trained
on its own subset of the data. For the small models an audit uses, training them one after
another wastes the machine on per-step overhead; :func:`train_ensemble` instead stacks their
parameters (``torch.func.stack_module_state``), runs ``torch.func.functional_call`` under
``torch.vmap`` with each model's own mini-batch, and steps one optimizer over the stacked
tensors (PyTorch's model-ensembling tutorial). When the model is an ``nn.Sequential`` of
``nn.Linear`` layers and parameter-free elementwise activations on 2-D inputs, the k models'
layers run as batched matrix products instead (``torch.baddbmm``, and one autograd node for
the whole stack whose backward is written out by the same products), which computes the same
functions with less per-step overhead than ``vmap``.

The training protocol (the same in both paths, so ``stacked=True`` reproduces ``stacked=False``
up to floating-point reassociation). For model i, with seed ``s_i`` (:attr:`Ensemble.seeds`,
derived from ``seed`` and i) and members ``r_i`` = the indices where ``masks[i]`` is True, in
increasing order, n_i of them:

1. the global RNGs (python, numpy, torch CPU and CUDA) are seeded with ``s_i``,
   ``model = model_fn()`` initialises the model, which then moves to the data's device
   (the caller's global RNG state is restored afterwards);
2. ``opt = optimizer(params)``; ``g = torch.Generator().manual_seed(s_i)``;
3. every epoch: the members are shuffled with ``torch.randperm(n_i, generator=g)`` (skipped
   when one batch holds them all) and cut into consecutive batches of ``batch_size`` (the last
   one may be shorter); per batch ``opt.zero_grad()``, ``loss_fn(model(x[b]), y[b]).mean()``,
   ``backward()``, ``opt.step()``.

In the stacked path the k models take their steps together: the loss is the sum of the k
per-model means (model i's gradient depends on its own mean only) and ``optimizer`` receives
the stacked parameter tensors. That equals k separate optimizers only for optimizers whose
update is elementwise given the gradient: SGD (momentum, weight decay, nesterov), Adam, AdamW,
RMSprop, Adagrad, Adamax are; anything taking a norm or statistic over a whole tensor (LARS,
LAMB, gradient clipping by norm) or a closure (LBFGS) is not. Models must be deterministic in
training mode and keep no running statistics (no dropout with p > 0, no BatchNorm tracking
running stats: ``vmap`` cannot update them in place); such models train with ``stacked=False``,
one by one with the same protocol, their global RNGs seeded with ``s_i`` for the whole training.
Since all models step together, every model needs the same number of batches per epoch (equal
member counts, e.g. :func:`random_halves`, or full batch); per-model batches of different sizes
are padded to the longest batch of all the models, each with its own batch's first record, and
the padded rows are dropped before the loss (not weighted out after it: 0 · NaN is NaN), so a
record whose loss is not finite spoils only the models that train on it, as it would alone (a
BatchNorm, whose batch statistics would include the padding, then needs ``stacked=False``).
The stacked path trains with the global RNGs seeded with ``seed`` (restored afterwards).

Past one process, :func:`train_ensemble` splits the models over the ranks of a torch.distributed
group (:mod:`privmon.audit.distributed`) and saves each to a checkpoint folder
(:mod:`privmon.audit.checkpoints`). Every model trains on the same shapes in any share of the
models (the padded length is that of all of them), so a rank's share gives each model the
parameters the whole ensemble gives it.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, stack_module_state

from privmon._validation import as_mask, check_callable, check_flag, check_int
from privmon.audit.checkpoints import CheckpointFolder, digest, portable, qualified_name
from privmon.audit.distributed import exchange, plan
from privmon.audit.records import as_xy
from privmon.audit.seeding import (
    TAG_HALVES,
    global_rngs_restored,
    seed_global_rngs,
    seeded_global_rng,
    stream,
    training_seeds,
)

__all__ = ["Ensemble", "random_halves", "train_ensemble"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFn = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def random_halves(n_records: int, n_models: int, *, seed: int) -> np.ndarray:
    """Membership masks (n_models, n_records): model i trains on a uniformly random subset of
    exactly ``n_records // 2`` records, independently of the other models, so each record is in
    about half of the models (Binomial(n_models, 1/2) of them for an even ``n_records``), as
    Carlini et al. train their shadow models. Reproducible from ``seed``."""
    n = check_int(n_records, name="n_records", minimum=2)
    k = check_int(n_models, name="n_models", minimum=1)
    rng = stream(check_int(seed, name="seed"), TAG_HALVES)
    keys = rng.random((k, n))
    order = np.argsort(keys, axis=1)
    masks = np.zeros((k, n), dtype=bool)
    np.put_along_axis(masks, order[:, : n // 2], True, axis=1)
    return masks


# Parameter-free modules that act elementwise: on a stacked (k, b, h) tensor they compute what
# they compute on each model's (b, h) slice.
_ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Hardtanh,
    nn.Identity,
)
StackedForward = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor], Any]


def _linear_stack(template: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The layers of ``template`` when it is a plain ``nn.Sequential`` of ``nn.Linear`` layers
    and :data:`_ELEMENTWISE` activations (exact types, no hooks, no buffers), else None."""
    if type(template) is not nn.Sequential or next(template.buffers(), None) is not None:
        return None
    layers = list(template.named_children())
    n_linear = 0
    for _, layer in layers:
        if layer._forward_hooks or layer._forward_pre_hooks:
            return None
        if type(layer) is nn.Linear:  # a parametrized Linear is a subclass: not taken
            n_linear += 1
        elif type(layer) not in _ELEMENTWISE:
            return None
    if n_linear == 0 or template._forward_hooks or template._forward_pre_hooks:
        return None
    return layers


_NARROW = 16  # output features below which a stacked CPU layer computes (weight @ hᵀ)ᵀ


def _stacked_linear(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """k linear layers at once: ``h`` (k, b, in), ``weight`` (k, out, in), ``bias`` (k, out) or
    None -> bias + h @ weightᵀ, (k, b, out)."""
    if h.device.type == "cpu" and weight.shape[1] < _NARROW:
        # batched CPU GEMMs (MKL) with so few output columns run 1.3-3x slower than the
        # transposed product, (weight @ hᵀ)ᵀ, with the batch as columns
        out = (
            torch.bmm(weight, h.mT)
            if bias is None
            else torch.baddbmm(bias[..., None], weight, h.mT)
        )
        return out.mT
    if bias is None:
        return torch.bmm(h, weight.mT)
    return torch.baddbmm(bias.unsqueeze(1), h, weight.mT)


class _LinearStack:
    """k plain ``nn.Sequential`` MLPs (:func:`_linear_stack`) as batched matrix products, with
    their backward written out.

    ``stack(params, buffers, x)`` is a :data:`StackedForward`. Under autograd (parameters that
    require grad) the whole stack is one node, :class:`_LinearStackFunction`: its forward runs
    the layers as plain tensor operations and keeps what each layer's backward reads, and its
    backward turns the gradient of the outputs into each parameter's, per linear layer
    ``grad_W = gradᵀ h``, ``grad_b = Σ_rows grad`` and ``grad_h = grad @ W``. ReLU runs in
    place on the hidden activations privmon made (its backward keeps the units whose output is
    positive); other activations are differentiated by autograd one layer at a time. Against
    one autograd node per layer and activation, this takes about a tenth off each step of 64
    MLPs 64-32-10 (``benchmarks/ensemble.py``).
    """

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self.layers = layers

    def __call__(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        if torch.is_grad_enabled() and any(p.requires_grad for p in params.values()):
            return _LinearStackFunction.apply(self, x, tuple(params), *params.values())
        with torch.no_grad():
            return self._run(params, x, None)

    def _run(self, params: dict[str, torch.Tensor], x: torch.Tensor, saved: list[Any] | None):
        h, owned = x, False  # owned: h is a hidden activation privmon made, free to overwrite
        for name, layer in self.layers:
            if type(layer) is nn.Linear:
                w = params[f"{name}.weight"]
                if h.ndim == 2:  # shared inputs, before the first linear layer
                    h = h.expand(w.shape[0], *h.shape)
                if saved is not None:
                    saved.append(h)
                h, owned = _stacked_linear(h, w, params.get(f"{name}.bias")), True
            elif type(layer) is nn.ReLU:
                h = h.clamp_min_(0) if owned else h.clamp_min(0)
                owned = True
                if saved is not None:
                    saved.append(h)  # the output: positive exactly where the input was
            elif type(layer) is nn.Identity:
                if saved is not None:
                    saved.append(None)
            elif saved is None:
                h, owned = layer(h), True
            else:
                with torch.enable_grad():
                    h_in = h.detach().requires_grad_(True)
                    h_out = layer(h_in)
                saved.append((h_in, h_out))
                h, owned = h_out.detach(), False  # its backward may read the output
        return h.contiguous()

    def backward(
        self, params: dict[str, torch.Tensor], saved: list[Any], grad: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each parameter's gradient, given ``grad``, the gradient of the outputs (k, b, ...)."""
        grads: dict[str, torch.Tensor] = {}
        first = next(i for i, (_, layer) in enumerate(self.layers) if type(layer) is nn.Linear)
        owned = False  # grad is one privmon computed (autograd's may be shared or expanded)
        for i in range(len(self.layers) - 1, first - 1, -1):
            name, layer = self.layers[i]
            kept = saved[i]
            if type(layer) is nn.Linear:
                w = params[f"{name}.weight"]
                grads[f"{name}.weight"] = torch.bmm(grad.mT, kept)
                if f"{name}.bias" in params:
                    grads[f"{name}.bias"] = grad.sum(dim=1)
                if i > first:
                    grad, owned = torch.bmm(grad, w), True
            elif type(layer) is nn.ReLU:
                threshold = torch.ops.aten.threshold_backward
                grad = (
                    threshold.grad_input(grad, kept, 0, grad_input=grad)
                    if owned
                    else threshold(grad, kept, 0)
                )
                owned = True
            elif type(layer) is not nn.Identity:
                h_in, h_out = kept
                (grad,) = torch.autograd.grad(h_out, h_in, grad)
                owned = True
        return grads


class _LinearStackFunction(torch.autograd.Function):
    """A :class:`_LinearStack` as one autograd node; inputs ``(stack, x, names, *params)``."""

    @staticmethod
    def forward(
        ctx: Any, stack: _LinearStack, x: torch.Tensor, names: tuple[str, ...], *tensors: Any
    ) -> torch.Tensor:
        params = dict(zip(names, tensors, strict=True))
        saved: list[Any] = []
        out = stack._run(params, x, saved)  # autograd.Function runs forward without a graph
        ctx.stack, ctx.params, ctx.kept = stack, params, saved
        kept_storages = {
            t.untyped_storage().data_ptr()
            for item in saved
            for t in (item if isinstance(item, tuple) else (item,))
            if t is not None
        }
        if out.untyped_storage().data_ptr() in kept_storages:
            # an output the backward reads (a trailing ReLU's): saved, so that autograd refuses
            # a loss that modifies it in place, as it would for the model alone
            ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _ = ctx.saved_tensors  # raises if the loss modified a saved output in place
        grads = ctx.stack.backward(ctx.params, ctx.kept, grad)
        ctx.kept = None
        return (None, None, None, *(grads.get(name) for name in ctx.params))


def _stacked_forward(template: nn.Module, x_ndim: int, *, shared: bool) -> StackedForward:
    """``forward(params, buffers, x)``: the k stacked models in ``template``'s mode on inputs of
    ``x_ndim`` dimensions per model, (b, ...) for all models when ``shared``, else (k, b, ...)
    (model i's own); output (k, b, ...). A :class:`_LinearStack` for a linear stack on 2-D
    inputs (:func:`_linear_stack`), ``vmap`` over ``functional_call`` otherwise."""
    layers = _linear_stack(template) if x_ndim == 2 else None
    if layers is not None:
        return _LinearStack(layers)
    base = copy.deepcopy(template).to("meta")

    def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], xb: torch.Tensor):
        return functional_call(base, (p, b), (xb,))

    return torch.vmap(one, in_dims=(0, 0, None if shared else 0))


class Ensemble:
    """k trained models of one architecture, their parameters stacked along a leading dimension.

    Attributes:
        params, buffers: name -> tensor of shape (k, ...) (detached), as
            ``torch.func.stack_module_state`` lays them out.
        seeds: (k,) the seed of each model (initialisation and batch order).
        masks: (k, n) bool, the records each model trained on.
        trained_by: (k,) int, the rank of the torch.distributed group that trained each model
            (0 in one process), -1 for a model loaded from a checkpoint folder.

    ``ensemble(x)`` runs all k models on the same inputs in eval mode under ``no_grad``: an
    output of shape (k, n, ...). ``ensemble.model(i)`` returns model i as an ordinary module.
    """

    def __init__(
        self,
        template: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        seeds: np.ndarray,
        masks: np.ndarray,
        *,
        trained_by: np.ndarray | None = None,
    ) -> None:
        self._template = template
        self._forward: dict[int, StackedForward] = {}  # by the inputs' number of dimensions
        self.params = {k: v.detach() for k, v in params.items()}
        self.buffers = {k: v.detach() for k, v in buffers.items()}
        self.seeds = seeds
        self.masks = masks
        self.trained_by = np.zeros(len(seeds), dtype=np.int64) if trained_by is None else trained_by

    def __len__(self) -> int:
        return int(self.masks.shape[0])

    def __repr__(self) -> str:
        return f"Ensemble(n_models={len(self)}, model={type(self._template).__name__})"

    @property
    def device(self) -> torch.device:
        """The device of the stacked parameters."""
        return next(iter(self.params.values())).device

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """All k models' outputs on the inputs ``x`` (n, ...): shape (k, n, ...)."""
        x = x.to(self.device)
        forward = self._forward.get(x.ndim)
        if forward is None:
            template = copy.deepcopy(self._template).eval()
            forward = self._forward[x.ndim] = _stacked_forward(template, x.ndim, shared=True)
        return forward(self.params, self.buffers, x)

    def model(self, i: int) -> nn.Module:
        """Model ``i`` as an independent module (a copy, in eval mode)."""
        i = check_int(i, name="i", minimum=0)
        if i >= len(self):
            raise ValueError(f"i must be an index in [0, {len(self) - 1}], got {i}")
        m = copy.deepcopy(self._template)
        m.load_state_dict({k: v[i] for k, v in {**self.params, **self.buffers}.items()})
        return m.eval()


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


def _check_stackable(model: nn.Module, *, padded: bool) -> None:
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


def _init(model_fn: Callable[[], nn.Module], seed: int, device: torch.device) -> nn.Module:
    """``model_fn()`` built with the global RNGs seeded with ``seed``; the caller saves and
    restores them once around all k models (0.7 ms a model when done around each)."""
    seed_global_rngs(seed)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    return model.to(device).train()


def _train_one(
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


def _step_shapes(sizes: list[int], batch_size: int) -> list[tuple[int, bool]]:
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


def _train_stacked(
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
    k = len(models)
    params, buffers = stack_module_state(models)
    forward = _stacked_forward(copy.deepcopy(models[0]).train(), x.ndim, shared=False)
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
    first model's parameters), ``loss_fn``'s qualified name (a changed body under the same name
    goes unnoticed), ``epochs``, the batch size and ``stacked``. Loading uses
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
            ``stacked`` (module docstring).
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
            ``checkpoint_dir`` holding models of another recipe, data or mask; ranks called
            with different arguments. RuntimeError on every rank when training failed on one.
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
    n = x.shape[0]
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
    k = len(sizes)
    masks_np = m.cpu().numpy()
    seeds = training_seeds(seed, k)
    with global_rngs_restored():
        template = _init(model_fn, int(seeds[0]), x.device)
    if stacked:
        _check_stackable(template, padded=min(sizes) != max(sizes))
    recipe = _recipe(template, x, y, loss_fn, optimizer, epochs=epochs, bs=bs, stacked=stacked)
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
        if folder is not None:  # (without one on any rank, nothing is saved: to_load is empty)
            for i in work.load:
                with global_rngs_restored():
                    model = _init(model_fn, int(seeds[i]), x.device)
                contents = folder.load(i, _identity(model, seeds[i], masks_np[i]))
                mine[i] = _Trained(contents["params"], contents["buffers"], -1)
        if work.train:
            training = _Training(
                loss_fn, optimizer, epochs, bs, seed, stacked, _step_shapes(sizes, bs), work.rank
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
    params = {
        name: torch.stack([every[i].params[name].to(x.device) for i in range(k)])
        for name, _ in template.named_parameters()
    }
    buffers = {
        name: torch.stack([every[i].buffers[name].to(x.device) for i in range(k)])
        for name, _ in template.named_buffers()
    }
    trained_by = np.array([every[i].rank for i in range(k)], dtype=np.int64)
    return Ensemble(template.eval(), params, buffers, seeds, masks_np, trained_by=trained_by)


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


def _identity(model: nn.Module, seed: Any, mask: np.ndarray) -> dict[str, Any]:
    """What makes a model model i, as its checkpoint records it: seed, mask and the digest of
    its initial parameters and buffers (read before training)."""
    state = model.state_dict()
    return {"seed": int(seed), "mask": mask, "init": digest(*(state[k] for k in sorted(state)))}


def _recipe(
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
        "training": f"epochs={epochs}, batch_size={bs}, stacked={stacked}",
    }


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
        models = [_init(model_fn, int(seeds[i]), x.device) for i in indices]
    # read before training; hashing every model's parameters is for checkpoints only
    identities = [
        _identity(models[j], seeds[i], masks[i]) if folder is not None else {}
        for j, i in enumerate(indices)
    ]
    trained: dict[int, _Trained] = {}

    def keep(j: int, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        i = indices[j]
        trained[i] = _Trained(params, buffers, training.rank)
        if folder is not None:
            folder.save(i, identities[j], {"params": params, "buffers": buffers})

    if training.stacked:
        with seeded_global_rng(training.seed):  # a loss_fn drawing random numbers: seeded, restored
            params, buffers = _train_stacked(
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
        _train_one(
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
