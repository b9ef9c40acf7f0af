"""The attacks of :class:`privmon.queries.GeneratorQuery` on a generator's synthetic sample, as
pure functions on tensors: each audit record's score against the synthetic records (and its
reference-side value, which depends on the record alone and so may be cached across checks).

Attacks (``attack=``), in the terms of the DOMIAS paper (van Breugel et al., "Membership
Inference Attacks against Synthetic Data through Overfitting Detection"):

- ``"domias"``: ``log p_G(x) - log p_R(x)`` (Eq. 2), p_R a Gaussian KDE of the reference set;
  equal to :func:`privmon.domias_scores` on the same synthetic sample.
- ``"eq1"``: ``log p_G(x)`` (the Eq. 1 ablation), as :func:`privmon.attacks.eq1`.
- ``"gan_leaks"``: ``-min_j |x - g_j|^2``, as :func:`privmon.attacks.gan_leaks`.
- ``"gan_leaks_cal"``: ``min_k |x - r_k|^2 - min_j |x - g_j|^2`` with the reference records r,
  as :func:`privmon.attacks.gan_leaks_cal` with ``reference``.
- ``"monte_carlo"``: the fraction of synthetic records with ``|x - g_j|^2 < eps``. One deviation
  from :func:`privmon.attacks.monte_carlo`: Hilprecht et al.'s median heuristic takes eps from the
  test records, but a monitor scores the member and the non-member batches separately, and an eps
  taken from one batch would make batches incomparable. Here eps is the median, over the
  *reference* records (drawn from the same population as the audit records), of the squared
  distance to the nearest synthetic record: one eps per check, shared by every batch. Scores take
  few distinct values, so the query is ``discrete`` (histogram estimator only).
- ``"dcr"``: the distance to the closest synthetic record, negated, as :func:`privmon.attacks.dcr`
  (Gower's distance; on numeric arrays the reference's ranges).

On encoded tables (a :class:`~privmon.attacks.TableLayout`) the KDEs are mixed-type
(:class:`~privmon.estimators.MixedKDE`) and GAN-Leaks and MC read the records in the space of
:meth:`TableLayout.euclidean <privmon.attacks.TableLayout.euclidean>` (the caller embeds them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from privmon.attacks.distances import SquaredDistances, median
from privmon.attacks.record_sets import fit_density
from privmon.attacks.tables import TableLayout
from privmon.estimators.density import GaussianKDE, MixedKDE, bandwidth_factor

__all__ = [
    "ATTACKS",
    "DISTANCE_ATTACKS",
    "KDE_ATTACKS",
    "REFERENCE_VALUE_ATTACKS",
    "ReferenceFit",
    "SyntheticFit",
    "attack_scores",
    "check_bandwidth",
    "fit_reference",
    "fit_synthetic",
    "reference_values",
]

ATTACKS = ("domias", "eq1", "gan_leaks", "gan_leaks_cal", "monte_carlo", "dcr")
KDE_ATTACKS = ("domias", "eq1")
DISTANCE_ATTACKS = ("gan_leaks", "gan_leaks_cal", "monte_carlo")  # Euclidean, on tables too
REFERENCE_VALUE_ATTACKS = ("domias", "gan_leaks_cal")  # attacks with a per-record reference value
# elements of the (rows, n_synthetic, k) difference block of the Monte Carlo count (8 MiB)
_MC_BLOCK = 1 << 20


def check_bandwidth(bandwidth: Any) -> None:
    """Refuse a KDE bandwidth other than ``"scott"``, ``"silverman"`` or a positive factor
    (scipy's convention; the message names ``bandwidth``)."""
    bandwidth_factor(bandwidth, n=2, d=1)


class ReferenceFit(NamedTuple):
    """The reference side of an attack: the (embedded) reference records, for ``"domias"``
    p_R, their KDE, and the layout of encoded tables (None for numeric records); for
    ``"dcr"`` on numeric records, a layout holding the reference's ranges."""

    records: torch.Tensor
    kde: GaussianKDE | MixedKDE | None
    layout: TableLayout | None


class SyntheticFit(NamedTuple):
    """One (embedded) synthetic set and what the attack reads of it: p_G, its KDE
    (``"domias"``, ``"eq1"``), or MC's eps (``"monte_carlo"``)."""

    records: torch.Tensor
    kde: GaussianKDE | MixedKDE | None
    mc_eps: torch.Tensor | None


def fit_reference(
    attack: str, reference: torch.Tensor, *, bandwidth: Any, layout: TableLayout | None = None
) -> ReferenceFit:
    """The reference side of ``attack`` for the records ``reference`` (n_ref, k)."""
    kde = None
    if attack == "domias":
        kde = fit_density(reference, name="reference", bandwidth=bandwidth, layout=layout)
    if attack == "dcr" and layout is None:
        spread = reference.amax(dim=0) - reference.amin(dim=0)
        ranges = torch.where(spread > 0, spread, torch.ones_like(spread))
        layout = TableLayout(reference.shape[1], levels=(), ranges=tuple(ranges.tolist()))
    return ReferenceFit(reference, kde, layout)


def fit_synthetic(
    attack: str, synthetic: torch.Tensor, reference: ReferenceFit, *, bandwidth: Any
) -> SyntheticFit:
    """What ``attack`` reads of the synthetic records (n_syn, k). MC's eps is the median, over
    the reference records, of the squared distance to the nearest synthetic record."""
    kde = mc_eps = None
    if attack in KDE_ATTACKS:
        kde = fit_density(
            synthetic,
            name="synthetic",
            bandwidth=bandwidth,
            layout=reference.layout,
            fallback=reference.records,
        )
    elif attack == "monte_carlo":
        mc_eps = median(SquaredDistances(reference.records, synthetic).min())
    return SyntheticFit(synthetic, kde, mc_eps)


def _count_within(x: torch.Tensor, y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """#{j : |x_i - y_j|^2 < eps} per row i, by direct differences in blocks of rows."""
    n, k = y.shape
    rows = max(1, _MC_BLOCK // max(n * k, 1))
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for s in range(0, x.shape[0], rows):
        d2 = (x[s : s + rows, None, :] - y[None, :, :]).square_().sum(dim=2)
        out[s : s + rows] = (d2 < eps).sum(dim=1)
    return out


def reference_values(attack: str, x: torch.Tensor, reference: ReferenceFit) -> torch.Tensor | None:
    """Each record's reference-side value: ``log p_R(x)`` for ``"domias"``, ``min_k |x - r_k|^2``
    for ``"gan_leaks_cal"``; None for the attacks without one."""
    if attack not in REFERENCE_VALUE_ATTACKS:
        return None
    if attack == "domias":
        assert reference.kde is not None
        return reference.kde.log_density(x, method="matmul")
    return SquaredDistances(x, reference.records).min()


def attack_scores(
    attack: str,
    x: torch.Tensor,
    reference_value: torch.Tensor | None,
    synthetic: SyntheticFit,
    reference: ReferenceFit,
) -> torch.Tensor:
    """The ``attack``'s scores of the (embedded, finite) records ``x`` against the synthetic
    set (higher = member), given their :func:`reference_values`."""
    if attack == "dcr":
        assert reference.layout is not None  # fit_reference gives "dcr" one
        return -reference.layout.gower_min(x, synthetic.records)
    if attack in KDE_ATTACKS:
        assert synthetic.kde is not None
        log_g = synthetic.kde.log_density(x, method="matmul")
        if attack != "domias":
            return log_g
        assert reference_value is not None  # DOMIAS reads log p_R of every record
        return log_g - reference_value
    if attack == "gan_leaks":
        return -SquaredDistances(x, synthetic.records).min()
    if attack == "gan_leaks_cal":
        assert reference_value is not None  # the distance to the reference set
        return reference_value - SquaredDistances(x, synthetic.records).min()
    assert synthetic.mc_eps is not None  # monte_carlo: fit_synthetic set it
    counts = _count_within(x, synthetic.records, synthetic.mc_eps)
    return counts.to(torch.float64) / synthetic.records.shape[0]
