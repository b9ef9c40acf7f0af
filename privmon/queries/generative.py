"""Queries on generative models (MACE §5): a discriminator's output, several discriminators
(privGAN), the distance to the nearest generated sample, and two queries side by side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from privmon._validation import (
    check_choice,
    check_int,
    check_module,
    check_open_interval,
    is_table,
)
from privmon.attacks.tables import TableEncoder
from privmon.queries.base import Query
from privmon.queries.batches import (
    Batch,
    Transform,
    as_float,
    call_module,
    first_tensor,
    flat_records,
    module_device,
    per_record,
)

__all__ = ["DiscriminatorQuery", "HybridQuery", "MultiDiscriminatorQuery", "NearestGeneratedQuery"]

_OUTPUTS = ("logit", "prob")


def _checked_output(output: Any, eps: Any) -> tuple[str, float]:
    """``output`` in ``_OUTPUTS`` and ``eps`` in (0, 0.5), checked in that order."""
    check_choice(output, _OUTPUTS, name="output")
    return output, check_open_interval(eps, name="eps", low=0, high=0.5)


def _disc_logit(d: nn.Module, x: Any, output: str, eps: float) -> torch.Tensor:
    s = as_float(per_record(first_tensor(call_module(d, x), "discriminator"), "discriminator"))
    if output == "prob":
        s = torch.logit(s, eps=eps)  # clamps into [eps, 1 - eps] first
    return s


class DiscriminatorQuery(Query):
    """Discriminator output D(x) as a logit (MACE eq. 20), shape (n,).

    Args:
        discriminator: the discriminator; one output per record, shape (n,) or (n, 1).
        name: tag in reports.
        output: ``"logit"`` (default) when it returns logits; ``"prob"`` when it ends in a
            sigmoid: the probability is clamped into [eps, 1 - eps] and mapped through
            ``torch.logit``.
        eps: the clamp for ``output="prob"``, in (0, 0.5).
        transform: optional ``batch -> (x, y)`` adapter.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import DiscriminatorQuery
        >>> _ = torch.manual_seed(0)
        >>> D = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
        >>> scores = DiscriminatorQuery(D, output="prob")(torch.randn(3, 4))
        >>> [round(s, 3) for s in scores.tolist()]
        [-0.48, 0.021, 0.737]
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
        self.discriminator = check_module(discriminator, name="discriminator")
        self.output, self.eps = _checked_output(output, eps)
        super().__init__(name=name, modules=(discriminator,), transform=transform)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, _ = self._split(batch)
        return _disc_logit(self.discriminator, x, self.output, self.eps)


