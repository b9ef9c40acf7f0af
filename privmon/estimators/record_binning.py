"""Stage 1 of a check: every record binned once (:func:`bin_records`): the rules' grid (in 1-D
the pooled ranks), the raw scores' counts for the paper's plug-ins, each record's cell and fold,
and each certificate's records binned where its rule reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from privmon.estimators.binned_scores import BinnedScores, cell_width
from privmon.estimators.folds import CERTIFY_FOLDS
from privmon.estimators.order_statistics import argsort_ascending, pooled_ranks, robust_range
from privmon.estimators.tensors import on_device, small_tensor

__all__ = ["BinnedRecords", "ClassCounts", "bin_records", "count_classes"]


@dataclass(frozen=True)
class ClassCounts:
    """Scores counted per class on a fixed grid, without folds: all the paper's plug-ins need.
    ``counts`` (2, cells), ``n`` (2,) records and ``cov`` (2, d, d) unbiased covariances per
    class; ``bins`` and ``width`` the grid's (as on
    :class:`~privmon.estimators.binned_scores.BinnedScores`); ``extent`` the
    scores' range (max − min)."""

    counts: torch.Tensor
    n: torch.Tensor
    cov: torch.Tensor
    bins: tuple[int, ...]
    width: torch.Tensor
    extent: torch.Tensor


def count_classes(
    x: torch.Tensor,
    n_members: int,
    *,
    bins: int,
    low: torch.Tensor,
    high: torch.Tensor,
    extent: torch.Tensor,
) -> ClassCounts:
    """1-D scores ``x`` (n, 1), the first ``n_members`` members, counted per class on ``bins``
    equal cells over [low, high] (records outside land in the edge cells, as in
    :meth:`~privmon.estimators.binned_scores.BinnedScores.cell_index`): one bincount.
    ``extent``: the scores' max − min."""
    low, high = (
        on_device(torch.as_tensor(low, dtype=x.dtype), x.device),
        on_device(torch.as_tensor(high, dtype=x.dtype), x.device),
    )
    width = cell_width(low.reshape(1), high.reshape(1), (bins,))
    cell = torch.floor((x[:, 0] - low) / width).to(torch.int64).clamp(0, bins - 1)
    cell[n_members:] += bins  # non-members count in the second row
    counts = torch.bincount(cell, minlength=2 * bins).reshape(2, bins).to(x.dtype)
    cov = torch.stack([_variance(x[:n_members, 0]), _variance(x[n_members:, 0])]).reshape(2, 1, 1)
    n = small_tensor([n_members, x.shape[0] - n_members], np.float64, x.device)
    return ClassCounts(counts, n, cov, (bins,), width, extent)


def _variance(v: torch.Tensor) -> torch.Tensor:
    """The sample variance, NaN (said by the KDE that reads it) for fewer than 2 values."""
    return v.var() if v.numel() > 1 else torch.full((), math.nan, dtype=v.dtype, device=v.device)


@dataclass(frozen=True)
class BinnedRecords:
    """Every record of one check binned once (:func:`bin_records`).

    ``fine`` is the state the records were binned into for the rules; ``grid`` the histogram's
    state (``fine`` itself, or ``fine`` coarsened when the KDE's finer grid serves both);
    ``cell`` each record's cell in ``grid`` (records beyond its range in the edge cells, where
    they were counted); ``fold`` each record's cross-fitting fold (by its position within its
    class). In
    1-D the rules' states hold the pooled ranks (:func:`pooled_ranks`) on [0, 1], and ``raw``
    holds the scores themselves on their robust range, for the paper's plug-ins (W_N / U_N are
    defined on the query's own scale); in 2-D the rules' states hold the scores and ``raw`` is
    None. ``ascending`` (1-D) the pooled scores sorted ascending and the sorting indices: the
    one sort of the check, which the ranks and the ROC read. ``certified``: for each
    certificate (``CERTIFY_FOLDS``), the records binned again, on ``fine``'s cells, where its
    rule and the folds it is applied to read them: at coordinates that its own training
    records fix (:func:`bin_records`), so that the rule is a function of those records alone.
    """

    fine: BinnedScores
    grid: BinnedScores
    cell: torch.Tensor
    fold: torch.Tensor
    ascending: tuple[torch.Tensor, torch.Tensor] | None
    raw: ClassCounts | None
    certified: tuple[BinnedScores, ...]


