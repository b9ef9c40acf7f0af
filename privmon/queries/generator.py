"""A monitor query that attacks a generator through its synthetic data: DOMIAS and its baselines.

:class:`GeneratorQuery` runs the black-box attacks of :mod:`privmon.attacks.generator` at every
check of a :class:`privmon.PrivacyMonitor`: ``prepare`` draws a synthetic set from the generator
and fits what the attack needs of it (p_G, a Gaussian KDE), each audit batch is scored against
it, and ``release`` drops it. What depends only on the fixed reference set and audit records is
computed once and cached, keyed by the batches' content (Theory page: *GeneratorQuery's cache*).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from privmon._validation import as_scores, is_table
from privmon.attacks.generator import (
    ATTACKS,
    DISTANCE_ATTACKS,
    KDE_ATTACKS,
    REFERENCE_VALUE_ATTACKS,
    ReferenceFit,
    SyntheticFit,
    attack_scores,
    check_bandwidth,
    fit_reference,
    fit_synthetic,
    reference_values,
)
from privmon.attacks.record_sets import apply_encoder, finite_records, pca_axes
from privmon.attacks.tables import TableEncoder
from privmon.queries.base import Query
from privmon.queries.batches import (
    Batch,
    Transform,
    first_tensor,
    flat_records,
    module_device,
    tensor_digest,
)
from privmon.queries.generative import NearestGeneratedQuery

__all__ = ["GeneratorQuery"]


class GeneratorQuery(Query):
    """Black-box membership attack on a generator's synthetic data, as a monitor query.

    Batches follow :mod:`privmon.queries`' convention; inputs are flattened to (n, d), must have
    the reference set's d values per record, and are scored in float64 on the generator's
    device (higher = member). Audit records holding NaN / inf score NaN (the monitor drops and
    counts them); synthetic records holding NaN / inf are dropped with a warning.

    Args:
        generator: the generative model (listed in ``modules``); may be None with ``sample_fn``.
        reference: reference records drawn from the population, disjoint from the members and
            non-members (numpy array or tensor, (n_ref, ...), flattened to (n_ref, d)), in the
            generator's representation.
        attack: ``"domias"`` (default), ``"eq1"``, ``"gan_leaks"``, ``"gan_leaks_cal"`` or
            ``"monte_carlo"`` (:mod:`privmon.attacks.generator`).
        n_samples: synthetic records drawn per check.
        latent_dim, sample_fn, chunk: how to sample, as for
            :class:`~privmon.queries.NearestGeneratedQuery`.
        embed: ``None``; ``"pca"``, the reference set's top ``embed_dim`` principal axes
            (default ``min(d, 10)``), fitted once here; or a fixed callable encoder (an
            ``nn.Module`` runs in eval mode under ``no_grad`` and is listed in ``modules``).
        embed_dim: the number of PCA axes, in [1, d] (``embed="pca"`` only).
        bandwidth: KDE bandwidth (``"scott"``, ``"silverman"`` or a factor), scipy's convention.
        cache: cache the per-record reference values and embeddings across checks (same scores).
        name: defaults to ``attack``.
        transform: ``batch -> (x, y)`` adapter (:mod:`privmon.queries`).

    Attributes:
        n_reference_evaluations: records whose reference value was computed.
        cache_hits, cache_misses: batches found in / missing from the cache.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import GeneratorQuery
        >>> _ = torch.manual_seed(0)
        >>> G = nn.Linear(4, 4)
        >>> query = GeneratorQuery(G, torch.randn(200, 4), latent_dim=4, n_samples=200)
        >>> audit = torch.randn(5, 4)
        >>> for check in range(2):  # what the monitor does at each check
        ...     query.prepare()  # draw the synthetic set, fit p_G
        ...     scores = query(audit)  # log p_G(x) - log p_R(x)
        ...     query.release()
        >>> scores.shape, scores.dtype
        (torch.Size([5]), torch.float64)
        >>> query.cache_misses, query.cache_hits  # log p_R(x) computed once
        (1, 1)
    """

    higher_is_member = True

    def __init__(
        self,
        generator: nn.Module | None,
        reference: Any,
        *,
        attack: str = "domias",
        n_samples: int = 1000,
        latent_dim: int | Sequence[int] | None = None,
        sample_fn: Callable[[int, torch.device], Any] | None = None,
        embed: str | Callable[..., Any] | None = None,
        embed_dim: int | None = None,
        bandwidth: str | float = "scott",
        chunk: int = 1024,
        cache: bool = True,
        name: str | None = None,
        transform: Transform | None = None,
        categorical: Sequence[str] | None = None,
    ) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")
        check_bandwidth(bandwidth)
        if not isinstance(cache, bool):
            raise ValueError(f"cache must be True or False, got {cache!r}")
        table = self._table_encoder(reference, categorical, sample_fn, embed, embed_dim)
        # The sampler validates generator / latent_dim / sample_fn / n_samples / chunk.
        self._sampler = NearestGeneratedQuery(
            generator,
            n_samples=n_samples,
            latent_dim=latent_dim,
            sample_fn=sample_fn,
            chunk=chunk,
            name="samples",
        )
        self.attack = attack
        self.generator = generator
        self.n_samples = self._sampler.n_samples
        self.bandwidth = bandwidth
        self.cache = cache
        self.discrete = attack == "monte_carlo"
        self.encoder = table
        self.reference = (
            self._reference_records(reference)
            if table is None
            else table.encode(reference, name="reference")
        )
        self.dim = self.reference.shape[1]
        self.embed = embed
        self._pca: tuple[torch.Tensor, torch.Tensor] | None = None
        self.embed_dim = self._embedded_dim(embed, embed_dim)
        # per-device reference state: embedded reference set and (DOMIAS) its KDE
        self._ref_device: torch.device | None = None
        self._ref: ReferenceFit | None = None
        if not callable(embed):
            self._reference_state(torch.device("cpu"))  # fails now on a singular reference
        # per-check state: the embedded synthetic set and p_G or MC's eps
        self._fit: SyntheticFit | None = None
        self._open = False
        # cross-check cache and counters
        self._cache: dict[tuple, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self._used: set[tuple] = set()
        self.n_reference_evaluations = self.cache_hits = self.cache_misses = 0
        modules: tuple[nn.Module, ...] = self._sampler.modules
        if isinstance(embed, nn.Module):
            modules = (*modules, embed)
        super().__init__(
            name=attack if name is None else name, modules=modules, transform=transform
        )

    def _embedded_dim(self, embed: Any, embed_dim: int | None) -> int | None:
        """The dimension the attack reads records in (None: known once a callable ``embed`` has
        run), checked against the synthetic set's size for a KDE."""
        k = self._embedding(embed, embed_dim)
        if self.attack in KDE_ATTACKS and k is not None and self.n_samples < k + 1:
            if self.encoder is None:
                raise ValueError(
                    f"n_samples must be >= {k + 1} (embedded dimension + 1) for a KDE of the "
                    f"synthetic set, got {self.n_samples}"
                )
        return k

    def _embedding(self, embed: Any, embed_dim: int | None) -> int | None:
        """:meth:`_embedded_dim` unchecked; with ``embed="pca"`` the axes are fitted on the
        reference here."""
        d = self.reference.shape[1]
        if self.encoder is not None:  # distance attacks: the Euclidean space of the encoded table
            if self.attack in DISTANCE_ATTACKS:
                return int(self.encoder.layout.euclidean(self.reference[:1]).shape[1])
            return d
        if embed is None or callable(embed):
            if embed_dim is not None:
                raise ValueError("embed_dim is only used with embed='pca'")
            return d if embed is None else None
        if not isinstance(embed, str):
            raise ValueError(f"embed must be None, 'pca' or a callable, got {type(embed).__name__}")
        if embed != "pca":
            raise ValueError(f"embed must be None, 'pca' or a callable, got {embed!r}")
        k = min(d, 10) if embed_dim is None else embed_dim
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d:
            raise ValueError(f"embed_dim must be an integer in [1, d = {d}], got {embed_dim!r}")
        if self.reference.shape[0] < 2:
            raise ValueError("embed='pca' is fitted on reference, which needs >= 2 records")
        self._pca = pca_axes(self.reference, int(k))
        return int(k)

    # -- reference side (built once) --------------------------------------------------------------
    @staticmethod
    def _table_encoder(
        reference: Any, categorical: Any, sample_fn: Any, embed: Any, embed_dim: Any
    ) -> TableEncoder | None:
        """The encoder of a DataFrame ``reference`` (None for numeric records)."""
        if not is_table(reference):
            if categorical is not None:
                raise ValueError("categorical is only used when reference is a DataFrame")
            return None
        if sample_fn is None:
            raise ValueError(
                "reference is a DataFrame: pass sample_fn(n, device) returning the synthetic "
                "records as a DataFrame of the same columns"
            )
        if embed is not None or embed_dim is not None:
            raise ValueError("embed and embed_dim are not used when reference is a DataFrame")
        return TableEncoder(reference, categorical=categorical)

    @staticmethod
    def _reference_records(reference: Any) -> torch.Tensor:
        if reference is None:
            raise ValueError("reference must be given: reference records from the population")
        if isinstance(reference, torch.Tensor):
            t = reference.detach().to("cpu")
        else:
            try:
                t = torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float64))
            except (TypeError, ValueError):
                raise ValueError(
                    "reference must be a numeric array of shape (n_ref, ...)"
                ) from None
        if t.ndim == 0 or t.shape[0] == 0:
            raise ValueError(f"reference must hold at least one record, got shape {tuple(t.shape)}")
        t = t.reshape(t.shape[0], -1)
        return finite_records(t, name="reference")

    def _embed(self, x: torch.Tensor, *, name: str) -> torch.Tensor:
        if self.encoder is not None:  # the distance attacks read tables in a Euclidean space
            return self.encoder.layout.euclidean(x) if self.attack in DISTANCE_ATTACKS else x
        if self.embed is None:
            return x
        if self._pca is not None:
            mean, axes = self._pca
            return (x - mean.to(x.device)) @ axes.to(x.device)
        assert not isinstance(self.embed, str)  # "pca" has its axes from the constructor
        out = apply_encoder(self.embed, x, name=name)
        return out.to(device=x.device)

    def _reference_state(self, dev: torch.device) -> torch.Tensor:
        """Embedded reference set (and p_R for DOMIAS) on ``dev``; rebuilt only on a new device.
        Returns the embedded reference set."""
        if self._ref_device == dev and self._ref is not None:
            return self._ref.records
        ref = self._embed(self.reference.to(dev), name="reference")
        k = ref.shape[1]
        if self.embed_dim is None:  # a callable encoder: check its output once
            if self.attack in KDE_ATTACKS and self.n_samples < k + 1:
                raise ValueError(
                    f"n_samples must be >= {k + 1} (embedded dimension + 1) for a KDE of the "
                    f"synthetic set, got {self.n_samples}"
                )
            self.embed_dim = k
        elif k != self.embed_dim:
            raise ValueError(f"embed returned {k} dimensions, {self.embed_dim} before")
        layout = None
        if self.encoder is not None and self.attack not in DISTANCE_ATTACKS:
            layout = self.encoder.layout
        self._ref = fit_reference(self.attack, ref, bandwidth=self.bandwidth, layout=layout)
        self._ref_device = dev
        return ref

    # -- one check ---------------------------------------------------------------------------------
    @property
    def synthetic(self) -> torch.Tensor | None:
        """The embedded synthetic set of the current check (None outside a check)."""
        return None if self._fit is None else self._fit.records

    @torch.no_grad()
    def prepare(self, device: Any = None) -> None:
        """Draw this check's synthetic set on ``device`` (the generator's when None), embed it and
        fit p_G (the KDE attacks) or MC's distance threshold; the monitor calls this before
        scoring and :meth:`release` after."""
        if self._open:  # the previous check was not released: close it first
            self.release()
        g = self._draw(device)
        dev = g.device
        if g.shape[1] != self.dim:
            raise ValueError(
                f"{self.name}: the generator's samples have {g.shape[1]} values per record but "
                f"reference has {self.dim}; pass the reference in the generator's representation"
            )
        self._reference_state(dev)
        assert self._ref is not None  # built by _reference_state
        syn = self._embed(finite_records(g, name="synthetic"), name="synthetic")
        self._fit = fit_synthetic(self.attack, syn, self._ref, bandwidth=self.bandwidth)
        self._open = True

    def _draw(self, device: Any) -> torch.Tensor:
        """This check's synthetic records as (n, d) rows: the sampler's, or for tables
        ``sample_fn``'s DataFrame, encoded."""
        if self.encoder is None:
            self._sampler.prepare(device)
            try:
                g = self._sampler.samples
            finally:
                self._sampler.release()
            assert g is not None
            return g
        assert self._sampler.sample_fn is not None  # required with a DataFrame reference
        dev = module_device(self.modules, fallback=device)
        table = self._sampler.sample_fn(self.n_samples, dev)
        if not is_table(table):
            first_tensor(table, "sample_fn")  # a tensor is no table either: say what came
            raise ValueError(
                f"{self.name}: sample_fn returned a {type(table).__name__}; with a DataFrame "
                "reference it must return a DataFrame of the reference's columns"
            )
        if len(table) == 0:
            raise ValueError(f"{self.name}: sample_fn returned an empty table")
        return self.encoder.encode(table, name="synthetic").to(dev)

    def _records(self, batch: Batch, dev: torch.device) -> torch.Tensor:
        """An audit batch as (n, d) rows on ``dev``: flattened, or for tables encoded."""
        if self.encoder is None:
            return flat_records(batch, dev, self.transform, self.dim, self.name, "reference has")
        table = batch if self.transform is None else self.transform(batch)[0]
        if not is_table(table):
            raise ValueError(
                f"{self.name}: reference is a DataFrame, so every audit batch must be one "
                f"(of the same columns), got a {type(table).__name__}"
            )
        return self.encoder.encode(table, name="batch").to(dev)

    def _reference_values(self, e: torch.Tensor) -> torch.Tensor | None:
        if self.attack not in REFERENCE_VALUE_ATTACKS:
            return None
        self.n_reference_evaluations += e.shape[0]
        assert self._ref is not None  # built by the constructor or the first prepare
        return reference_values(self.attack, e, self._ref)

    def _embedded(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedded records (NaN rows where x is not finite) and their reference values."""
        x64 = as_scores(x, name="batch", drop=False)[0]
        finite = torch.isfinite(x64).all(dim=1)
        if bool(finite.all()):
            e = self._embed(x64, name="batch")
            return e, self._reference_values(e)
        assert self.embed_dim is not None  # known from the constructor or the first prepare
        e = torch.full(
            (x64.shape[0], self.embed_dim), math.nan, dtype=torch.float64, device=x64.device
        )
        r = None
        if bool(finite.any()):
            ef = self._embed(x64[finite], name="batch")
            e[finite] = ef
            rf = self._reference_values(ef)
            if rf is not None:
                r = torch.full((x64.shape[0],), math.nan, dtype=torch.float64, device=x64.device)
                r[finite] = rf
        elif self.attack in REFERENCE_VALUE_ATTACKS:
            r = torch.full((x64.shape[0],), math.nan, dtype=torch.float64, device=x64.device)
        return e, r

    @property
    def _embeds(self) -> bool:
        """Whether records are scored in another space than their own: an embedding, or a
        table's Euclidean space (the distance attacks)."""
        return self.embed is not None or (
            self.encoder is not None and self.attack in DISTANCE_ATTACKS
        )

    def _lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # nothing to cache without an embedding and without a per-record reference value
        if not self.cache or (not self._embeds and self.attack not in REFERENCE_VALUE_ATTACKS):
            return self._embedded(x)
        key = tensor_digest(x)
        self._used.add(key)
        hit = self._cache.get(key)
        if hit is not None:
            self.cache_hits += 1
            e, r = hit
            if e is None:  # no embedding: the record itself
                e = as_scores(x, name="batch", drop=False)[0]
            dev = x.device
            return e.to(dev), None if r is None else r.to(dev)
        self.cache_misses += 1
        e, r = self._embedded(x)
        self._cache[key] = (e if self._embeds else None, r)
        return e, r

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        fit = self._fit
        if fit is None:
            raise RuntimeError(
                f"{type(self).__name__}.prepare() must run before scoring (it draws the samples)"
            )
        dev = fit.records.device
        x = self._records(batch, dev)
        if x.shape[0] == 0:
            return torch.empty(0, dtype=torch.float64, device=dev)
        e, r = self._lookup(x)
        out = torch.full((x.shape[0],), math.nan, dtype=torch.float64, device=dev)
        rows = torch.isfinite(e).all(dim=1)
        all_rows = bool(rows.all())
        if not all_rows:
            e = e[rows]
            r = None if r is None else r[rows]
        if e.shape[0]:
            assert self._ref is not None  # built in prepare
            s = attack_scores(self.attack, e, r, fit, self._ref)
            if all_rows:
                out = s
            else:
                out[rows] = s
        return out

    def release(self) -> None:
        """Drop the synthetic set and p_G; keep only the cache entries this check used."""
        self._fit = None
        self._open = False
        if self._used or self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k in self._used}
        self._used = set()

    def clear_cache(self) -> None:
        """Forget every cached reference value and embedding (e.g. after changing ``embed``)."""
        self._cache = {}
        self._used = set()

    @property
    def cache_size(self) -> int:
        """Number of audit records whose values are cached."""
        return sum(key[1][0] for key in self._cache)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, attack={self.attack!r})"
