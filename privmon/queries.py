"""Queries: what a membership-inference attacker observes about one record.

A query maps a batch of records to scores of shape ``(n,)`` (scalar query) or ``(n, d)`` (vector
query), computed on the model's device. The monitor runs every query, once per check, as::

    query.prepare(device)          # once, before any batch (e.g. draw generated samples)
    query(batch) -> scores         # every member and non-member batch
    query.release()                # once, after the check: per-check caches are dropped

inside ``torch.no_grad()``, with every module in ``query.modules`` in eval mode, and with every RNG
restored afterwards (so queries may draw random numbers from the global torch RNG). Queries never
change module state: no ``.train()`` / ``.eval()`` calls, no parameter or buffer writes, and no hook
left attached outside a call.

Batch convention
----------------
A batch is one of

* a tensor ``x`` (no labels);
* a tuple or list ``(x, y, ...)``: the first element is the input, the second (if any) the label,
  the rest is ignored;
* a mapping with an input under the first present key of ``"x"``, ``"input"``, ``"inputs"``,
  ``"input_ids"`` and a label under the first present key of ``"y"``, ``"label"``, ``"labels"``,
  ``"target"`` (the label is optional).

Anything else is adapted with ``transform``, which every query (except :class:`CallableQuery`,
whose function sees the raw batch) accepts: ``transform(batch) -> (x, y)`` with ``y`` possibly
``None``. Tensors and numpy arrays in ``x`` and ``y`` are moved to the model's device (the device
of its first parameter, else of its first buffer, else the CPU). If ``x`` is itself a tuple /
list it is unpacked as positional arguments, and if it is a mapping as keyword arguments, so
``transform=lambda b: ({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]},
b["labels"])`` calls ``model(input_ids=..., attention_mask=...)``.

Classifier queries read the model's output as logits of shape ``(n, C)``; an output with a
``logits`` attribute or key (Hugging Face) or a tuple (first element) is unwrapped. A single logit
per record (shape ``(n,)`` or ``(n, 1)``, the ``BCEWithLogitsLoss`` convention) is read as a binary
classifier's logit ``z`` for class 1 and expanded to the two-class logits ``[0, z]``. Labels are
class indices (integer, bool, or floats holding whole numbers), shape ``(n,)`` or ``(n, 1)``.

Score direction (``higher_is_member``): members tend to score higher for confidence, correctness,
logit confidence and discriminator outputs, lower for loss, entropy, modified entropy and the
distance to the nearest generated sample; ``None`` for vector queries and when unknown. The
advantage estimators do not need it; direction-dependent figures such as the AUC can use it.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privmon._validation import as_mask, check_flag, check_positive, check_unit
from privmon.attacks.metric import logit_confidence_from_logits, modified_entropy_from_logits
from privmon.attacks.reference import (
    fit_variance,
    gaussian_fit,
    lira_offline_score,
    log_normal,
    pooled_variance,
    rmia_marginal,
    rmia_score,
)
from privmon.audit.ensemble import Ensemble

logger = logging.getLogger("privmon")

__all__ = [
    "CallableQuery",
    "ConfidenceQuery",
    "CorrectnessQuery",
    "DiscriminatorQuery",
    "EntropyQuery",
    "HiddenLayerQuery",
    "HybridQuery",
    "LogitConfidenceQuery",
    "LossQuery",
    "ModifiedEntropyQuery",
    "MultiDiscriminatorQuery",
    "NearestGeneratedQuery",
    "Query",
    "ReferenceModelQuery",
]

Batch = Any
Transform = Callable[[Batch], tuple[Any, Any]]

_X_KEYS = ("x", "input", "inputs", "input_ids")
_Y_KEYS = ("y", "label", "labels", "target")

# --- shared helpers -------------------------------------------------------------------------------


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


def _check_module(module: Any, arg: str) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise ValueError(f"{arg} must be a torch.nn.Module, got {type(module).__name__}")
    return module


def _check_transform(transform: Any) -> Transform | None:
    if transform is not None and not callable(transform):
        raise ValueError(
            f"transform must be None or a callable batch -> (x, y), got {type(transform).__name__}"
        )
    return transform


def _check_positive_int(value: Any, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{arg} must be an integer >= 1, got {value!r}")
    return int(value)


def _unique_modules(modules: Iterable[nn.Module]) -> tuple[nn.Module, ...]:
    out: list[nn.Module] = []
    for m in modules:
        if not any(m is o for o in out):
            out.append(m)
    return tuple(out)


def _module_device(modules: Iterable[nn.Module], fallback: Any = None) -> torch.device:
    """Device of the first parameter, else the first buffer, of the first module that has one."""
    for m in modules:
        for t in m.parameters():
            return t.device
        for b in m.buffers():
            return b.device
    return torch.device(fallback) if fallback is not None else torch.device("cpu")


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, np.ndarray):
        return torch.as_tensor(obj, device=device)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _split_batch(
    batch: Batch, device: torch.device, transform: Transform | None = None
) -> tuple[Any, torch.Tensor | None]:
    """Split a batch into (x, y or None) following the module's batch convention; move to device."""
    if transform is not None:
        out = transform(batch)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(
                "transform must return a pair (x, y), with y None when there is no label"
            )
        x, y = out
    elif isinstance(batch, torch.Tensor):
        x, y = batch, None
    elif isinstance(batch, Mapping):
        xk = next((k for k in _X_KEYS if k in batch), None)
        if xk is None:
            raise ValueError(
                f"dict batch has none of the input keys {_X_KEYS} "
                f"(keys: {sorted(map(str, batch))}); pass transform=lambda batch: (x, y)"
            )
        x = batch[xk]
        yk = next((k for k in _Y_KEYS if k in batch), None)
        y = batch[yk] if yk is not None else None
    elif isinstance(batch, (tuple, list)):
        if len(batch) == 0:
            raise ValueError("batch is an empty tuple/list: expected (x, y, ...)")
        x = batch[0]
        y = batch[1] if len(batch) > 1 else None
    else:
        raise ValueError(
            f"unsupported batch type {type(batch).__name__}: expected a tensor, a tuple/list "
            "(x, y, ...) or a dict; pass transform=lambda batch: (x, y)"
        )
    x = _to_device(x, device)
    if y is not None:
        y = y.to(device) if isinstance(y, torch.Tensor) else torch.as_tensor(y, device=device)
    return x, y


