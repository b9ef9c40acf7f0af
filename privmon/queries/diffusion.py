"""A diffusion model's membership statistics per image (loss, PIA / PIAN, SecMI, SimA), as a
monitor query for a diffusers (or any noise-predicting) training loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from privmon._validation import (
    check_callable,
    check_int,
    check_materialized,
    check_positive,
    check_timesteps,
)
from privmon.attacks.diffusion import (
    Statistic,
    alphas_cumprod,
    diffusion_statistic,
    module_of,
    statistic_of,
)
from privmon.queries.base import Query
from privmon.queries.batches import Batch, Transform, to_device

__all__ = ["IMAGE_KEYS", "DiffusionQuery"]

IMAGE_KEYS = ("pixel_values", "images")
"""The keys a mapping batch holds its images under (the first present counts)."""


class DiffusionQuery(Query):
    """One diffusion-model membership statistic per image: shape (n,) for one timestep, (n, m)
    for a sequence of m timesteps (one column each).

    ``statistic`` is one of ``"loss"``, ``"pia"``, ``"pian"``, ``"secmi"``, ``"sima"``: the
    formulas and their sources are in :mod:`privmon.attacks.diffusion`; every one is a distance,
    lower for members (``higher_is_member`` is False). The loss draws its noise ε from the
    query's own ``torch.Generator``, seeded with ``seed`` at every check (``prepare``): with the
    audit sets in a fixed order every check scores the same draw, so a curve over training moves
    with the model, never with the noise; the global RNG is never drawn from. For a batch of n
    images (latents of shape S) at m timesteps the draw is ``torch.randn((n, m, *S),
    generator=g)`` on the CPU, batch after batch, drawn ``max_batch`` rows at a time (those
    values, never held whole: memory does not grow with m).

    Batches: a tensor of images, a tuple / list whose first item is the images, or a mapping
    with ``pixel_values`` or ``images`` whose other keys (e.g. ``encoder_hidden_states``,
    ``class_labels``) go to the model as keyword arguments, each tensor with one row per image.
    ``transform(batch) -> (images, conditioning or None)`` adapts anything else. ``encode``
    (e.g. a VAE encoder) maps the images to the latents the model denoises.

    Cost: ε_θ evaluations per image as :func:`~privmon.attacks.model_calls` says (loss and SimA
    one per timestep, PIA 1 + one per timestep, SecMI max(t)/k + 2); the timesteps of a batch go
    through the model together, at most ``max_batch`` images per call.

    Args:
        model: a diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` (its output's ``.sample``
            is read), or any module or callable ``(x_t, t) -> ε̂``, t a LongTensor of shape
            (n,). A module (or a bound method of one) is protected by the monitor (eval mode
            during checks); a plain callable computes where the batch is.
        scheduler: a diffusers scheduler (its ``alphas_cumprod`` is read once, never changed)
            or a 1-D tensor of ᾱ_0 … ᾱ_{T−1}.
        statistic: which statistic.
        timesteps: an integer t (scores (n,)) or a sequence of them (scores (n, m)), each in
            [0, T − 1]; SecMI: multiples of ``interval`` with t + interval ≤ T − 1. Default 100.
        interval: SecMI's DDIM stride k (default 10).
        p: PIA / PIAN's exponent (default 4).
        seed: the loss noise's seed (default 0).
        name: tag in reports (default: the statistic).
        transform: optional batch adapter (see above).
        encode: optional ``images -> latents`` callable, run without gradients; it must return
            a tensor (with a diffusers VAE: ``lambda x: vae.encode(x).latent_dist.mode() *
            vae.config.scaling_factor``: the mode, so that no random draw is made).
        max_batch: images per model call (default ⌊2²⁰ / values per image⌋, at least 1: 4 MiB
            of float32 input per call; lower it for a large model, whose activations are a
            multiple of that).

    Examples:
        >>> import torch
        >>> from diffusers import DDPMScheduler, UNet2DModel
        >>> from privmon.queries import DiffusionQuery
        >>> _ = torch.manual_seed(0)
        >>> unet = UNet2DModel(
        ...     sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
        ...     layers_per_block=1, norm_num_groups=4,
        ...     down_block_types=("DownBlock2D", "DownBlock2D"),
        ...     up_block_types=("UpBlock2D", "UpBlock2D"),
        ... )
        >>> scheduler = DDPMScheduler(num_train_timesteps=1000)
        >>> query = DiffusionQuery(unet, scheduler, "pia", timesteps=[20, 40, 60])
        >>> images = torch.rand(5, 1, 8, 8) * 2 - 1
        >>> query.name, query.higher_is_member, query(images).shape
        ('pia', False, torch.Size([5, 3]))
    """

    def __init__(
        self,
        model: Callable[..., Any],
        scheduler: Any,
        statistic: Statistic,
        *,
        timesteps: int | Sequence[int] = 100,
        interval: int = 10,
        p: float = 4.0,
        seed: int = 0,
        name: str | None = None,
        transform: Transform | None = None,
        encode: Callable[[torch.Tensor], torch.Tensor] | None = None,
        max_batch: int | None = None,
    ) -> None:
        check_callable(model, name="model")
        if encode is not None:
            check_callable(encode, name="encode")
        self.model = model
        self.encode = encode
        stat = statistic_of(statistic)
        self.statistic = stat.name
        self.alphas_cumprod = alphas_cumprod(scheduler)
        self.interval = check_int(interval, name="interval", minimum=1)
        self.timesteps = check_timesteps(
            timesteps,
            name="timesteps",
            steps=len(self.alphas_cumprod),
            interval=self.interval if stat.strided else None,
        )
        # one column per timestep of a sequence; one timestep (an int, a 0-d array) gives (n,)
        self.columns = not (
            isinstance(timesteps, int | np.integer) or getattr(timesteps, "ndim", None) == 0
        )
        self.p = check_positive(p, name="p")
        self.seed = check_int(seed, name="seed")
        self.max_batch = (
            None if max_batch is None else check_int(max_batch, name="max_batch", minimum=1)
        )
        self.higher_is_member = stat.higher_is_member
        self._generator = torch.Generator().manual_seed(self.seed)
        self._noise = self._generator if stat.noised else None
        owners = {"model": module_of(model), "encode": module_of(encode)}
        modules = [m for m in owners.values() if m is not None]
        for arg, m in owners.items():
            if m is not None:
                check_materialized(m, name=arg)
        super().__init__(
            name=statistic if name is None else name, modules=modules, transform=transform
        )

    def prepare(self, device: Any = None) -> None:
        """Start a check: the loss noise's generator restarts from ``seed``."""
        self._generator.manual_seed(self.seed)

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
        """(images, conditioning) on the device the query computes on."""
        if self.transform is not None:
            out = self.transform(batch)
            if not isinstance(out, tuple | list) or len(out) != 2:
                raise ValueError("transform must return a pair (images, conditioning or None)")
            images, cond = out
            cond = {} if cond is None else cond
            if not isinstance(cond, Mapping):
                raise ValueError(
                    "transform must return (images, conditioning) with conditioning None or a "
                    f"mapping of the model's keyword arguments, got {type(cond).__name__}"
                )
        elif isinstance(batch, Mapping):
            key = next((k for k in IMAGE_KEYS if k in batch), None)
            if key is None:
                raise ValueError(
                    f"{self.name}: the batch has none of the image keys {IMAGE_KEYS} (keys: "
                    f"{sorted(map(str, batch))}); pass transform=lambda batch: (images, "
                    "conditioning)"
                )
            images, cond = batch[key], {k: v for k, v in batch.items() if k != key}
        elif isinstance(batch, tuple | list) and batch:
            images, cond = batch[0], {}
        else:
            images, cond = batch, {}
        if not isinstance(images, torch.Tensor):
            raise ValueError(
                f"{self.name}: the images must be a tensor (n, C, H, W), got "
                f"{type(images).__name__}; pass transform=lambda batch: (images, conditioning)"
            )
        device = self.device if self.modules else images.device
        return to_device(images, device), to_device(cond, device)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """The statistic of each image of ``batch``: (n,) for one timestep, else (n, m)."""
        images, cond = self._inputs(batch)
        if self.encode is not None:
            latents = self.encode(images)
            if not isinstance(latents, torch.Tensor) or latents.ndim < 2:
                raise ValueError(
                    f"encode must return the latents as a tensor (n, ...), got "
                    f"{type(latents).__name__}"
                    + (
                        f" of shape {tuple(latents.shape)}"
                        if isinstance(latents, torch.Tensor)
                        else ""
                    )
                )
            if latents.shape[0] != images.shape[0]:
                raise ValueError(
                    f"encode returned {latents.shape[0]} latents for {images.shape[0]} images"
                )
            images = latents
        scores = diffusion_statistic(
            self.model,
            images,
            self.alphas_cumprod,
            statistic=self.statistic,
            timesteps=self.timesteps,
            interval=self.interval,
            p=self.p,
            noise=self._noise,
            conditioning=cond,
            max_batch=self.max_batch,
        )
        return scores if self.columns else scores[:, 0]
