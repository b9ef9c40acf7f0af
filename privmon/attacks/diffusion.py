"""Membership statistics of diffusion models, per image, from the noise predictor ε_θ(x_t, t).

A DDPM with T steps noises an image x_0 to x_t = √ᾱ_t · x_0 + √(1 − ᾱ_t) · ε, ᾱ_t the
scheduler's ``alphas_cumprod[t]``, and its model predicts the noise. :func:`diffusion_statistic`
computes one of :data:`STATISTICS` per image and timestep t; each is a distance, lower for members
(:data:`HIGHER_IS_MEMBER`):

- ``loss``: ‖ε − ε_θ(√ᾱ_t x_0 + √(1 − ᾱ_t) ε, t)‖², ε ~ N(0, I) given (Matsumoto et al.,
  "Membership Inference Attacks against Diffusion Models"; Carlini et al., "Extracting Training
  Data from Diffusion Models");
- ``pia``: ε̂ = ε_θ(x_0, 0), then Σ|ε̂ − ε_θ(√ᾱ_t x_0 + √(1 − ᾱ_t) ε̂, t)|^p; ``pian`` first
  normalises ε̂ ← ε̂ / mean|ε̂| · √(2/π) (Kong et al., "An Efficient Membership Inference Attack
  for the Diffusion Model by Proximal Initialization");
- ``secmi``: deterministic DDIM inversion from 0 to t + k in strides of k, one DDIM step back
  from t + k to t, ‖x̃_t − x̂_t‖² (Duan et al., "Are Diffusion Models Vulnerable to Membership
  Inference Attacks?");
- ``sima``: Σ|ε_θ(x_0, t)|⁴ ("SimA", arXiv 2509.25003).

The timesteps of one batch go through the model together, at most ``max_batch`` images per call
(the memory bound: beyond the batch, nothing of m times its size is held; the loss's noise is
drawn call by call); the ε_θ evaluations per image are :func:`model_calls`. Formulas: docs,
*Diffusion models*.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from privmon._registry import Registry
from privmon._shown import described
from privmon._validation import (
    check_alphas_cumprod,
    check_int,
    check_positive,
    check_timesteps,
)

__all__ = [
    "HIGHER_IS_MEMBER",
    "MAX_BATCH_VALUES",
    "STATISTICS",
    "DiffusionStatistic",
    "StatisticInputs",
    "alphas_cumprod",
    "diffusion_statistic",
    "model_calls",
    "module_of",
    "noise_prediction",
    "register_statistic",
    "statistic_of",
    "unregister_statistic",
]

Statistic = Literal["loss", "pia", "pian", "secmi", "sima"]

MAX_BATCH_VALUES = 2**20
"""Default bound on one model call's input: ``max_batch = max(1, ⌊2²⁰ / values per image⌋)``
images (4 MiB of float32 input; the model's activations are a multiple of it)."""

Model = Callable[..., Any]


def alphas_cumprod(scheduler: Any) -> torch.Tensor:
    """ᾱ_0 … ᾱ_{T−1} of a scheduler, as a float64 CPU tensor (the scheduler is only read).

    Args:
        scheduler: a diffusers scheduler (``DDPMScheduler``, ``DDIMScheduler``, …: anything with
            ``alphas_cumprod``), or the 1-D tensor / array of ᾱ_t itself.

    Examples:
        >>> import torch
        >>> from privmon.attacks import alphas_cumprod
        >>> betas = torch.linspace(1e-4, 0.02, 1000)
        >>> abar = alphas_cumprod(torch.cumprod(1 - betas, dim=0))
        >>> abar.shape, abar.dtype
        (torch.Size([1000]), torch.float64)
    """
    values: Any = scheduler
    if not isinstance(scheduler, torch.Tensor | np.ndarray | list | tuple):
        values = getattr(scheduler, "alphas_cumprod", None)
        if values is None:
            raise ValueError(
                "scheduler must be a diffusers scheduler with alphas_cumprod (pip install "
                "'privmon[diffusion]') or a 1-D tensor of the cumulative alphas ᾱ_t, got "
                f"{type(scheduler).__name__}"
            )
    return check_alphas_cumprod(values, name="scheduler")


def model_calls(statistic: str, timesteps: int | Sequence[int], *, interval: int = 10) -> int:
    """ε_θ evaluations per image for a statistic at the given timesteps (m of them): ``loss``
    and ``sima`` m, ``pia`` / ``pian`` 1 + m, ``secmi`` max(t)/k + 2 (the inversion is shared by
    the timesteps). :func:`diffusion_statistic` batches them into as few model calls as
    ``max_batch`` allows.

    Examples:
        >>> from privmon.attacks import model_calls
        >>> model_calls("pia", [20, 40, 60]), model_calls("secmi", 100, interval=10)
        (4, 12)
    """
    stat = statistic_of(statistic)
    ts = (timesteps,) if isinstance(timesteps, int) else tuple(timesteps)
    return stat.model_calls(ts, interval=interval)


def module_of(fn: Any) -> nn.Module | None:
    """The module a callable runs: itself, or the module a bound method belongs to (None for
    any other callable).

    Examples:
        >>> import torch
        >>> from privmon.attacks.diffusion import module_of
        >>> net = torch.nn.Linear(2, 2)
        >>> module_of(net) is net, module_of(net.forward) is net, module_of(len)
        (True, True, None)
    """
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def noise_prediction(
    model: Model,
    x_t: torch.Tensor,
    t: torch.Tensor,
    *,
    conditioning: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """ε_θ(x_t, t): ``model(x_t, t, **conditioning)``, its ``.sample`` (a diffusers UNet), its
    ``["sample"]``, the first element of a tuple, or the tensor it returned; checked to have
    ``x_t``'s shape. ``x_t`` is cast to the model's parameter dtype; the result has ``x_t``'s.

    Args:
        model: a diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` or any module or callable
            ``(x_t, t, **conditioning) -> ε̂``.
        x_t: noisy images (n, ...).
        t: timesteps, a LongTensor of shape (n,).
        conditioning: keyword arguments for the model (e.g. ``encoder_hidden_states``).

    Examples:
        >>> import torch
        >>> from privmon.attacks import noise_prediction
        >>> def model(x, t):  # any callable (x_t, t) -> ε̂
        ...     return 0.5 * x + t.view(-1, 1, 1, 1)
        >>> noise_prediction(model, torch.ones(2, 1, 2, 2), torch.tensor([0, 1]))[:, 0, 0, 0]
        tensor([0.5000, 1.5000])
    """
    owner = module_of(model)  # a module, or a bound method of one: its weights' dtype
    param = next(owner.parameters(), None) if owner is not None else None
    x_in = x_t.to(param.dtype) if param is not None and param.is_floating_point() else x_t
    out = model(x_in, t, **(conditioning or {}))
    if isinstance(getattr(out, "sample", None), torch.Tensor):
        out = out.sample
    elif isinstance(out, Mapping) and isinstance(out.get("sample"), torch.Tensor):
        out = out["sample"]
    elif isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        out = out[0]
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x_t.shape):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model returned {got} for x_t of shape {tuple(x_t.shape)}; expected the predicted "
            "noise ε̂, shaped like x_t (a model that also predicts a variance: pass "
            "model=lambda x, t: unet(x, t).sample[:, :C])"
        )
    return out.to(x_t.dtype)


