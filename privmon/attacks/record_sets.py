"""The record sets DOMIAS-style attacks take (test, synthetic, reference): validated as float64
(n, d) tensors on the test records' device, embedded (PCA or an encoder) or, for DataFrames,
encoded (:class:`~privmon.attacks.TableEncoder`), and a density fitted with a message naming the
set (a Gaussian KDE, or for tables the mixed-type :class:`~privmon.estimators.MixedKDE`). Shared
by :mod:`~privmon.attacks.domias`, its baselines and :class:`~privmon.queries.GeneratorQuery`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from privmon._validation import as_scores, is_table
from privmon.attacks.tables import TableEncoder, TableLayout
from privmon.estimators.density import GaussianKDE, MixedKDE

__all__ = [
    "apply_encoder",
    "check_same_dim",
    "embed_sets",
    "encode_sets",
    "finite_records",
    "fit_density",
    "fit_kde",
    "pca_axes",
    "prepare_sets",
    "test_records",
]

_EXACT_PCA_MAX_DIM = 4096


def finite_records(x: Any, *, name: str, device: torch.device | None = None) -> torch.Tensor:
    """float64 (n, d) tensor; drops (and warns about) non-finite rows."""
    t, dropped = as_scores(x, name=name, device=device)
    if dropped:
        warnings.warn(
            f"{name}: dropped {dropped} record(s) holding NaN or infinite values",
            RuntimeWarning,
            stacklevel=4,
        )
    return t


def test_records(x: Any) -> torch.Tensor:
    t, bad = as_scores(x, name="test", drop=False)
    if bad:
        rows = torch.nonzero(~torch.isfinite(t).all(dim=1)).flatten()[:5].tolist()
        raise ValueError(
            f"test holds {bad} record(s) with NaN or infinite values (rows {rows}...); every "
            "test record gets a score, so test records must be finite"
        )
    return t


def check_same_dim(t: torch.Tensor, d: int, *, name: str) -> None:
    if t.shape[1] != d:
        raise ValueError(
            f"{name} has d = {t.shape[1]} features per record but test has d = {d}; "
            "all sets must have the same dimensions"
        )


def pca_axes(ref: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and the top-k principal axes (d, k) of ``ref``; deterministic, no global RNG."""
    mean = ref.mean(dim=0)
    c = ref - mean
    d = ref.shape[1]
    if d <= _EXACT_PCA_MAX_DIM:
        _, vecs = torch.linalg.eigh(c.T @ c)  # ascending eigenvalues
        return mean, vecs[:, -k:].flip(1)
    # randomized range finder (Halko et al.) with a local generator and 4 power iterations
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = min(d, k + 10)
    omega = torch.randn(d, q, generator=gen, dtype=ref.dtype).to(ref.device)
    y = torch.linalg.qr(c @ omega).Q
    for _ in range(4):
        y = torch.linalg.qr(c @ torch.linalg.qr(c.T @ y).Q).Q
    _, _, vh = torch.linalg.svd(y.T @ c, full_matrices=False)
    return mean, vh[:k].T


def apply_encoder(fn: Callable[..., Any], x: torch.Tensor, *, name: str) -> torch.Tensor:
    if isinstance(fn, torch.nn.Module):
        p = next(iter(fn.parameters()), None)
        inp = x if p is None else x.to(device=p.device, dtype=p.dtype)
        was_training = fn.training
        fn.eval()
        try:
            with torch.no_grad():
                out = fn(inp)
        finally:
            fn.train(was_training)
    else:
        with torch.no_grad():
            out = fn(x)
    t, bad = as_scores(out, name=f"embed({name})", device=x.device, drop=False)
    if bad:
        raise ValueError(f"embed returned {bad} non-finite row(s) for {name}")
    return t


def embed_sets(
    sets: dict[str, torch.Tensor],
    embed: str | Callable[..., Any] | None,
    embed_dim: int | None,
    *,
    fit_on: str,
) -> dict[str, torch.Tensor]:
    """Apply ``embed`` ("pca" fitted on ``sets[fit_on]``, or a callable) to every set."""
    if embed is None:
        if embed_dim is not None:
            raise ValueError("embed_dim is only used with embed='pca'")
        return sets
    if isinstance(embed, str):
        if embed != "pca":
            raise ValueError(f"embed must be None, 'pca' or a callable, got {embed!r}")
        d = sets[fit_on].shape[1]
        k = min(d, 10) if embed_dim is None else embed_dim
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d:
            raise ValueError(f"embed_dim must be an integer in [1, d = {d}], got {embed_dim!r}")
        if sets[fit_on].shape[0] < 2:
            raise ValueError(f"embed='pca' is fitted on {fit_on}, which needs >= 2 records")
        mean, axes = pca_axes(sets[fit_on], int(k))
        return {name: (t - mean) @ axes for name, t in sets.items()}
    if not callable(embed):
        raise ValueError(f"embed must be None, 'pca' or a callable, got {type(embed).__name__}")
    if embed_dim is not None:
        raise ValueError("embed_dim is only used with embed='pca'")
    out = {name: apply_encoder(embed, t, name=name) for name, t in sets.items()}
    dims = {name: t.shape[1] for name, t in out.items()}
    if len(set(dims.values())) != 1:
        raise ValueError(f"embed returned different dimensions per set: {dims}")
    return out


