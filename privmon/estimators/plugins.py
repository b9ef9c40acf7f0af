"""The paper's plug-in estimators (MACE Thm 2-3): W_N from cell counts, U_N from the classes'
KDEs — on the grid, by importance sampling from the mixture KDE, or above 2 dimensions on the
occupied histogram cells. They are reported beside the rules' figures, never used by them."""

from __future__ import annotations

import math

import torch

from privmon.estimators.density import GaussianKDE
from privmon.estimators.estimates import describe_error
from privmon.estimators.methods import EstimatorMethod
from privmon.estimators.record_binning import BinnedRecords

__all__ = [
    "cell_histogram_plugin",
    "histogram_plugin",
    "kde_plugin",
    "raw_plugins",
    "sampled_kde_plugin",
]


def histogram_plugin(total: torch.Tensor, *, prior, n) -> torch.Tensor:
    """W_N from the classes' cell counts ``total`` (2, cells) of ``n`` records."""
    return (total[0] * (prior / n[0]) - total[1] * ((1 - prior) / n[1])).abs().sum()


def kde_plugin(rows: torch.Tensor, *, prior) -> torch.Tensor:
    """U_N from the classes' KDE masses on the extended grid ``rows`` (2, cells')."""
    return (prior * rows[0] - (1 - prior) * rows[1]).abs().sum()


def raw_plugins(
    methods: dict[str, EstimatorMethod],
    binned: BinnedRecords,
    members: torch.Tensor,
    nonmembers: torch.Tensor,
    *,
    prior: float,
    bandwidth: str | float,
    bins: dict[str, int],
    n_samples: int,
    seed: int,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The paper's W_N / U_N of 1-D scores on their own scale (``binned.raw``), 0-d tensors, of
    each method (name -> its object, ``bins`` its cells): the rules read the scores' ranks, but
    the plug-ins are defined on the query as given (:meth:`~privmon.estimators.methods.
    EstimatorMethod.raw_plugin`). A plug-in that cannot be computed (scores so extreme that
    their variance overflows) is NaN, its error in the second dict."""
    raw = binned.raw
    if raw is None:
        raise ValueError("the plug-ins on the raw scale need 1-D scores (binned.raw is None)")
    out, failed = {}, {}
    for name, method in methods.items():
        try:  # scores as extreme as 1e200 overflow a KDE: the plug-in alone is lost
            out[name] = method.raw_plugin(
                raw, members, nonmembers, prior=prior, bandwidth=bandwidth, bins=bins[name],
                n_samples=n_samples, seed=seed,
            )  # fmt: skip
        except (ValueError, RuntimeError) as err:
            out[name] = members.new_tensor(math.nan)
            failed[name] = describe_error(err)
    return out, failed


def sampled_kde_plugin(m, h, *, prior, bandwidth, ridge, n_samples, seed) -> float:
    """U_N = E_mix |p·p̂ − (1−p)·q̂| / mix with mix = (p̂ + q̂)/2, by importance sampling from the
    mixture KDE (exact kernel sums; a local generator seeded by ``seed``)."""
    gen = torch.Generator(device=m.device).manual_seed(seed)
    kp = GaussianKDE(m, bandwidth=bandwidth, ridge=ridge)
    kq = GaussianKDE(h, bandwidth=bandwidth, ridge=ridge)
    half = n_samples // 2
    x = torch.cat([kp.sample(half, generator=gen), kq.sample(n_samples - half, generator=gen)])
    lp, lq = kp.log_density(x), kq.log_density(x)
    lmix = torch.logaddexp(lp, lq) - math.log(2)
    return float((prior * torch.exp(lp - lmix) - (1 - prior) * torch.exp(lq - lmix)).abs().mean())


def cell_histogram_plugin(
    m: torch.Tensor, h: torch.Tensor, *, prior: float, bins: int, low, span
) -> float:
    """W_N above 2 dimensions: ``bins`` equal cells per axis over [low, low + span], summed over
    the occupied cells only (the full grid has bins^d cells)."""
    n1, n2 = m.shape[0], h.shape[0]
    pooled = torch.cat([m, h])
    nb = torch.full((m.shape[1],), bins, dtype=torch.int64, device=m.device)
    cells = torch.minimum(
        torch.floor((pooled - low) / (span / bins)).to(torch.int64).clamp_min(0), nb - 1
    )
    _, inv = torch.unique(cells, dim=0, return_inverse=True)
    u = int(inv.max()) + 1
    pm = torch.bincount(inv[:n1], minlength=u).to(m.dtype) / n1
    ph = torch.bincount(inv[n1:], minlength=u).to(m.dtype) / n2
    return float((prior * pm - (1 - prior) * ph).abs().sum())
