"""What the later stages read of binned records: the fold selections (counts, record counts and
covariances of unions of folds), per grid method, so that they never call back into binning."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from privmon.estimators.binned_scores import BinnedScores, cell_width
from privmon.estimators.folds import CERTIFY_FOLDS
from privmon.estimators.record_binning import BinnedRecords

__all__ = [
    "CertificateCells",
    "GridSelections",
    "Selections",
    "certificate_folds",
    "cross_fitting_folds",
    "record_selections",
    "stream_selections",
]

# Cell counts (2, T, cells), record counts (2, T), covariances (2, T, d, d) of T selections of
# folds: for the cross-fitted rules all folds then the complement of each fold (T = K + 1); for
# the certificate its held-out folds then its rule's (T = 2).
Selections = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class CertificateCells(NamedTuple):
    """The certificate's :func:`certificate_folds` (``selected``) on a grid of the same
    number of cells as its method's, of cell ``width`` (see
    :class:`~privmon.estimators.record_binning.BinnedRecords` ``certified``)."""

    width: torch.Tensor
    selected: Selections


class GridSelections(NamedTuple):
    """What the later stages read of one grid method's binned records, so that they never call
    back into this stage: the grid's ``bins`` and cell ``width``, its ``folds``, its per-fold
    cell ``counts`` (2, folds, cells), the records dropped (``n_dropped``, (2,)), the
    :func:`cross_fitting_folds` (``selected``) and each certificate's :class:`CertificateCells`
    (``certificates``, in the order of ``CERTIFY_FOLDS``)."""

    bins: tuple[int, ...]
    width: torch.Tensor
    folds: int
    counts: torch.Tensor
    n_dropped: torch.Tensor
    selected: Selections
    certificates: tuple[CertificateCells, ...]


def stream_selections(state: BinnedScores) -> GridSelections:
    """The :class:`GridSelections` of a streaming state: its :func:`cross_fitting_folds` and its
    certificates' :func:`certificate_folds`, all on the state's one grid (a stream keeps one
    state only: its certificates' rules read the grid the stream's first batch fixed)."""
    certificates = tuple(
        CertificateCells(state.width, certificate_folds(state, held_out))
        for held_out in CERTIFY_FOLDS
    )
    return _grid_selections(state, cross_fitting_folds(state), certificates)


def record_selections(binned: BinnedRecords, bins: dict[str, int]) -> dict[str, GridSelections]:
    """Each grid method's :class:`GridSelections` (``bins``: the methods that read this binning
    pass -> their cells per dimension) from records binned once (:func:`~privmon.estimators.
    record_binning.bin_records`), the certificates read where it binned them: a method of the
    finest grid's cells reads its selections, any other (1-D) those cells summed to its own
    (a divisor of the finest); methods of the same cells share one :class:`GridSelections`."""
    fine = binned.fine
    fine_bins = fine.allocated().bins[0]
    fine_selected = [certificate_folds(state, held) for state, held in _certified(binned)]
    fine_folds = cross_fitting_folds(fine)
    by_bins: dict[int, GridSelections] = {}
    for b in dict.fromkeys(bins.values()):
        if b == fine_bins:
            certificates = tuple(
                CertificateCells(state.width, selected)
                for (state, _), selected in zip(_certified(binned), fine_selected, strict=True)
            )
            by_bins[b] = _grid_selections(fine, fine_folds, certificates)
            continue
        if fine_bins % b:
            raise ValueError(f"a method's {b} cells do not divide the finest grid's {fine_bins}")
        factor = fine_bins // b
        coarse = binned.grid if binned.grid.allocated().bins[0] == b else fine.coarsen(factor)
        certificates = tuple(
            CertificateCells(
                cell_width(state.allocated().low, state.allocated().high, (b,)),
                _coarsened(selected, b, factor),
            )
            for (state, _), selected in zip(_certified(binned), fine_selected, strict=True)
        )
        by_bins[b] = _grid_selections(coarse, _coarsened(fine_folds, b, factor), certificates)
    return {method: by_bins[b] for method, b in bins.items()}


def _certified(binned: BinnedRecords):
    """Each certificate's state and held-out folds."""
    return zip(binned.certified, CERTIFY_FOLDS, strict=True)


def cross_fitting_folds(state: BinnedScores) -> Selections:
    """Cell counts (2, K+1, cells), record counts (2, K+1) and covariances (2, K+1, d, d) of the
    fold selections the cross-fitted rules use: all folds (the plug-in), then the complement
    of each fold — one matrix product each."""
    device = state.allocated().counts.device
    counts, ns, _, covs = state.pooled(_cross_fitting_weights(state.folds, device))
    return counts, ns, covs


def certificate_folds(state: BinnedScores, held_out: tuple[int, ...]) -> Selections:
    """Cell counts (2, 2, cells), record counts (2, 2) and covariances (2, 2, d, d) of a
    certificate's held-out folds and of the folds its rule learns on (the others)."""
    device = state.allocated().counts.device
    counts, ns, _, covs = state.pooled(_certificate_weights(state.folds, held_out, device))
    return counts, ns, covs


def _grid_selections(
    state: BinnedScores, selected: Selections, certificates: tuple[CertificateCells, ...]
) -> GridSelections:
    """The :class:`GridSelections` of a state from its fold selections and certificates'."""
    grid = state.allocated()
    return GridSelections(
        grid.bins, state.width, state.folds, grid.counts, state.n_dropped, selected, certificates
    )


@functools.lru_cache(maxsize=8)
def _cross_fitting_weights(k: int, device: torch.device) -> torch.Tensor:
    """The (K+1, K) 0/1 fold weights of :func:`cross_fitting_folds` (cached: read-only)."""
    weights = torch.ones(k + 1, k, dtype=torch.float64, device=device)
    weights[1:].fill_diagonal_(0.0)
    return weights


@functools.lru_cache(maxsize=8)
def _certificate_weights(k: int, held_out: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The (2, K) 0/1 fold weights of :func:`certificate_folds` (cached: read-only)."""
    weights = torch.zeros(2, k, dtype=torch.float64, device=device)
    weights[0, list(held_out)] = 1.0
    weights[1] = 1.0 - weights[0]
    return weights


def _coarsened(selections: Selections, bins: int, factor: int) -> Selections:
    """1-D selections on a grid ``factor`` times coarser: each cell the sum of ``factor``."""
    counts, ns, covs = selections
    return counts.reshape(*counts.shape[:2], bins, factor).sum(dim=-1), ns, covs