class MultiDiscriminatorQuery(Query):
    """Several discriminators (privGAN): their max, max_i D_i(x) (MACE eq. 22), shape (n,), or
    all of them, (D_1(x), ..., D_k(x)) (eq. 23), shape (n, k). Outputs are logits.

    Args:
        discriminators: a non-empty sequence of discriminators, all on one device.
        reduce: ``"max"`` (default) or ``"vector"``.
        name: tag in reports; default ``"disc_max"`` or ``"disc_vector"``.
        output, eps: as for :class:`DiscriminatorQuery` (the max commutes with the logit).
        transform: optional ``batch -> (x, y)`` adapter.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import MultiDiscriminatorQuery
        >>> _ = torch.manual_seed(0)
        >>> discriminators = [nn.Linear(4, 1) for _ in range(3)]
        >>> x = torch.randn(5, 4)
        >>> MultiDiscriminatorQuery(discriminators)(x).shape
        torch.Size([5])
        >>> query = MultiDiscriminatorQuery(discriminators, reduce="vector")
        >>> query.name, query(x).shape
        ('disc_vector', torch.Size([5, 3]))
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
            check_module(d, name="discriminators")
        if reduce not in self._REDUCE:
            raise ValueError(f"reduce must be one of {self._REDUCE}, got {reduce!r}")
        self.discriminators = ds
        self.reduce = reduce
        self.output, self.eps = _checked_output(output, eps)
        self.higher_is_member = True if reduce == "max" else None
        super().__init__(
            name=f"disc_{reduce}" if name is None else name, modules=ds, transform=transform
        )

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, _ = self._split(batch)
        s = torch.stack([_disc_logit(d, x, self.output, self.eps) for d in self.discriminators], 1)
        return s.amax(dim=1) if self.reduce == "max" else s


class NearestGeneratedQuery(Query):
    """Distance to the nearest generated sample, min_j ||x - g_j||_2 (MACE eq. 19), shape (n,).

    ``prepare()`` draws ``n_samples`` samples once per check and keeps them, flattened to
    (n_samples, d), on the generator's device until ``release()``: ``generator(z)`` with
    z ~ N(0, I) from the global torch RNG (which the monitor restores), or ``sample_fn``. Inputs
    are flattened to (n, d) and compared in chunks with ``torch.cdist`` by direct differences, so
    near-duplicates score near 0 (Theory page: *Nearest generated sample*).

    With ``encoder`` (a :class:`~privmon.attacks.TableEncoder` fitted on population records),
    records are DataFrames: ``sample_fn`` returns one, the audit batches are ones, and both are
    compared in the encoder's Euclidean space (standardized numbers, each differing category
    adding 1 to the squared distance), as GAN-Leaks reads tables.

    Args:
        generator: the generator (listed in ``modules``); may be None when ``sample_fn`` is given.
        n_samples: samples drawn per check, >= 1.
        latent_dim: the latent shape per sample, an int or a tuple (required without
            ``sample_fn``).
        sample_fn: ``sample_fn(n_samples, device) -> samples``, called once per check instead
            of sampling latents and calling the generator.
        chunk: latents per generator call and rows per distance block (memory
            O(chunk * n_samples)).
        name: tag in reports.
        transform: optional ``batch -> (x, y)`` adapter.
        encoder: for tables, the encoder of the records (requires ``sample_fn``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import NearestGeneratedQuery
        >>> _ = torch.manual_seed(0)
        >>> G = nn.Linear(2, 4)
        >>> query = NearestGeneratedQuery(G, latent_dim=2, n_samples=100)
        >>> query.prepare()  # the monitor calls it once per check
        >>> query.samples.shape
        torch.Size([100, 4])
        >>> scores = query(torch.randn(5, 4))
        >>> scores.shape, bool((scores >= 0).all())
        (torch.Size([5]), True)
        >>> query.release()

        On a table:

        >>> import pandas as pd
        >>> from privmon.attacks import TableEncoder
        >>> reference = pd.DataFrame({"age": [20.0, 40.0, 60.0], "smoker": ["no", "yes", "no"]})
        >>> release = pd.DataFrame({"age": [40.0, 60.0], "smoker": ["yes", "no"]})
        >>> query = NearestGeneratedQuery(
        ...     None, n_samples=2, sample_fn=lambda n, dev: release, encoder=TableEncoder(reference)
        ... )
        >>> query.prepare()
        >>> test = pd.DataFrame({"age": [40.0, 40.0], "smoker": ["yes", "no"]})
        >>> query(test)  # a copy of a released record; one category off it
        tensor([0., 1.], dtype=torch.float64)
        >>> query.release()
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
        encoder: TableEncoder | None = None,
    ) -> None:
        if generator is not None:
            check_module(generator, name="generator")
        if sample_fn is not None and not callable(sample_fn):
            raise ValueError("sample_fn must be None or a callable (n, device) -> samples")
        if encoder is not None and not isinstance(encoder, TableEncoder):
            raise ValueError(
                f"encoder must be a TableEncoder or None, got {type(encoder).__name__}"
            )
        if encoder is not None and sample_fn is None:
            raise ValueError("encoder needs sample_fn, a callable returning a DataFrame of samples")
        self.encoder = encoder
        if generator is None and sample_fn is None:
            raise ValueError("generator may be None only when sample_fn is given")
        if sample_fn is None:
            if latent_dim is None:
                raise ValueError("latent_dim is required unless sample_fn is given")
            dims = (latent_dim,) if isinstance(latent_dim, (int, np.integer)) else latent_dim
            try:
                self.latent_shape: tuple[int, ...] | None = tuple(
                    check_int(v, name="latent_dim", minimum=1) for v in dims
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
        self.n_samples = check_int(n_samples, name="n_samples", minimum=1)
        self.chunk = check_int(chunk, name="chunk", minimum=1)
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
        dev = module_device(self.modules, fallback=device)
        if self.encoder is not None:
            assert self.sample_fn is not None  # the constructor requires it
            g = self._table_rows(
                self.sample_fn(self.n_samples, dev), dev, what="sample_fn", name="synthetic"
            )
            if g.shape[0] != self.n_samples:
                raise ValueError(
                    f"sample_fn returned {g.shape[0]} records; expected {self.n_samples}"
                )
        elif self.sample_fn is not None:
            g = first_tensor(self.sample_fn(self.n_samples, dev), "sample_fn")
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
                out = first_tensor(self.generator(z), "generator")
                parts.append(out.reshape(m, -1))
            g = torch.cat(parts)
        self._samples = as_float(g)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        g = self._samples
        if g is None:
            raise RuntimeError(
                f"{type(self).__name__}.prepare() must run before scoring (it draws the samples)"
            )
        if self.encoder is not None:
            table = batch if self.transform is None else self.transform(batch)[0]
            x = self._table_rows(table, g.device, what="every audit batch", name="batch")
        else:
            x = flat_records(
                batch, g.device, self.transform, g.shape[1], self.name, "generated samples have"
            )
        dtype = torch.promote_types(as_float(x[:0]).dtype, g.dtype)
        x, g = x.to(dtype), g.to(dtype)
        out = torch.empty(x.shape[0], dtype=dtype, device=g.device)
        for i in range(0, x.shape[0], self.chunk):
            d = torch.cdist(x[i : i + self.chunk], g, compute_mode="donot_use_mm_for_euclid_dist")
            out[i : i + self.chunk] = d.amin(dim=1)
        return out

    def _table_rows(
        self, table: Any, device: torch.device, *, what: str, name: str
    ) -> torch.Tensor:
        """A DataFrame's records in the encoder's Euclidean space, on ``device`` (``what`` names
        its source in the error, ``name`` the table in the encoder's messages)."""
        assert self.encoder is not None
        if not is_table(table):
            raise ValueError(
                f"{self.name}: with encoder=, {what} must be a DataFrame, got "
                f"{type(table).__name__}"
            )
        return self.encoder.layout.euclidean(self.encoder.encode(table, name=name)).to(device)

    def release(self) -> None:
        """Drop the check's generated records."""
        self._samples = None


class HybridQuery(Query):
    """(D(x), min_j ||x - g_j||) (MACE eq. 21): the columns of two queries side by side, (n, 2).

    Any two queries work (vector ones contribute all their columns). ``modules`` is their union;
    ``prepare`` / ``release`` are forwarded to both. Scores are promoted to a common dtype and
    moved to the first query's output device.

    Args:
        discriminator_query: the first query (its columns come first).
        nearest_query: the second query.
        name: tag in reports.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import DiscriminatorQuery, HybridQuery, NearestGeneratedQuery
        >>> _ = torch.manual_seed(0)
        >>> D, G = nn.Linear(4, 1), nn.Linear(2, 4)
        >>> query = HybridQuery(
        ...     DiscriminatorQuery(D), NearestGeneratedQuery(G, latent_dim=2, n_samples=100)
        ... )
        >>> query.prepare()
        >>> query(torch.randn(5, 4)).shape
        torch.Size([5, 2])
        >>> query.release()
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
