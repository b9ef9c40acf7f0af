"""What the later stages read of binned records: the fold selections (counts, record counts and
covariances of unions of folds), per grid method, so that they never call back into binning."""

from __future__ import annotations

import functools
from collections.abc import Sequence
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


def record_selections(binned: BinnedRecords, methods: Sequence[str]) -> dict[str, GridSelections]:
    """Each grid method's :class:`GridSelections` (of ``methods``, the methods that read this
    binning pass) from records binned once (:func:`~privmon.estimators.record_binning.
    bin_records`), the certificates read where it binned them: on one grid every method reads
    the same selections; when the KDE's finer grid was binned (1-D), the KDE reads it and the
    histogram its cells summed."""
    if binned.fine is binned.grid:
        certificates = tuple(
            CertificateCells(state.width, certificate_folds(state, held_out))
            for state, held_out in zip(binned.certified, CERTIFY_FOLDS, strict=True)
        )
        one = _grid_selections(binned.grid, cross_fitting_folds(binned.grid), certificates)
        return dict.fromkeys(methods, one)
    grid, fine = binned.grid, binned.fine
    fine_folds = cross_fitting_folds(fine)
    coarse_bins = grid.allocated().bins[0]
    factor = fine.allocated().bins[0] // coarse_bins
    fine_certificates, coarse_certificates = [], []
    for state, held_out in zip(binned.certified, CERTIFY_FOLDS, strict=True):
        selected = certificate_folds(state, held_out)
        limits = state.allocated()
        fine_certificates.append(CertificateCells(state.width, selected))
        coarse_certificates.append(
            CertificateCells(
                cell_width(limits.low, limits.high, (coarse_bins,)),
                _coarsened(selected, coarse_bins, factor),
            )
        )
    return {
        "histogram": _grid_selections(
            grid, _coarsened(fine_folds, coarse_bins, factor), tuple(coarse_certificates)
        ),
        "kde": _grid_selections(fine, fine_folds, tuple(fine_certificates)),
    }


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