def _digest(x: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """Cache key of a batch tensor: dtype, shape and a 128-bit BLAKE2b digest of its bytes (a
    tensor on an accelerator is copied to the CPU for hashing)."""
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    raw = t.view(torch.uint8).numpy() if t.numel() else b""
    # numpy's stubs do not declare ndarray a Buffer; at run time it is one (no copy is made)
    digest = hashlib.blake2b(raw, digest_size=16).digest()  # type: ignore[arg-type]
    return str(x.dtype), tuple(x.shape), digest


def _forward(module: nn.Module, x: Any) -> Any:
    """Call module on x: a tuple/list is unpacked as positional args, a mapping as keyword args."""
    if isinstance(x, Mapping):
        return module(**x)
    if isinstance(x, (tuple, list)):
        return module(*x)
    return module(x)


def _first_tensor(out: Any, what: str) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if "logits" in out and isinstance(out["logits"], torch.Tensor):
            return out["logits"]
        out = list(out.values())
    elif isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise ValueError(f"{what} returned {type(out).__name__}; expected a tensor")


def _as_float(t: torch.Tensor) -> torch.Tensor:
    """float64 stays float64; every other dtype (half, bfloat16, ints, bool) becomes float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def _per_record(t: torch.Tensor, what: str) -> torch.Tensor:
    """(n,) or (n, 1, ...) with one value per record -> (n,)."""
    if t.ndim == 0:
        raise ValueError(f"{what} returned a scalar; expected one value per record, shape (n,)")
    if t[0].numel() != 1:
        raise ValueError(
            f"{what} returned shape {tuple(t.shape)}; expected one value per record, (n,) or (n, 1)"
        )
    return t.reshape(t.shape[0])


# --- base classes ---------------------------------------------------------------------------------


class Query(abc.ABC):
    """Base class: ``prepare(device)`` → ``__call__(batch)`` per batch → ``release()``.

    Attributes:
        name: short tag used in reports and TensorBoard.
        modules: every module the query runs; the monitor saves and restores their train/eval modes
            and puts them in eval mode during a check.
        discrete: True when scores take few distinct values (histogram estimators only).
        higher_is_member: True / False when members tend to score higher / lower, None if unknown
            or for vector scores.
        transform: optional ``batch -> (x, y)`` adapter (see the module docstring).
    """

    name: str
    modules: tuple[nn.Module, ...] = ()
    discrete: bool = False
    higher_is_member: bool | None = None

    def __init__(
        self,
        *,
        name: str,
        modules: nn.Module | Iterable[nn.Module] = (),
        transform: Transform | None = None,
    ) -> None:
        self.name = _check_name(name)
        mods = (modules,) if isinstance(modules, nn.Module) else tuple(modules)
        for m in mods:
            _check_module(m, "modules")
        self.modules = _unique_modules(mods)
        self.transform = _check_transform(transform)

    @property
    def device(self) -> torch.device:
        """The device the query computes on: that of its first module's parameters (else CPU)."""
        return _module_device(self.modules)

    def prepare(self, device: Any = None) -> None:  # noqa: B027 - optional hook, default no-op
        """Called once per check before any batch. Default: nothing."""

    @abc.abstractmethod
    def __call__(self, batch: Batch) -> torch.Tensor:
        """Scores of shape (n,) or (n, d) on the model's device."""

    def release(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Called once per check after the last batch; drops per-check caches. Default: nothing."""

    def _split(self, batch: Batch) -> tuple[Any, torch.Tensor | None]:
        return _split_batch(batch, self.device, self.transform)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class _ClassifierQuery(Query):
    """Shared path of the classifier queries: forward, logits (n, C), checked labels (n,)."""

    def __init__(self, model: nn.Module, *, name: str, transform: Transform | None = None) -> None:
        self.model = _check_module(model, "model")
        super().__init__(name=name, modules=(model,), transform=transform)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        _, logits, y = self._forward_labelled(batch)
        return self._score(logits, y)

    def _forward_labelled(self, batch: Batch) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The batch's inputs, the model's logits (n, C) and the checked labels (n,)."""
        x, y = self._split(batch)
        if y is None:
            raise ValueError(
                f"{type(self).__name__} needs labels, but the batch has none: pass (x, y) tuples, "
                f"a dict with one of the label keys {_Y_KEYS}, or transform=lambda batch: (x, y)"
            )
        logits = self._logits(_forward(self.model, x))
        return x, logits, self._labels(y, logits)

    @staticmethod
    def _logits(out: Any) -> torch.Tensor:
        z = _first_tensor(out, "model")
        if not (z.is_floating_point()):
            raise ValueError(f"model returned a {z.dtype} tensor; expected float logits")
        z = _as_float(z)
        if z.ndim == 1 or (z.ndim == 2 and z.shape[1] == 1):
            z = z.reshape(-1, 1)
            return torch.cat([torch.zeros_like(z), z], dim=1)  # binary logit z -> [0, z]
        if z.ndim != 2:
            raise ValueError(
                f"model returned logits of shape {tuple(z.shape)}; expected (n, C) "
                "(use transform / CallableQuery for other outputs)"
            )
        return z

    @staticmethod
    def _labels(y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        n, c = logits.shape
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.ndim != 1 or y.shape[0] != n:
            raise ValueError(
                f"labels must be class indices of shape ({n},) matching the logits "
                f"{tuple(logits.shape)}, got shape {tuple(y.shape)}"
            )
        if y.is_floating_point():
            if not bool(torch.all(y == torch.round(y))):
                raise ValueError("labels must be class indices, got non-integer float labels")
        elif y.is_complex():
            raise ValueError("labels must be class indices, got complex labels")
        y = y.long()
        if n and (int(y.min()) < 0 or int(y.max()) >= c):
            raise ValueError(
                f"labels must lie in [0, {c - 1}] for {c} classes, "
                f"got range [{int(y.min())}, {int(y.max())}]"
            )
        return y

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# --- classifier queries ---------------------------------------------------------------------------


class LossQuery(_ClassifierQuery):
    """Per-record cross-entropy loss ``-log p_y`` (``F.cross_entropy(..., reduction="none")``)."""

    higher_is_member = False

    def __init__(self, model: nn.Module, *, name: str = "loss", transform: Transform | None = None):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, reduction="none")


class ConfidenceQuery(_ClassifierQuery):
    """Softmax probability of the true class, ``p_y`` (Song & Mittal's confidence metric)."""

    higher_is_member = True

    def __init__(
        self, model: nn.Module, *, name: str = "confidence", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits, dim=1).gather(1, y[:, None]).squeeze(1).exp()


class CorrectnessQuery(_ClassifierQuery):
    """1.0 when the arg-max class equals the label, else 0.0 (discrete)."""

    discrete = True
    higher_is_member = True

    def __init__(
        self, model: nn.Module, *, name: str = "correct", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (logits.argmax(dim=1) == y).to(logits.dtype)


class EntropyQuery(_ClassifierQuery):
    """Prediction entropy ``-sum_i p_i log p_i`` (label-free, but labels are still required)."""

    higher_is_member = False

    def __init__(
        self, model: nn.Module, *, name: str = "entropy", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=1)
        p = logp.exp()
        return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1)


class ModifiedEntropyQuery(_ClassifierQuery):
    """Song & Mittal's modified entropy (their eq. 8)::

        Mentr = -(1 - p_y) log p_y - sum_{i != y} p_i log(1 - p_i)

    Computed from the logits: ``log p_i`` by log-softmax and ``log(1 - p_i)`` by log1mexp, exactly
    (``logsumexp_{j != k} z_j - logsumexp z``) for the arg-max class k, the only one that can round
    to probability 1. Probabilities are clipped into [1e-30, 1 - 1e-30] inside the logs, so the
    score is 0 for a perfectly confident correct prediction and finite (about 2 * 69.1 at most per
    wrong confident class) for a confident wrong one; it is never NaN / inf for finite logits.
    """

    higher_is_member = False

    def __init__(
        self, model: nn.Module, *, name: str = "mentr", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return modified_entropy_from_logits(logits, y)


class LogitConfidenceQuery(_ClassifierQuery):
    """Logit-scaled confidence ``log(p_y / (1 - p_y)) = z_y - logsumexp_{i != y} z_i``.

    Computed by the identity on the right, so it stays finite (e.g. 100 for logits [50, -50]) where
    ``p_y`` rounds to 1. The scaling used by LiRA-style attacks: roughly Gaussian per record.
    """

    higher_is_member = True

    def __init__(
        self, model: nn.Module, *, name: str = "logit_conf", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return logit_confidence_from_logits(logits, y)


class HiddenLayerQuery(Query):
    """Activations of a submodule ``layer`` of ``model``, flattened to (n, d) (MACE App. G).

    ``layer`` is a submodule or its qualified name (``model.get_submodule``). A forward hook is
    attached to ``layer`` only for the duration of each call (removed in a ``finally``, so it is
    never attached during training, even if the forward raises). The captured output is cloned
    (an in-place op later in the forward, such as ``ReLU(inplace=True)``, cannot alter it); a tuple
    output gives its first tensor; if the layer runs several times in one forward the last run wins.
    Labels are not needed.
    """

    def __init__(
        self,
        model: nn.Module,
        layer: nn.Module | str,
        *,
        name: str = "hidden",
        transform: Transform | None = None,
    ) -> None:
        self.model = _check_module(model, "model")
        if isinstance(layer, str):
            try:
                layer = model.get_submodule(layer)
            except AttributeError:
                raise ValueError(f"layer {layer!r} is not a submodule name of model") from None
        _check_module(layer, "layer")
        if not any(m is layer for m in model.modules()):
            raise ValueError("layer must be a submodule of model")
        self.layer = layer
        super().__init__(name=name, modules=(model,), transform=transform)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, _ = self._split(batch)
        captured: list[torch.Tensor] = []

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            captured[:] = [_first_tensor(output, "layer").detach().clone()]

        handle = self.layer.register_forward_hook(hook)
        try:
            _forward(self.model, x)
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(f"{self.name}: the layer did not run during model's forward pass")
        h = captured[0]
        if h.ndim == 0:
            raise ValueError(f"{self.name}: the layer returned a scalar; expected (n, ...)")
        return _as_float(h.reshape(h.shape[0], -1))

    def release(self) -> None:
        """Nothing is cached between calls; the hook only lives inside a call."""


# --- GAN queries ----------------------------------------------------------------------------------

_OUTPUTS = ("logit", "prob")


def _check_output(output: Any, eps: Any) -> tuple[str, float]:
    if output not in _OUTPUTS:
        raise ValueError(f"output must be one of {_OUTPUTS}, got {output!r}")
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a number in (0, 0.5), got {eps!r}") from None
    if not 0.0 < e < 0.5:
        raise ValueError(f"eps must be in (0, 0.5), got {eps!r}")
    return output, e


def _disc_logit(d: nn.Module, x: Any, output: str, eps: float) -> torch.Tensor:
    s = _as_float(_per_record(_first_tensor(_forward(d, x), "discriminator"), "discriminator"))
    if output == "prob":
        s = torch.logit(s, eps=eps)  # clamps into [eps, 1 - eps] first
    return s


class DiscriminatorQuery(Query):
    """Discriminator output D(x) as a logit (MACE eq. 20), shape (n,).

    ``output="logit"`` (default) when the discriminator returns logits; ``output="prob"`` when it
    ends in a sigmoid: the probability is clamped into [eps, 1 - eps] and mapped through
    ``torch.logit``. The discriminator's output must hold one value per record, (n,) or (n, 1).
    """

    higher_is_member = True

    def __init__(
        self,
        discriminator: nn.Module,
        *,
        name: str = "disc",
        output: str = "logit",
        eps: float = 1e-6,
        transform: Transform | None = None,
    ) -> None:
        self.discriminator = _check_module(discriminator, "discriminator")
        self.output, self.eps = _check_output(output, eps)
        super().__init__(name=name, modules=(discriminator,), transform=transform)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, _ = self._split(batch)
        return _disc_logit(self.discriminator, x, self.output, self.eps)


class MultiDiscriminatorQuery(Query):
    """Several discriminators (privGAN): ``reduce="max"`` gives max_i D_i(x) (MACE eq. 22), shape
    (n,); ``reduce="vector"`` gives (D_1(x), ..., D_k(x)) (eq. 23), shape (n, k). Outputs are logits
    (``output`` / ``eps`` as in :class:`DiscriminatorQuery`; the max commutes with the logit). The
    default name is ``"disc_max"`` or ``"disc_vector"``. All discriminators must share a device.
    """

    _REDUCE = ("max", "vector")

    def __init__(
        self,
        discriminators: Sequence[nn.Module],
        *,
        reduce: str = "max",
        name: str | None = None,
        output: str = "logit",
        eps: float = 1e-6,
        transform: Transform | None = None,
    ) -> None:
        if isinstance(discriminators, nn.Module) and not isinstance(
            discriminators, (nn.ModuleList, nn.Sequential)
        ):
            raise ValueError("discriminators must be a sequence of modules, got a single module")
        try:
            ds = tuple(discriminators)
        except TypeError:
            raise ValueError("discriminators must be a non-empty sequence of modules") from None
        if not ds:
            raise ValueError("discriminators must be a non-empty sequence of modules")
        for d in ds:
            _check_module(d, "discriminators")
        if reduce not in self._REDUCE:
            raise ValueError(f"reduce must be one of {self._REDUCE}, got {reduce!r}")
        self.discriminators = ds
        self.reduce = reduce
        self.output, self.eps = _check_output(output, eps)
        self.higher_is_member = True if reduce == "max" else None
        super().__init__(
            name=f"disc_{reduce}" if name is None else name, modules=ds, transform=transform
        )

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, _ = self._split(batch)
        s = torch.stack([_disc_logit(d, x, self.output, self.eps) for d in self.discriminators], 1)
        return s.amax(dim=1) if self.reduce == "max" else s


def _flat_records(
    batch: Batch, device: torch.device, transform: Any, dim: int, name: str, against: str
) -> torch.Tensor:
    """A batch's inputs as (n, dim) rows on ``device``, checked against the rows they are
    compared with; ``against`` names them with their verb ("generated samples have")."""
    x, _ = _split_batch(batch, device, transform)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: the input must be a tensor, got {type(x).__name__}")
    x = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, -1)
    if x.shape[1] != dim:
        raise ValueError(
            f"{name}: input has {x.shape[1]} values per record but {against} {dim}; "
            "use transform to match the generator's output"
        )
    return x


class NearestGeneratedQuery(Query):
    """Distance to the nearest generated sample, min_j ||x - g_j||_2 (MACE eq. 19), shape (n,).

    ``prepare()`` draws ``n_samples`` samples once per check and keeps them flattened to
    (n_samples, d) on the generator's device: ``generator(z)`` with z ~ N(0, I) of shape
    ``(chunk_size, *latent_dim)`` drawn from the global torch RNG on that device, ``chunk`` latents
    per generator call; or, with ``sample_fn``, ``sample_fn(n_samples, device)`` called once (it
    replaces latent sampling and the generator call; the generator, if given, is still listed in
    ``modules``, and may be None). ``release()`` drops the samples. Inputs are flattened to (n, d)
    and compared in chunks of ``chunk`` rows with ``torch.cdist`` (direct differences, not the
    matrix-product shortcut, so near-duplicates give distances near 0), so memory is
    O(chunk * n_samples). Deterministic given ``torch.manual_seed``.
    """

    higher_is_member = False

    def __init__(
        self,
        generator: nn.Module | None,
        *,
        n_samples: int = 1000,
        latent_dim: int | Sequence[int] | None = None,
        sample_fn: Callable[[int, torch.device], torch.Tensor] | None = None,
        chunk: int = 1024,
        name: str = "nn_dist",
        transform: Transform | None = None,
    ) -> None:
        if generator is not None:
            _check_module(generator, "generator")
        if sample_fn is not None and not callable(sample_fn):
            raise ValueError("sample_fn must be None or a callable (n, device) -> samples")
        if generator is None and sample_fn is None:
            raise ValueError("generator may be None only when sample_fn is given")
        if sample_fn is None:
            if latent_dim is None:
                raise ValueError("latent_dim is required unless sample_fn is given")
            dims = (latent_dim,) if isinstance(latent_dim, (int, np.integer)) else latent_dim
            try:
                self.latent_shape: tuple[int, ...] | None = tuple(
                    _check_positive_int(v, "latent_dim") for v in dims
                )
            except TypeError:
                raise ValueError(
                    f"latent_dim must be an int or a tuple of ints, got {latent_dim!r}"
                ) from None
            if not self.latent_shape:
                raise ValueError("latent_dim must not be empty")
        else:
            self.latent_shape = None
        self.generator = generator
        self.sample_fn = sample_fn
        self.n_samples = _check_positive_int(n_samples, "n_samples")
        self.chunk = _check_positive_int(chunk, "chunk")
        self._samples: torch.Tensor | None = None
        super().__init__(
            name=name, modules=() if generator is None else (generator,), transform=transform
        )

    @property
    def samples(self) -> torch.Tensor | None:
        """The flattened samples drawn by the last ``prepare()`` (None after ``release()``)."""
        return self._samples

    @torch.no_grad()
    def prepare(self, device: Any = None) -> None:
        """Draw this check's ``n_samples`` generated records (from ``sample_fn``, or the
        generator on N(0, I) latents from the global torch RNG, which the monitor restores)."""
        dev = _module_device(self.modules, fallback=device)
        if self.sample_fn is not None:
            g = _first_tensor(self.sample_fn(self.n_samples, dev), "sample_fn")
            if g.ndim == 0 or g.shape[0] != self.n_samples:
                raise ValueError(
                    f"sample_fn returned shape {tuple(g.shape)}; expected {self.n_samples} samples"
                )
            g = g.to(dev).reshape(self.n_samples, -1)
        else:
            assert self.generator is not None and self.latent_shape is not None
            parts = []
            for i in range(0, self.n_samples, self.chunk):
                m = min(self.chunk, self.n_samples - i)
                z = torch.randn((m, *self.latent_shape), device=dev)
                out = _first_tensor(self.generator(z), "generator")
                parts.append(out.reshape(m, -1))
            g = torch.cat(parts)
        self._samples = _as_float(g)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        g = self._samples
        if g is None:
            raise RuntimeError(
                f"{type(self).__name__}.prepare() must run before scoring (it draws the samples)"
            )
        x = _flat_records(
            batch, g.device, self.transform, g.shape[1], self.name, "generated samples have"
        )
        dtype = torch.promote_types(_as_float(x[:0]).dtype, g.dtype)
        x, g = x.to(dtype), g.to(dtype)
        out = torch.empty(x.shape[0], dtype=dtype, device=g.device)
        for i in range(0, x.shape[0], self.chunk):
            d = torch.cdist(x[i : i + self.chunk], g, compute_mode="donot_use_mm_for_euclid_dist")
            out[i : i + self.chunk] = d.amin(dim=1)
        return out

    def release(self) -> None:
        """Drop the check's generated records."""
        self._samples = None


class HybridQuery(Query):
    """(D(x), min_j ||x - g_j||) (MACE eq. 21): the columns of two queries side by side, (n, 2).

    Any two queries work (vector ones contribute all their columns). ``modules`` is their union;
    ``prepare`` / ``release`` are forwarded to both. Scores are promoted to a common dtype and
    moved to the first query's output device.
    """

    def __init__(
        self, discriminator_query: Query, nearest_query: Query, *, name: str = "hybrid"
    ) -> None:
        for q, arg in (
            (discriminator_query, "discriminator_query"),
            (nearest_query, "nearest_query"),
        ):
            if not isinstance(q, Query):
                raise ValueError(f"{arg} must be a privmon Query, got {type(q).__name__}")
        self.queries = (discriminator_query, nearest_query)
        super().__init__(
            name=name, modules=discriminator_query.modules + nearest_query.modules, transform=None
        )

    def prepare(self, device: Any = None) -> None:
        """Prepare every part query."""
        for q in self.queries:
            q.prepare(device)

    def __call__(self, batch: Batch) -> torch.Tensor:
        cols = [q(batch) for q in self.queries]
        dev = cols[0].device
        dtype = torch.promote_types(cols[0].dtype, cols[1].dtype)
        cols = [c.to(device=dev, dtype=dtype) for c in cols]
        n = cols[0].shape[0]
        if cols[1].shape[0] != n:
            raise ValueError(
                f"{self.name}: the two queries returned {n} and {cols[1].shape[0]} rows"
            )
        return torch.cat([c.reshape(n, -1) for c in cols], dim=1)

    def release(self) -> None:
        """Release every part query."""
        for q in self.queries:
            q.release()


# --- reference-model attacks ---------------------------------------------------------------------

_REFERENCE_ATTACKS = ("lira", "rmia", "calibrated")


class ReferenceModelQuery(_ClassifierQuery):
    """A reference-model attack on a classifier as a monitor query, shape (n,), higher = member.

    ``references`` are classifiers of the same task as ``model``, trained by the user. Each
    attack is the functional one of :mod:`privmon.attacks.reference` on φ, the logit-scaled
    confidence (:class:`LogitConfidenceQuery`), p_y = sigmoid(φ) and the loss
    −log p_y = softplus(−φ), with the reference models that trained on a record known from
    ``reference_data`` and ``reference_in`` (records matched by content: input bytes and label).
    Without ``reference_data`` every reference counts as trained without every record (for
    example references trained on a held-out pool, never on the audit records):

    - ``"lira"``: LiRA (Carlini et al., "Membership Inference Attacks From First Principles").
      Offline (§VI-A, default): log Φ((φ_θ(x) − μ_out(x)) / σ_out(x)), μ_out and σ²_out the mean
      and (maximum-likelihood) variance of φ over the references trained without x. Online
      (``online=True``, eq. 4): log N(φ_θ(x); μ_in, σ²_in) − log N(φ_θ(x); μ_out, σ²_out), the
      in-Gaussian fitted over the references that trained on x; this needs references trained
      on the audit records, each record in about half of them (e.g. an ensemble of
      :func:`privmon.audit.train_ensemble` on :func:`privmon.audit.random_halves` of the
      members and non-members the monitor audits). The offline test sees only how far φ
      rises above the out-models; the online one also knows how high training drives φ, so it
      tells apart a non-member the model gets wrong from a member, as a loss threshold does.
      With ``fixed_variance`` one σ² per side for all records, the mean per-record variance:
      offline over the ``population`` records, online over the ``reference_data`` records
      (the paper advises it below about 64 references);
    - ``"rmia"``: RMIA (Zarifzadeh et al., "Low-Cost High-Power Membership Inference Attacks"):
      the fraction of ``population`` records z with r(x) / r(z) ≥ ``gamma``, r = p_θ / Pr;
      offline Pr(x) = ½((1 + a)·mean of p_y over the references trained without x + (1 − a)),
      online the mean over all references;
    - ``"calibrated"``: the difficulty-calibrated loss (Watson et al., "On the Importance of
      Difficulty Calibration in Membership Inference Attacks"), the mean loss of the
      references trained without x minus the model's loss.

    A record lacking the reference scores its attack needs (e.g. online LiRA for a record no
    reference trained on) scores NaN, which the monitor drops and counts.

    Cost per check: one forward of ``model`` per batch (and, for RMIA, on the population in
    ``prepare``). The references do not change during training, so their per-record values
    (Gaussian fits, Pr(x), the mean loss) are computed once per batch content and cached, keyed
    like :class:`privmon.attacks.GeneratorQuery`'s cache by dtype, shape and a BLAKE2b digest of
    the batch's inputs and labels (after ``transform``); inputs that are not a tensor (keyword
    inputs) are not cached. ``release()`` keeps only the entries the check used, so memory
    stays O(audit records). Counters: :attr:`n_reference_evaluations` (records run through the
    references), :attr:`cache_hits`, :attr:`cache_misses` (batches).

    Args:
        model: the classifier being trained.
        references: a sequence of reference classifiers (listed in ``modules`` so the monitor
            puts them in eval mode) or a :class:`privmon.audit.Ensemble`; outputs are logits as
            for every classifier query.
        attack: ``"lira"`` (default), ``"rmia"`` or ``"calibrated"``.
        online: LiRA's and RMIA's online form (above); needs ``reference_data``.
        reference_data: the records ``(x, y)`` the references were trained on (their union, as
            the model takes them, after ``transform``), tensors with one row per record.
        reference_in: (k, m) bool, reference i trained on record j of ``reference_data``;
            default: the :class:`~privmon.audit.Ensemble`'s ``masks`` (``reference_data`` is
            then the data it was trained on). Identical records are merged (a reference
            trained on any copy trained on the record).
        population: records ``(x, y)`` that neither ``model`` nor the references trained on;
            required for ``"rmia"`` and for offline ``fixed_variance``.
        fixed_variance: LiRA with one variance per side for all records. False by default
            (per-record variances, at least two references a side), unlike
            :func:`privmon.attacks.lira`, whose default turns to the fixed variance below
            64 references; Carlini et al. advise it below about 64 references.
        a: RMIA's offline slope in [0, 1]; gamma: its likelihood-ratio threshold > 0.
        cache: cache the references' per-record values across checks.
        name: defaults to ``attack`` (``"lira_online"`` / ``"rmia_online"`` when online).
        transform: ``batch -> (x, y)`` adapter.
    """

    higher_is_member = True

    def __init__(
        self,
        model: nn.Module,
        references: Sequence[nn.Module] | Ensemble,
        *,
        attack: str = "lira",
        online: bool = False,
        reference_data: tuple[Any, Any] | None = None,
        reference_in: Any = None,
        population: tuple[Any, Any] | None = None,
        fixed_variance: bool = False,
        a: float = 0.3,
        gamma: float = 1.0,
        cache: bool = True,
        name: str | None = None,
        transform: Transform | None = None,
    ) -> None:
        if attack not in _REFERENCE_ATTACKS:
            raise ValueError(f"attack must be one of {_REFERENCE_ATTACKS}, got {attack!r}")
        if isinstance(references, Ensemble):
            refs: tuple[nn.Module, ...] = ()
            n_refs = len(references)
        else:
            if isinstance(references, nn.Module) and not isinstance(references, nn.ModuleList):
                raise ValueError(
                    "references must be a sequence of modules or an Ensemble, got one "
                    f"{type(references).__name__}: pass a single reference as [reference]"
                )
            refs = tuple(_check_module(m, "references") for m in references)
            if not refs:
                raise ValueError("references must hold at least one reference model")
            n_refs = len(refs)
        # the modules themselves: an iterator passed as references is read once, here
        self.references: tuple[nn.Module, ...] | Ensemble = (
            references if isinstance(references, Ensemble) else refs
        )
        self.attack = attack
        self.online = check_flag(online, name="online")
        if self.online and attack == "calibrated":
            raise ValueError(
                "online must be False for attack='calibrated': the calibrated loss compares "
                "with the references trained without the record"
            )
        if self.online and reference_data is None:
            raise ValueError(
                "online=True needs reference_data: the records (x, y) the references trained "
                "on (and reference_in, which reference trained on which, unless references is "
                "an Ensemble)"
            )
        self.fixed_variance = check_flag(fixed_variance, name="fixed_variance")
        self.a = check_unit(a, name="a")
        self.gamma = check_positive(gamma, name="gamma")
        self.cache = check_flag(cache, name="cache")
        offline_fixed = attack == "lira" and self.fixed_variance and not self.online
        if population is None and (attack == "rmia" or offline_fixed):
            raise ValueError(
                "population (x, y) is required for attack='rmia' and for offline "
                "fixed_variance: records neither the model nor the references trained on"
            )
        self.population = _records_on_cpu(_check_pair(population, "population"), "population")
        self.reference_data = _records_on_cpu(
            _check_pair(reference_data, "reference_data"), "reference_data"
        )
        self._reference_in = self._check_reference_in(reference_in, n_refs)
        default = f"{attack}_online" if self.online else attack
        super().__init__(model, name=default if name is None else name, transform=transform)
        self._check_reference_counts(n_refs)
        self.modules = _unique_modules((model, *refs))
        self._population_values: torch.Tensor | None = None  # Pr(z) or the pooled σ²_out
        self._pooled_variances: torch.Tensor | None = None  # online fixed: σ²_in, σ²_out
        self._population_ratio: torch.Tensor | None = None  # r(z) of the current check
        self._columns: dict[bytes, int] | None = None  # record digest -> reference_in column
        self._cache: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self.n_reference_evaluations = 0
        self.cache_hits = 0
        self.cache_misses = 0

    def _check_reference_in(self, reference_in: Any, n_refs: int) -> torch.Tensor | None:
        if self.reference_data is None:
            if reference_in is not None:
                raise ValueError("reference_in needs reference_data, the records it refers to")
            return None
        m = self.reference_data[0].shape[0]
        if reference_in is None:
            if not isinstance(self.references, Ensemble):
                raise ValueError(
                    "reference_in is required with reference_data unless references is an "
                    f"Ensemble: a boolean array of shape ({n_refs}, {m})"
                )
            reference_in = self.references.masks
        if not isinstance(reference_in, torch.Tensor):
            reference_in = np.asarray(reference_in)
        return as_mask(
            reference_in, name="reference_in", shape=(n_refs, m), device=torch.device("cpu")
        )

    def _check_reference_counts(self, n_refs: int) -> None:
        """Fail when no record can have the references its attack needs on each side (LiRA's
        per-record variances need two scores a side, a fixed variance one; the offline attacks
        need out-references); warn when only some records can (the others score NaN)."""
        if self.attack == "lira":
            per_side = 1 if self.fixed_variance else 2
            need_in, need_out = (per_side if self.online else 0), per_side
        else:  # RMIA's Pr(x), the calibrated loss: means over the references
            need_in, need_out = 0, (0 if self.online else 1)
        if self._reference_in is None:
            ins = torch.zeros(1, dtype=torch.long)  # every reference trained without every record
            outs = torch.full((1,), n_refs)
        else:
            ins = self._reference_in.sum(dim=0)
            outs = n_refs - ins
        usable = (ins >= need_in) & (outs >= need_out)
        form = "online" if self.online else "offline"
        needs = (
            f"{form} {self.attack} needs {need_in} references trained on a record and "
            f"{need_out} trained without it"
        )
        if not bool(usable.any()):
            where = "" if self._reference_in is None else " for any record of reference_data"
            raise ValueError(
                f"references: {needs}, which {n_refs} references do not give{where}; train "
                "more references" + (" or pass fixed_variance=True" if need_out == 2 else "")
            )
        if not bool(usable.all()):
            warnings.warn(
                f"{self.name}: {int((~usable).sum())} of {usable.numel()} records of "
                f"reference_data will score NaN (dropped and counted): {needs}",
                UserWarning,
                stacklevel=3,
            )

    def _reference_phi(self, x: Any, y: torch.Tensor, n_classes: int | None) -> torch.Tensor:
        """φ of every record under every reference, (k, n) float64 on y's device; the
        references' logits checked for ``n_classes`` classes (the model's; None: only that the
        references agree and the labels fit them)."""
        self.n_reference_evaluations += y.shape[0]
        try:
            if isinstance(self.references, Ensemble):
                outs = list(_first_tensor(self.references(x), "references").unbind(0))
            else:
                outs = [_forward(m, _to_device(x, _module_device((m,)))) for m in self.references]
            logits = [self._logits(o).to(y.device, torch.float64) for o in outs]
        except (RuntimeError, TypeError, ValueError) as err:
            raise ValueError(
                f"{self.name}: the references failed on records the model takes ({err}); "
                "references must take the model's inputs (dtype, shape) and return its logits"
            ) from err
        widths = sorted({z.shape[1] for z in logits})
        if len(widths) > 1 or (n_classes is not None and widths[0] != n_classes):
            model = "" if n_classes is None else f", the model over {n_classes}"
            raise ValueError(
                f"references must return logits over the model's classes: they return "
                f"{' / '.join(map(str, widths))} classes{model}"
            )
        labels = self._labels(y, logits[0])
        return logit_confidence_from_logits(torch.stack(logits), labels.expand(len(outs), -1))

    def _shadow_in(self, x: Any, y: torch.Tensor) -> torch.Tensor | None:
        """(k, n) bool: reference i trained on record j of the batch (matched by content in
        ``reference_data``); None without ``reference_data``."""
        if self._reference_in is None or self.reference_data is None:
            return None
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{self.name}: reference_data matches tensor inputs only")
        if self._columns is None:
            rx, ry = self.reference_data
            keys = _record_digests(rx.to(x.dtype), ry.long())
            columns: dict[bytes, int] = {}
            merged = self._reference_in.clone()
            for j, key in enumerate(keys):
                first = columns.setdefault(key, j)
                merged[:, first] |= self._reference_in[:, j]
            self._columns, self._reference_in = columns, merged
        cols = torch.tensor([self._columns.get(k, -1) for k in _record_digests(x, y)])
        found = cols >= 0
        if self.online and not bool(found.any()):
            raise ValueError(
                f"{self.name}: none of the batch's {cols.shape[0]} records is in reference_data "
                "(records are matched by input bytes and label, after transform); the online "
                "attacks need references trained on the audit records"
            )
        m = torch.zeros(self._reference_in.shape[0], cols.shape[0], dtype=torch.bool)
        m[:, found] = self._reference_in[:, cols[found]]
        return m.to(y.device)

    def _reference_values(self, x: Any, y: torch.Tensor, n_classes: int | None) -> torch.Tensor:
        """The per-record reference values: (6, n) μ, σ², count of the in and the out side
        (LiRA), (n,) Pr(x) (RMIA) or the out-references' mean loss (calibrated)."""
        phi = self._reference_phi(x, y, n_classes)
        m = self._shadow_in(x, y)
        out = None if m is None else ~m
        if self.attack == "lira":
            mu_out, var_out, n_out = gaussian_fit(phi, out)
            if m is None:
                mu_in, var_in, n_in = torch.full((3, phi.shape[1]), math.nan, dtype=phi.dtype)
            else:
                mu_in, var_in, n_in = gaussian_fit(phi, m)
            counts = (n_in.to(phi.dtype), n_out.to(phi.dtype))
            return torch.stack([mu_in, var_in, counts[0], mu_out, var_out, counts[1]])
        if self.attack == "rmia":
            return rmia_marginal(torch.sigmoid(phi), m, online=self.online, a=self.a)
        return gaussian_fit(F.softplus(-phi), out)[0]

    def _lookup(self, x: Any, y: torch.Tensor, n_classes: int) -> torch.Tensor:
        if not (self.cache and isinstance(x, torch.Tensor)):
            return self._reference_values(x, y, n_classes)
        key = (_digest(x), _digest(y))
        self._used.add(key)
        hit = self._cache.get(key)
        if hit is not None:
            self.cache_hits += 1
            return hit.to(y.device)
        self.cache_misses += 1
        values = self._reference_values(x, y, n_classes)
        self._cache[key] = values
        return values

    def _records(self, pair: tuple[Any, Any] | None, what: str) -> tuple[Any, torch.Tensor]:
        if pair is None:
            raise ValueError(f"{self.name}: this attack needs {what}")
        x, y = _split_batch(tuple(pair), self.device)
        if y is None:
            raise ValueError(f"{what} must be a pair (x, y) of inputs and labels")
        return x, y.long()

    @torch.no_grad()
    def prepare(self, device: Any = None) -> None:
        """RMIA: r(z) of the population under the current model; LiRA with a fixed variance:
        the references' pooled variances (computed once)."""
        pooled = self._pooled_variances if self.online else self._population_values
        if self.attack == "lira" and self.fixed_variance and pooled is None:
            if self.online:
                x, y = self._records(self.reference_data, "reference_data")
                v = self._reference_values(x, y, None)
                self._pooled_variances = torch.stack(
                    [pooled_variance(v[1], v[2]), pooled_variance(v[4], v[5])]
                )
            else:
                x, y, logits = self._population()
                v = self._reference_values(x, y, logits.shape[1])
                self._population_values = pooled_variance(v[4], v[5])
        if self.attack != "rmia":
            return
        x, y, logits = self._population()
        if self._population_values is None:
            self._population_values = self._reference_values(x, y, logits.shape[1])
        p = torch.sigmoid(logit_confidence_from_logits(logits.double(), y))
        ratio = p / self._population_values.to(p.device)
        finite = ~torch.isnan(ratio)
        self._population_ratio = ratio[finite]
        if self._population_ratio.numel() == 0:
            raise ValueError(
                f"{self.name}: no population record has a finite probability ratio (non-finite "
                "inputs or outputs of the model or the references)"
            )
        if not bool(finite.all()):
            logger.warning(
                "privmon: %s: %d of %d population records have no finite probability ratio "
                "and are left out of the comparison",
                self.name,
                int((~finite).sum()),
                finite.numel(),
            )

    def _population(self) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The population's inputs, its labels checked against the model's logits, the logits."""
        x, y = self._records(self.population, "population")
        logits = self._logits(_forward(self.model, x))
        try:
            return x, self._labels(y, logits), logits
        except ValueError as err:
            raise ValueError(f"population: {err}") from None

    def _variance(self, var: torch.Tensor, count: torch.Tensor, side: int) -> torch.Tensor:
        """Per-record (two scores or more) or the fixed variance (one or more) of one side
        (0: in, 1: out), floored as :func:`privmon.attacks.reference.fit_variance`."""
        if not self.fixed_variance:
            return fit_variance(var, count, fixed=False)
        pooled = self._pooled_variances if self.online else self._population_values
        if pooled is None:
            raise RuntimeError(f"{type(self).__name__}.prepare() must run before scoring")
        pooled = pooled.reshape(-1)[side if self.online else 0].to(var.device)
        return fit_variance(var, count, fixed=True, pooled=pooled)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, logits, y = self._forward_labelled(batch)
        phi = logit_confidence_from_logits(logits.to(torch.float64), y)
        values = self._lookup(x, y, logits.shape[1])
        if self.attack == "lira":
            mu_in, var_in, n_in, mu_out, var_out, n_out = values
            var_out = self._variance(var_out, n_out, 1)
            if not self.online:
                return lira_offline_score(phi, mu_out, var_out)
            var_in = self._variance(var_in, n_in, 0)
            score = log_normal(phi, mu_in, var_in) - log_normal(phi, mu_out, var_out)
            return torch.where(torch.isfinite(phi), score, math.nan)
        if self.attack == "rmia":
            if self._population_ratio is None:
                raise RuntimeError(f"{type(self).__name__}.prepare() must run before scoring")
            ratio = torch.where(torch.isfinite(phi), torch.sigmoid(phi) / values, math.nan)
            return rmia_score(ratio, self._population_ratio.to(phi.device), self.gamma)
        return torch.where(torch.isfinite(phi), values - F.softplus(-phi), math.nan)

    def release(self) -> None:
        """Drop the check's population ratios; keep only the cache entries this check used."""
        self._population_ratio = None
        self._cache = {k: v for k, v in self._cache.items() if k in self._used}
        self._used = set()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, attack={self.attack!r}, "
            f"online={self.online})"
        )


def _check_pair(pair: Any, name: str) -> tuple[Any, Any] | None:
    if pair is not None and (not isinstance(pair, tuple | list) or len(pair) != 2):
        raise ValueError(f"{name} must be a pair (x, y) of inputs and labels")
    return None if pair is None else tuple(pair)


def _records_on_cpu(
    pair: tuple[Any, Any] | None, name: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Records ``(x, y)`` as CPU tensors, checked for at least one record, one integer label
    per input row."""
    if pair is None:
        return None
    x, y = (v.detach().cpu() if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in pair)
    if x.ndim == 0 or tuple(y.shape) != (x.shape[0],) or x.shape[0] == 0:
        raise ValueError(
            f"{name} must be a pair (x, y) with one row per record (at least one) and labels of "
            f"shape (n,), got shapes {tuple(x.shape)} and {tuple(y.shape)}"
        )
    integral = not y.is_complex() and (not y.is_floating_point() or bool((y == y.round()).all()))
    if not integral:
        raise ValueError(f"{name}: labels must be integer class indices, got {y.dtype} values")
    return x, y.long()


def _record_digests(x: torch.Tensor, y: torch.Tensor) -> list[bytes]:
    """One 128-bit BLAKE2b digest per record of its input row's bytes and its label."""
    rows = x.detach().cpu().contiguous().reshape(x.shape[0], -1).view(torch.uint8).numpy()
    labels = y.detach().cpu().long().reshape(-1, 1).view(torch.uint8).numpy()
    return [
        hashlib.blake2b(r.tobytes() + lab.tobytes(), digest_size=16).digest()
        for r, lab in zip(rows, labels, strict=True)
    ]


# --- anything else --------------------------------------------------------------------------------


class CallableQuery(Query):
    """Wrap any callable ``fn(batch) -> scores`` (raw batch in; tensor, array or sequence out).

    Scores become a float tensor of shape (n,) or (n, d) on the device of ``modules`` (or, without
    modules, of the tensor ``fn`` returned; CPU for arrays). ``fn`` runs in whatever grad mode the
    caller set (the monitor: no_grad), so a gradient-based query can use ``torch.enable_grad()``.
    List every module ``fn`` runs in ``modules`` so the monitor protects its mode.
    """

    def __init__(
        self,
        fn: Callable[[Batch], Any],
        *,
        name: str,
        modules: nn.Module | Iterable[nn.Module] = (),
        discrete: bool = False,
        higher_is_member: bool | None = None,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        if higher_is_member not in (None, True, False):
            raise ValueError(
                f"higher_is_member must be None, True or False, got {higher_is_member!r}"
            )
        self.fn = fn
        self.discrete = bool(discrete)
        self.higher_is_member = higher_is_member
        super().__init__(name=name, modules=modules)

    def __call__(self, batch: Batch) -> torch.Tensor:
        out = self.fn(batch)
        t = out if isinstance(out, torch.Tensor) else torch.as_tensor(np.asarray(out))
        if self.modules:
            t = t.to(self.device)
        if t.is_complex():
            raise ValueError(f"{self.name}: fn returned complex scores")
        t = _as_float(t.detach())
        if t.ndim not in (1, 2):
            raise ValueError(
                f"{self.name}: fn returned shape {tuple(t.shape)}; expected (n,) or (n, d)"
            )
        return t