def bin_records(
    x: torch.Tensor,
    n_members: int,
    *,
    bins: int,
    fine_bins: int | None = None,
    folds: int = 4,
    low: Any = None,
    high: Any = None,
) -> BinnedRecords:
    """Bin finite float64 scores (n, d ≤ 2), the first ``n_members`` of them members, in one
    pass per grid (margin 0). ``fine_bins`` (a multiple of ``bins``): bin the rules' records on
    that finer grid and coarsen it to ``bins`` for the histogram. In 1-D one sort gives the
    ranks the rules read, the raw grid's range and the ROC's ranking. ``low`` / ``high``: the raw
    scores' grid (default their robust range, :func:`robust_range`).

    Each certificate's rule learns on the folds outside its ``CERTIFY_FOLDS``: the records are
    binned again for it (``certified``) at coordinates those folds alone fix — in 1-D each
    score's mid-rank among them (:func:`pooled_ranks` ``among``), in 2-D the scores on those
    folds' robust range (``low`` / ``high`` aside) — so that, given its training records, the
    rule and the cell each held-out record falls in are fixed and the held-out records are
    independent draws (:mod:`privmon.estimators.certificate`). The pooled ranks and range the
    other rules read depend on every record."""
    sizes = (n_members, x.shape[0] - n_members)
    ascending = raw = None
    if x.shape[1] == 1:
        ascending = argsort_ascending(x[:, 0])
        sorted_x = ascending[0][:, None]
        if low is None:
            low, high = robust_range(sorted_x, presorted=True)
        raw = count_classes(
            x,
            n_members,
            bins=fine_bins or bins,
            low=low,
            high=high,
            extent=sorted_x[-1] - sorted_x[0],
        )
        rule_x, low, high = pooled_ranks(*ascending)[:, None], 0.0, 1.0
    else:
        if low is None:
            low, high = robust_range(x)
        rule_x = x
    fine = BinnedScores(
        bins=fine_bins or bins, folds=folds, margin=0.0, low=low, high=high, device=x.device
    )
    cell, _, group = fine.add_finite(rule_x, sizes)
    grid = fine
    if fine_bins is not None and fine_bins != bins:
        factor = fine_bins // bins
        grid = fine.coarsen(factor)
        cell = torch.div(cell, factor, rounding_mode="floor")
    fold = torch.remainder(group, fine.folds)  # group = class · folds + fold
    certified = tuple(
        _certified_state(x, sizes, fold, held_out, ascending, bins=fine_bins or bins, grid=fine)
        for held_out in CERTIFY_FOLDS
    )
    return BinnedRecords(fine, grid, cell, fold, ascending, raw, certified)


def _certified_state(
    x: torch.Tensor,
    sizes: tuple[int, int],
    fold: torch.Tensor,
    held_out: tuple[int, ...],
    ascending: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    bins: int,
    grid: BinnedScores,
) -> BinnedScores:
    """The records binned for the certificate of folds ``held_out`` (:func:`bin_records`): in
    1-D at their mid-ranks among the other folds' records, on [0, 1]; in 2-D on those records'
    robust range (``grid``'s range when there are none)."""
    learns = ~torch.isin(fold, torch.tensor(held_out, device=fold.device))
    limits = grid.allocated()
    cert_range: tuple[Any, Any] = (limits.low, limits.high)
    cert_x = x
    if ascending is not None:
        cert_x, cert_range = pooled_ranks(*ascending, among=learns)[:, None], (0.0, 1.0)
    elif bool(learns.any()):
        cert_range = robust_range(x[learns])
    certified = BinnedScores(
        bins=bins, folds=grid.folds, margin=0.0, low=cert_range[0], high=cert_range[1],
        device=x.device,
    )  # fmt: skip
    certified.add_finite(cert_x, sizes)
    return certified
