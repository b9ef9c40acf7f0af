"""DOMIAS: membership inference against synthetic data by density-ratio (overfitting) detection.

Source: van Breugel, Sun, Qian & van der Schaar, "Membership Inference Attacks against Synthetic
Data through Overfitting Detection" (AISTATS 2023). The attacker holds the
synthetic data set D_syn (drawn from the generator's distribution p_G), a reference set D_ref of
real records drawn independently from the population p_R, and test records x. Eq. 2 scores

    A_DOMIAS(x) = f(p_G(x) / p_R(x)),      f monotone,

i.e. a record is flagged as a member where the generator puts more mass than the population does
(local overfitting). :func:`domias_scores` returns ``log p_G(x) - log p_R(x)`` (f = log), which
ranks exactly as the ratio, is invariant under invertible re-representations of the data
(Theorem 1) and, computed in log space, stays finite where either density underflows: the
published code divides ``p_G / (p_R + 1e-30)`` in linear space, which saturates for records far
from the reference data; here the ratio is exact. Threshold it with
:func:`privmon.accuracy_at_median` (App. A.1, steps 4-5), or read :func:`privmon.auc` and
:func:`privmon.top_q_precision` (App. D).

Density estimators (``density=``), App. A.1 steps 1-2:

- ``"kde"``: Gaussian KDEs of D_syn (p_G) and D_ref (p_R) in scipy's ``gaussian_kde`` convention
  (full data covariance times the bandwidth factor squared; Scott's factor by default, the
  heuristic of Sec. 5.2), so with ``bandwidth="scott"`` each log density equals
  ``scipy.stats.gaussian_kde(data.T).logpdf(x.T)`` (to ~1e-12). Evaluated in torch on the test
  records' device with :meth:`GaussianKDE.log_density` ``(method="matmul")``: whitened
  coordinates, one matrix product per cache-sized block of test records, an in-place ``exp`` and
  a row sum; far records fall back to a max-shifted log-sum-exp. Memory is bounded by a block of
  ~1 MiB (CPU) plus the data.
- ``"gaussian"``: the high-level-prior variant of App. C. p_G is the KDE above; p_R is a normal
  distribution with independent coordinates whose mean and variance are the reference set's
  per-feature mean and (population, ``ddof=0``) variance, as in the published code's
  ``normal_func_feat``. ``prior_features`` restricts the normal to some features (App. C uses
  only the first feature, median income, and a flat prior on the others: a flat factor adds a
  constant to every score and changes no ranking). Only these statistics of the reference set are
  used, so the reference set may be small (>= 2 records).
- ``"flow"``: BNAF flows (Sec. 3.3, App. A.3, Table 3) fitted to D_syn and D_ref by
  :func:`privmon.estimators.flow.fit_flow` (keyword arguments via ``flow_kwargs``, e.g.
  ``{"seed": 0, "epochs": 50}``), imported only when asked for.

Embedding (``embed=``), App. B.3 (the CelebA experiment reduces images to a 128-d autoencoder
representation first; Hilprecht et al. use PCA):

- ``"pca"``: project all three sets onto the top ``embed_dim`` principal axes of the reference
  set (centred on its mean). ``embed_dim`` defaults to ``min(d, 10)``. The axes are exact (an
  eigendecomposition of the reference covariance, deterministic, no RNG) for d <= 4096; above
  that a randomized range finder with a local ``torch.Generator`` seeded with 0 is used (never
  the global RNG; ``torch.pca_lowrank`` would draw from it). Note that a full-rank PCA
  (``embed_dim = d``) is an invertible linear map, which leaves the KDE ratio unchanged
  (Theorem 1): PCA matters for DOMIAS only when it drops dimensions.
- a callable (e.g. a trained encoder ``torch.nn.Module``): applied to each of the three sets;
  a module receives a tensor in its parameters' dtype and device, runs under ``torch.no_grad()``
  in eval mode and has its training mode restored afterwards; any other callable receives a
  float64 tensor on the test records' device. Its outputs must have shape (n, k).

Inputs: numpy arrays or torch tensors of shape (n, d) (or (n,) for d = 1), on any device;
synthetic and reference records are moved to the test records' device and all work is done there
in float64. Synthetic / reference rows holding NaN or inf are dropped (with a warning giving the
count); test rows must be finite, since every test record gets a score. Bad input fails with a
``ValueError`` naming the argument: mismatched dimensions, a KDE on fewer records than d + 1
(its covariance would be singular), collinear (singular) data, an unknown ``density`` or
``bandwidth``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from privmon._validation import to_numpy
from privmon.attacks.record_sets import fit_kde, prepare_sets
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
) -> np.ndarray:
    """DOMIAS scores ``log p_G(x) - log p_R(x)`` of the test records (Eq. 2); shape (n,).

    Higher means "more likely a member" (the generator over-represents the record's
    neighbourhood relative to the population). ``density``: ``"kde"`` (scipy's
    ``gaussian_kde`` convention, ``bandwidth`` = ``"scott"``, ``"silverman"`` or a factor),
    ``"gaussian"`` (App. C: a KDE for p_G and an independent-coordinates normal fitted to the
    reference set's per-feature mean and variance for p_R; ``prior_features`` restricts the
    normal to those features) or ``"flow"`` (BNAF via :mod:`privmon.estimators.flow`,
    ``flow_kwargs`` passed to ``fit_flow``). ``embed``: ``None``, ``"pca"`` (top ``embed_dim``
    principal axes of the reference set, default ``min(d, 10)``) or a callable encoder applied to
    all three sets first (App. B.3). Every score is finite. See the module docstring for details.
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
    sets = prepare_sets(test, synthetic, reference, embed=embed, embed_dim=embed_dim)
    x, syn, ref = sets["test"], sets["synthetic"], sets["reference"]
    if density == "flow":
        for name, t in (("synthetic", syn), ("reference", ref)):
            if t.shape[0] < 2:
                raise ValueError(f"{name} needs at least 2 records for density='flow'")
        log_g, log_r = _flow_log_densities(syn, ref, x, flow_kwargs)
    else:
        kde_g = fit_kde(syn, name="synthetic", bandwidth=bandwidth)
        if density == "kde":
            kde_r = fit_kde(ref, name="reference", bandwidth=bandwidth)
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