def encode_sets(
    test: Any, synthetic: Any, reference: Any | None, *, encoder: TableEncoder | None
) -> tuple[Any, Any, Any | None, TableLayout | None]:
    """The sets as given, or, where any is a DataFrame, all of them encoded by ``encoder``
    (default: one fitted on ``reference``, else on ``synthetic``) with its layout."""
    given = {"test": test, "synthetic": synthetic, "reference": reference}
    tables = [name for name, t in given.items() if t is not None and is_table(t)]
    if not tables:
        if encoder is not None:
            raise ValueError("encoder is only used with DataFrames (test, synthetic, reference)")
        return test, synthetic, reference, None
    arrays = [name for name, t in given.items() if t is not None and name not in tables]
    if arrays:
        raise ValueError(
            f"{tables} are DataFrames but {arrays} are not: pass every set as a DataFrame"
        )
    if encoder is None:
        fit_on = "reference" if reference is not None else "synthetic"
        try:
            encoder = TableEncoder(given[fit_on], name=fit_on)
        except ValueError as err:
            if fit_on == "reference":
                raise
            raise ValueError(
                f"{err}; or pass encoder=TableEncoder(df) fitted on population records"
            ) from None
    elif not isinstance(encoder, TableEncoder):
        raise TypeError(f"encoder must be a privmon TableEncoder, got {type(encoder).__name__}")
    coded = {n: None if t is None else encoder.encode(t, name=n) for n, t in given.items()}
    return coded["test"], coded["synthetic"], coded["reference"], encoder.layout


def prepare_sets(
    test: Any,
    synthetic: Any,
    reference: Any | None,
    *,
    embed: str | Callable[..., Any] | None = None,
    embed_dim: int | None = None,
    encoder: TableEncoder | None = None,
    euclidean: bool = False,
) -> tuple[dict[str, torch.Tensor], TableLayout | None]:
    """Validate and move every set to the test records' device; apply the embedding. DataFrames
    are encoded (:func:`encode_sets`) and returned with their layout; ``euclidean``: in the
    space of :meth:`TableLayout.euclidean <privmon.attacks.TableLayout.euclidean>` (for the
    distance attacks). Tables take no ``embed``."""
    test, synthetic, reference, layout = encode_sets(test, synthetic, reference, encoder=encoder)
    if layout is not None and (embed is not None or embed_dim is not None):
        raise ValueError(
            "embed and embed_dim are not used with DataFrames: the attacks read the encoded "
            "columns (numbers and categories) themselves"
        )
    sets = {"test": test_records(test)}
    dev = sets["test"].device
    d = sets["test"].shape[1]
    sets["synthetic"] = finite_records(synthetic, name="synthetic", device=dev)
    check_same_dim(sets["synthetic"], d, name="synthetic")
    if reference is not None:
        sets["reference"] = finite_records(reference, name="reference", device=dev)
        check_same_dim(sets["reference"], d, name="reference")
    fit_on = "reference" if reference is not None else "synthetic"
    if layout is not None and euclidean:
        sets = {name: layout.euclidean(t) for name, t in sets.items()}
    return embed_sets(sets, embed, embed_dim, fit_on=fit_on), layout


def fit_kde(data: torch.Tensor, *, name: str, bandwidth: str | float) -> GaussianKDE:
    n, d = data.shape
    if n < d + 1:
        raise ValueError(
            f"{name} has {n} records in d = {d} dimensions; a Gaussian KDE (full covariance) "
            f"needs at least d + 1 = {d + 1} records for a non-singular covariance"
        )
    try:
        return GaussianKDE(data, bandwidth=bandwidth)
    except ValueError as err:
        if "bandwidth" in str(err):
            raise
        hint = (
            ": drop constant or duplicated columns (a one-hot block sums to 1), or embed the "
            "records in fewer dimensions (embed='pca' with embed_dim below the data's rank); "
            "domias_scores also takes density='flow'"
            if "singular" in str(err)
            else ""
        )
        raise ValueError(f"{name}: {err}{hint}") from None


def fit_density(
    data: torch.Tensor,
    *,
    name: str,
    bandwidth: str | float,
    layout: TableLayout | None,
    fallback: torch.Tensor | None = None,
) -> GaussianKDE | MixedKDE:
    """A Gaussian KDE of ``data`` (:func:`fit_kde`), or for encoded tables (``layout``) the
    mixed-type :class:`~privmon.estimators.MixedKDE`. Where a table's numeric columns are
    degenerate in ``data`` (a synthetic sample whose numbers collapsed), the kernel takes the
    covariance of the ``fallback`` records' numbers (the reference's), said in a warning."""
    if layout is None:
        return fit_kde(data, name=name, bandwidth=bandwidth)
    q = layout.n_numeric
    try:
        return MixedKDE(data, levels=layout.levels, bandwidth=bandwidth)
    except ValueError as err:
        if "singular" not in str(err) and "n >= 2" not in str(err):
            raise
        if fallback is None or fallback.shape[0] < 2:
            raise ValueError(
                f"{name}: {err}: its numeric columns are constant or collinear"
            ) from None
    warnings.warn(
        f"{name}: its numeric columns are constant or collinear ({data.shape[0]} records); the "
        "kernel takes the reference's covariance instead",
        RuntimeWarning,
        stacklevel=3,
    )
    cov = torch.cov(fallback[:, :q].T).reshape(q, q)
    return MixedKDE(data, levels=layout.levels, bandwidth=bandwidth, covariance=cov)