def _check_noise(noise: Any, shape: tuple[int, ...]) -> torch.Tensor | torch.Generator:
    """``noise`` after checking it is ε of ``shape`` (images, timesteps, ...) or a CPU
    generator to draw it from."""
    if isinstance(noise, torch.Generator):
        if noise.device.type != "cpu":
            raise ValueError(f"noise must be a CPU torch.Generator, got one on {noise.device}")
        return noise
    if isinstance(noise, torch.Tensor) and tuple(noise.shape) == shape:
        return noise.detach()
    got = f"shape {tuple(noise.shape)}" if isinstance(noise, torch.Tensor) else type(noise).__name__
    raise ValueError(
        f"statistic 'loss' needs noise= of shape {shape} (images, timesteps, ...) or a CPU "
        f"torch.Generator to draw it from, got {got}"
    )


def _check_conditioning(conditioning: Any, n: int, *, where: str) -> None:
    """Every tensor in ``conditioning`` (nested mappings too) has one row per image."""
    if not isinstance(conditioning, Mapping):
        raise ValueError(
            f"{where} must be a mapping of keyword arguments, got {described(conditioning)}"
        )
    for key, value in conditioning.items():
        name = f"{where}[{key!r}]"
        if isinstance(value, Mapping):
            _check_conditioning(value, n, where=name)
        elif isinstance(value, torch.Tensor) and (value.ndim == 0 or value.shape[0] != n):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} for {n} images; expected one row per "
                "image (shape (n, ...))"
            )


