"""DOMIAS: membership inference against synthetic data by density-ratio (overfitting) detection.

van Breugel, Sun, Qian & van der Schaar, "Membership Inference Attacks against Synthetic Data
through Overfitting Detection" (AISTATS 2023), Eq. 2: a record is flagged as a member where the
generator puts more mass than the population does. The attacker holds the synthetic data (drawn
from the generator's density p_G), a reference set of real records (from the population's p_R)
and the test records; :func:`domias_scores` returns ``log p_G(x) - log p_R(x)``, with the
densities fitted by Gaussian KDEs, a normal prior (App. C) or BNAF flows, optionally after an
embedding (App. B.3). Threshold the scores with :func:`privmon.accuracy_at_median` (App. A.1), or
read :func:`privmon.auc` and :func:`privmon.top_q_precision` (App. D).

The density estimators, the embeddings and why the ratio is taken in log space: docs, Theory
page, *DOMIAS*.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from privmon._validation import to_numpy
from privmon.attacks.record_sets import fit_density, prepare_sets
from privmon.attacks.tables import TableEncoder
from privmon.estimators.density import bandwidth_factor

__all__ = ["domias_scores"]

_DENSITIES = ("kde", "gaussian", "flow")


def _gaussian_prior_log_density(
    ref: torch.Tensor, points: torch.Tensor, features: Sequence[int] | None
) -> torch.Tensor:
    """log N(x_F; mean_F, diag(var_F)) with per-feature reference statistics (ddof = 0)."""
    d = ref.shape[1]
    if features is None:
        idx = list(range(d))
    else:
        try:
            idx = [int(i) for i in features]
        except (TypeError, ValueError):
            raise ValueError(
                f"prior_features must be a sequence of feature indices, got {features!r}"
            ) from None
        if not idx or len(set(idx)) != len(idx) or not all(0 <= i < d for i in idx):
            raise ValueError(
                f"prior_features must be distinct feature indices in [0, {d}), got {features!r}"
            )
    if ref.shape[0] < 2:
        raise ValueError("reference needs at least 2 records for density='gaussian'")
    r = ref[:, idx]
    mean = r.mean(dim=0)
    var = r.var(dim=0, correction=0)
    if not bool((var > 0).all()):
        cols = [idx[i] for i in torch.nonzero(var <= 0).flatten().tolist()]
        raise ValueError(f"reference features {cols} are constant: the normal prior needs var > 0")
    z = (points[:, idx] - mean).square_().div_(var)
    return -0.5 * (z.sum(dim=1) + torch.log(2 * math.pi * var).sum())


def _flow_log_densities(
    syn: torch.Tensor, ref: torch.Tensor, test: torch.Tensor, kwargs: Mapping[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        flow = importlib.import_module("privmon.estimators.flow")
    except ModuleNotFoundError as err:
        if err.name not in ("privmon.estimators.flow", "privmon.estimators"):
            raise
        raise ValueError(
            "density='flow' needs privmon.estimators.flow (BNAF), which this installation does "
            "not have; use density='kde' or density='gaussian'"
        ) from None
    kw = dict(kwargs or {})
    out = []
    for data in (syn, ref):
        lp = flow.fit_flow(data, **kw).log_density(test)
        out.append(torch.as_tensor(lp).to(device=test.device, dtype=torch.float64).reshape(-1))
    return out[0], out[1]


def domias_scores(
    test: Any,
    synthetic: Any,
    reference: Any,
    *,
    density: str = "kde",
    bandwidth: str | float = "scott",
    embed: str | Callable[..., Any] | None = None,
    embed_dim: int | None = None,
    prior_features: Sequence[int] | None = None,
    flow_kwargs: Mapping[str, Any] | None = None,
    encoder: TableEncoder | None = None,
) -> np.ndarray:
    """DOMIAS scores ``log p_G(x) - log p_R(x)`` of the test records (Eq. 2); shape (n,).

    Higher means "more likely a member": the generator over-represents the record's
    neighbourhood relative to the population. Every score is finite.

    Args:
        test: the records to score, numpy or torch, shape (n, d) (or (n,) for d = 1), any
            device; the work is done there in float64. Every row must be finite.
        synthetic: the generator's records (n_syn, d), a sample of p_G. Rows holding NaN or inf
            are dropped, with a warning giving the count (also for ``reference``).
        reference: real records (n_ref, d) drawn independently of the training set, a sample of
            p_R.
        density: ``"kde"`` (default; Gaussian KDEs of both sets in scipy's ``gaussian_kde``
            convention), ``"gaussian"`` (App. C: a KDE for p_G, for p_R a normal with the
            reference set's per-feature mean and variance; the reference set may be small, >= 2
            records) or ``"flow"`` (BNAF flows, :func:`privmon.estimators.flow.fit_flow`).
        bandwidth: the KDEs' factor, ``"scott"`` (default), ``"silverman"`` or a number.
        embed: None (default), ``"pca"`` (the top ``embed_dim`` principal axes of the reference
            set) or a callable encoder (e.g. an ``nn.Module``, run under ``torch.no_grad()`` in
            eval mode) applied to the three sets first; its outputs must have shape (n, k).
        embed_dim: PCA dimensions, default ``min(d, 10)``.
        prior_features: ``"gaussian"`` only: the features the normal prior covers (App. C uses
            the first one); default all.
        flow_kwargs: ``"flow"`` only: keyword arguments of ``fit_flow``, e.g.
            ``{"seed": 0, "epochs": 50}``.
        encoder: for DataFrames (all three sets then are), the
            :class:`~privmon.attacks.TableEncoder` to read them with; default one fitted on
            ``reference``. Tables take ``density="kde"``, a mixed-type product kernel
            (:class:`~privmon.estimators.MixedKDE`: Gaussian on the standardized numbers,
            Aitchison–Aitken on the categories), and no ``embed``. A category a synthetic
            sample never produces keeps a positive density; where its numbers collapse, p_G's
            kernel takes the reference's covariance (a warning says so).

    Returns:
        float64 numpy array (n,).

    Raises:
        ValueError naming the argument: mismatched dimensions, a KDE on fewer records than
            d + 1 (its covariance would be singular), collinear data, an unknown ``density`` or
            ``bandwidth``, a test record too far from the data for float64 log densities.

    Examples:
        >>> import torch
        >>> from privmon import auc, domias_scores
        >>> gen = torch.Generator().manual_seed(0)
        >>> members, nonmembers = torch.randn(2, 200, 2, generator=gen)
        >>> synthetic = members + 0.1 * torch.randn(200, 2, generator=gen)  # memorised
        >>> reference = torch.randn(500, 2, generator=gen)
        >>> scores = domias_scores(torch.cat([members, nonmembers]), synthetic, reference)
        >>> scores.shape
        (400,)
        >>> round(auc(scores[:200], scores[200:]), 2)
        0.62
    """
    if density not in _DENSITIES:
        raise ValueError(f"density must be one of {_DENSITIES}, got {density!r}")
    if density != "flow":
        bandwidth_factor(bandwidth, n=2, d=1)  # validates early (message names bandwidth)
    if prior_features is not None and density != "gaussian":
        raise ValueError("prior_features is only used with density='gaussian'")
    if flow_kwargs is not None and density != "flow":
        raise ValueError("flow_kwargs is only used with density='flow'")
    if reference is None:
        raise ValueError("reference must be given: DOMIAS needs reference records (Eq. 2)")
    sets, layout = prepare_sets(
        test, synthetic, reference, embed=embed, embed_dim=embed_dim, encoder=encoder
    )
    x, syn, ref = sets["test"], sets["synthetic"], sets["reference"]
    if layout is not None and density != "kde":
        raise ValueError(
            f"density={density!r} reads numeric records; DataFrames take density='kde' (a "
            "mixed-type kernel density)"
        )
    if density == "flow":
        for name, t in (("synthetic", syn), ("reference", ref)):
            if t.shape[0] < 2:
                raise ValueError(f"{name} needs at least 2 records for density='flow'")
        log_g, log_r = _flow_log_densities(syn, ref, x, flow_kwargs)
    else:
        kde_g = fit_density(syn, name="synthetic", bandwidth=bandwidth, layout=layout, fallback=ref)
        if density == "kde":
            kde_r = fit_density(ref, name="reference", bandwidth=bandwidth, layout=layout)
            log_r = kde_r.log_density(x, method="matmul")
        else:
            log_r = _gaussian_prior_log_density(ref, x, prior_features)
        log_g = kde_g.log_density(x, method="matmul")
    scores = log_g - log_r
    finite = torch.isfinite(scores)
    if not bool(finite.all()):
        rows = torch.nonzero(~finite).flatten()[:5].tolist()
        raise ValueError(
            f"test records {rows} lie too far from the data for float64 log densities "
            "(the squared distances overflow); rescale the data"
        )
    return to_numpy(scores)