def _rows_of(conditioning: Mapping[str, Any], records: torch.Tensor) -> dict[str, Any]:
    """The conditioning of the given records (tensors indexed along dim 0, recursively)."""
    out: dict[str, Any] = {}
    for key, value in conditioning.items():
        if isinstance(value, Mapping):
            out[key] = _rows_of(value, records)
        elif isinstance(value, torch.Tensor):
            out[key] = value.index_select(0, records.to(value.device))
        else:
            out[key] = value
    return out


class _Rows:
    """ε_θ over rows r = j·n + i (timestep j, image i), at most ``max_batch`` rows per call;
    ``reduce(rows, eps)`` turns each call's ε̂ into what is kept (per-row scores, or ε̂)."""

    def __init__(self, model: Model, n: int, conditioning: Mapping[str, Any], max_batch: int):
        self.model, self.n, self.conditioning, self.max_batch = model, n, conditioning, max_batch

    def predict(self, rows: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """ε̂ of one call: the rows' inputs, with their images' conditioning."""
        cond = _rows_of(self.conditioning, rows % self.n)
        return noise_prediction(self.model, x_t, t, conditioning=cond)

    def map(
        self,
        count: int,
        build: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
    ) -> torch.Tensor:
        out = []
        for start in range(0, count, self.max_batch):
            rows = torch.arange(start, min(count, start + self.max_batch), device=device)
            out.append(reduce(rows, self.predict(rows, *build(rows))))
        return torch.cat(out)


class _Draws:
    """The values of ``torch.randn(total, generator=generator)`` (CPU, the default dtype), taken
    in pieces. torch draws a tensor of 16 or more values as uniforms, turned into normals 16 at
    a time, the last 16 drawn again when the size is not a multiple of 16: pieces of whole 16s,
    the last one of 16 or more, give the one draw's values and leave the generator where it
    would (tests/queries/test_diffusion_memory.py checks it)."""

    def __init__(self, total: int, generator: torch.Generator) -> None:
        self.left, self.generator = total, generator
        self.kept = torch.empty(0)

    def take(self, k: int) -> torch.Tensor:
        """The next ``k`` values."""
        while self.kept.numel() < k:
            size = -(-(k - self.kept.numel()) // 16) * 16
            if self.left - size < 16:  # the rest in this piece: no piece under 16 values
                size = self.left
            self.kept = torch.cat([self.kept, torch.randn(size, generator=self.generator)])
            self.left -= size
        out, self.kept = self.kept[:k], self.kept[k:]
        return out


def _loss(
    rows: _Rows,
    noise: torch.Tensor | torch.Generator,
    noised: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    like: torch.Tensor,
    m: int,
) -> torch.Tensor:
    """‖ε − ε_θ(x_t, t)‖² of every row r = j·n + i, ``max_batch`` rows at a time (``like``:
    the images, for their shape, dtype and device). The rows of one call are consecutive in
    ε's order (image i, then timestep j), so only their ε is held (drawn then, when ``noise``
    is a generator); within a call they go timestep by timestep, so a batch that fits one call
    is the one call it was before ε was drawn piece by piece."""
    n, shape, device = rows.n, tuple(like.shape[1:]), like.device
    size = math.prod(shape)
    if isinstance(noise, torch.Generator):
        draws = _Draws(n * m * size, noise)

        def chunk(start: int, stop: int) -> torch.Tensor:
            return draws.take((stop - start) * size).view(-1, *shape)
    else:
        flat = noise.reshape(n * m, *shape)

        def chunk(start: int, stop: int) -> torch.Tensor:
            return flat[start:stop]

    scores = torch.empty(n * m, device=device, dtype=like.dtype)
    for start in range(0, n * m, rows.max_batch):
        stop = min(n * m, start + rows.max_batch)
        k = torch.arange(start, stop, device=device)  # ε's order: k = i·m + j
        r, order = torch.sort((k % m) * n + k // m)  # the call's order: r = j·n + i
        eps = chunk(start, stop).to(device, like.dtype)[order]
        scores[r] = _power_sum(eps - rows.predict(r, *noised(r, eps)), 2)
    return scores


def _at(x: torch.Tensor, s: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The rows of ``x`` (one per image), all at timestep ``s``."""
    t = torch.full((x.shape[0],), s, dtype=torch.long, device=x.device)
    return lambda r: (x[r], t[r])


def _keep(rows: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    return eps


def _power_sum(x: torch.Tensor, p: float) -> torch.Tensor:
    return (x.abs() ** p).flatten(1).sum(dim=1)


def diffusion_statistic(
    model: Model,
    images: torch.Tensor,
    alphas_cumprod: Any,
    *,
    statistic: str,
    timesteps: int | Sequence[int],
    interval: int = 10,
    p: float = 4.0,
    noise: torch.Tensor | torch.Generator | None = None,
    conditioning: Mapping[str, Any] | None = None,
    max_batch: int | None = None,
) -> torch.Tensor:
    """One membership statistic per image and timestep, shape (n, m), lower for members.

    Computed without gradients on ``images``' device, in float32 (float64 images: float64);
    the model's own mode and state are left as they are (the monitor sets eval mode).

    Args:
        model: the noise predictor (see :func:`noise_prediction`).
        images: x_0 as the model was trained on them (or latents), shape (n, ...), n ≥ 1.
        alphas_cumprod: ᾱ_0 … ᾱ_{T−1} (:func:`alphas_cumprod` reads a scheduler's).
        statistic: one of :data:`STATISTICS` (formulas in the module docstring).
        timesteps: t_1 … t_m, each in [0, T − 1] (SecMI: multiples of ``interval`` with
            t + interval ≤ T − 1); column j is t_j.
        interval: SecMI's DDIM stride k.
        p: PIA / PIAN's exponent (SimA's is 4).
        noise: ``loss`` only (required there): ε of shape (n, m, ...), ``noise[:, j]`` for
            t_j; or a CPU ``torch.Generator``, for ε = ``torch.randn((n, m, ...),
            generator=noise)`` drawn ``max_batch`` rows at a time: the same values, without
            ever holding more of them than one call's.
        conditioning: keyword arguments for the model; each tensor in it has one row per image.
        max_batch: images per model call (default ⌊:data:`MAX_BATCH_VALUES` / values per
            image⌋, at least 1).

    Examples:
        >>> import torch
        >>> from privmon.attacks import diffusion_statistic
        >>> abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), dim=0)
        >>> def model(x, t):  # predicts noise as a fixed linear map of x_t
        ...     return 0.1 * x
        >>> x0 = torch.randn(4, 1, 8, 8)
        >>> diffusion_statistic(model, x0, abar, statistic="pia", timesteps=[10, 50]).shape
        torch.Size([4, 2])
    """
    stat = statistic_of(statistic)
    abar = check_alphas_cumprod(alphas_cumprod, name="alphas_cumprod")
    interval = check_int(interval, name="interval", minimum=1)
    ts = check_timesteps(
        timesteps, name="timesteps", steps=len(abar), interval=interval if stat.strided else None
    )
    p = check_positive(p, name="p")
    if not isinstance(images, torch.Tensor) or not images.is_floating_point() or images.ndim < 2:
        got = (
            f"{images.dtype} of shape {tuple(images.shape)}"
            if isinstance(images, torch.Tensor)
            else type(images).__name__
        )
        raise ValueError(f"images must be a float tensor of shape (n, ...) with n ≥ 1, got {got}")
    n, shape = images.shape[0], tuple(images.shape[1:])
    if n == 0:
        raise ValueError("images is empty: shape (0, ...)")
    cond = {} if conditioning is None else conditioning
    _check_conditioning(cond, n, where="conditioning")
    if max_batch is None:
        max_batch = max(1, MAX_BATCH_VALUES // max(1, math.prod(shape)))
    rows = _Rows(model, n, cond, check_int(max_batch, name="max_batch", minimum=1))
    dtype = torch.float64 if images.dtype == torch.float64 else torch.float32
    inputs = StatisticInputs(rows, images.detach().to(dtype), abar, ts, interval, p, noise)
    with torch.no_grad():
        return stat.compute(inputs)


class StatisticInputs:
    """What a :class:`DiffusionStatistic` reads: the images x_0 (``images``, in the compute
    dtype), ᾱ (``alphas_cumprod``, float64 CPU; ``alphas`` on the images' device and dtype), the
    timesteps, SecMI's ``interval``, PIA's ``p``, the loss's ``noise`` (as given), and the model
    through :meth:`predict` (at most ``max_batch`` images a call)."""

    def __init__(self, rows, images, abar, timesteps, interval, p, noise) -> None:
        self.rows, self.images, self.alphas_cumprod = rows, images, abar
        self.timesteps, self.interval, self.p, self.noise = timesteps, interval, p, noise
        self.n, self.m, self.shape = images.shape[0], len(timesteps), tuple(images.shape[1:])
        self.device = images.device
        self.alphas = abar.to(self.device, images.dtype)
        self.t_of = torch.tensor(timesteps, device=self.device)

    def predict(self, count: int, build, reduce) -> torch.Tensor:
        """``reduce(rows, ε̂)`` of the model at ``build(rows) = (x_t, t)`` for rows 0 … count − 1
        (row r = j·n + i: timestep j, image i), concatenated."""
        return self.rows.map(count, build, reduce, self.device)

    def noised(self, rows: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_t = √ᾱ_t x_0 + √(1 − ᾱ_t) ε of the rows (image r % n at timestep r // n), and t."""
        t = self.t_of[rows // self.n]
        a_t = self.alphas[t].view((-1,) + (1,) * len(self.shape))
        return a_t.sqrt() * self.images[rows % self.n] + (1 - a_t).sqrt() * eps, t

    def columns(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-row scores (rows j·n + i) as (n, m): column j for timestep j."""
        return scores.view(self.m, self.n).T


class DiffusionStatistic:
    """One statistic of :func:`diffusion_statistic`, as it is asked: its ``name``, its
    direction (``higher_is_member``), whether its timesteps step by ``interval`` (``strided``),
    whether it reads the noise ε (``noised``: the query passes its generator), its model calls
    per image (:meth:`model_calls`) and the statistic itself (:meth:`compute`). A new
    statistic subclasses it and is registered with :func:`register_statistic`.

    Examples:
        >>> from privmon.attacks.diffusion import statistic_of
        >>> statistic_of("secmi").strided, statistic_of("loss").noised
        (True, True)
    """

    name: str
    higher_is_member = False
    strided = False
    noised = False

    def model_calls(self, timesteps: tuple[int, ...], *, interval: int) -> int:
        """ε_θ evaluations per image at these timesteps: one each."""
        return len(timesteps)

    def compute(self, inputs: StatisticInputs) -> torch.Tensor:
        """The statistic per image and timestep, (n, m) (no gradients)."""
        raise NotImplementedError


class _Loss(DiffusionStatistic):
    name, noised = "loss", True

    def compute(self, inputs: StatisticInputs) -> torch.Tensor:
        noise = _check_noise(inputs.noise, (inputs.n, inputs.m, *inputs.shape))
        scores = _loss(inputs.rows, noise, inputs.noised, inputs.images, inputs.m)
        return inputs.columns(scores)


class _SimA(DiffusionStatistic):
    name = "sima"

    def compute(self, inputs: StatisticInputs) -> torch.Tensor:
        x0, n = inputs.images, inputs.n
        scores = inputs.predict(
            n * inputs.m,
            lambda r: (x0[r % n], inputs.t_of[r // n]),
            lambda r, out: _power_sum(out, 4),
        )
        return inputs.columns(scores)


class _PIA(DiffusionStatistic):
    def __init__(self, name: str, *, normalised: bool) -> None:
        self.name, self.normalised = name, normalised

    def model_calls(self, timesteps: tuple[int, ...], *, interval: int) -> int:
        """ε̂ = ε_θ(x_0, 0) first, then one per timestep."""
        return len(timesteps) + 1

    def compute(self, inputs: StatisticInputs) -> torch.Tensor:
        x0, n = inputs.images, inputs.n
        hat = inputs.predict(n, _at(x0, 0), _keep)
        if self.normalised:
            view = (-1,) + (1,) * len(inputs.shape)
            hat = hat / hat.abs().flatten(1).mean(dim=1).view(view) * math.sqrt(2 / math.pi)

        def pia_rows(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return inputs.noised(r, hat[r % n])

        scores = inputs.predict(
            n * inputs.m, pia_rows, lambda r, out: _power_sum(hat[r % n] - out, inputs.p)
        )
        return inputs.columns(scores)


class _SecMI(DiffusionStatistic):
    name, strided = "secmi", True

    def model_calls(self, timesteps: tuple[int, ...], *, interval: int) -> int:
        """The inversion to max(t) + k, shared by the timesteps."""
        return max(timesteps) // check_int(interval, name="interval", minimum=1) + 2

    def compute(self, inputs: StatisticInputs) -> torch.Tensor:
        return _secmi(
            inputs.rows, inputs.images, inputs.alphas_cumprod, inputs.timesteps,
            inputs.interval, inputs.device,
        )  # fmt: skip


_REGISTRY: Registry[DiffusionStatistic] = Registry(
    DiffusionStatistic,
    what="statistic",
    built_in=(
        _Loss(),
        _PIA("pia", normalised=False),
        _PIA("pian", normalised=True),
        _SecMI(),
        _SimA(),
    ),
)

STATISTICS: tuple[str, ...] = _REGISTRY.built_in
"""The built-in statistics :func:`diffusion_statistic` computes (each an object,
:func:`statistic_of`; more with :func:`register_statistic`)."""

HIGHER_IS_MEMBER: dict[str, bool] = {s.name: s.higher_is_member for s in _REGISTRY.parts()}
"""Score direction of each built-in statistic: all are distances, lower for members."""


def register_statistic(statistic: DiffusionStatistic) -> None:
    """Make ``statistic`` one :func:`diffusion_statistic` and ``DiffusionQuery`` accept by its
    name.

    Examples:
        >>> from privmon.attacks.diffusion import DiffusionStatistic, register_statistic
        >>> class Norm(DiffusionStatistic):
        ...     name = "norm"
        >>> register_statistic(Norm())
        >>> unregister_statistic("norm")
    """
    _REGISTRY.register(statistic)


def unregister_statistic(name: str) -> None:
    """Remove a statistic :func:`register_statistic` added (the built-in ones stay).

    Examples:
        >>> from privmon.attacks.diffusion import unregister_statistic
        >>> unregister_statistic("loss")
        Traceback (most recent call last):
        ...
        ValueError: the built-in statistics ('loss', 'pia', 'pian', 'secmi', 'sima') stay registered
    """
    _REGISTRY.unregister(name)


def statistic_of(name: str) -> DiffusionStatistic:
    """The registered statistic of that name, or a ValueError naming the valid ones.

    Examples:
        >>> from privmon.attacks.diffusion import statistic_of
        >>> statistic_of("pia").model_calls((20, 40), interval=10)
        3
    """
    return _REGISTRY.get(name)


def _secmi(
    rows: _Rows,
    x0: torch.Tensor,
    abar: torch.Tensor,
    ts: tuple[int, ...],
    k: int,
    device: torch.device,
) -> torch.Tensor:
    """SecMI at every t of ``ts`` along one inversion path: ε_θ(x_s, s) at s = 0, k, …,
    max(t) + k serves both the inversion step s → s + k and the step back s → s − k, which
    scores t = s − k against the path's x̃_{s−k}."""
    n = x0.shape[0]

    def pos(s: int) -> float:
        return math.sqrt(1 / float(abar[s]) - 1)

    def ddim(x: torch.Tensor, eps: torch.Tensor, s: int, target: int) -> torch.Tensor:
        # back(ε · (p(target) − p(s)) + y(x, s), target), y(x, s) = x / √ᾱ_s
        y = x / math.sqrt(float(abar[s]))
        return (eps * (pos(target) - pos(s)) + y) * math.sqrt(float(abar[target]))

    found: dict[int, torch.Tensor] = {}
    wanted = set(ts)
    x, previous = x0, x0
    for s in range(0, max(ts) + k + 1, k):
        eps = rows.map(n, _at(x, s), _keep, device)
        if s - k in wanted:
            found[s - k] = _power_sum(previous - ddim(x, eps, s, s - k), 2)
        if s <= max(ts):
            x, previous = ddim(x, eps, s, s + k), x
    return torch.stack([found[t] for t in ts], dim=1)
