"""Stage 1 of the estimators: bin. Scores binned on a fixed grid, per class and per fold (the
streaming state), and the fold selections every grid estimate reads.

Every estimate privmon makes from a stream (histogram W_N, binned KDE U_N, the cross-fitted
debiased advantage, its certified lower bound, individual risks) is a function of these counts
and of the first two moments, so the state is a handful of tensors that

* live on the scores' device and are updated batch by batch (memory independent of batches seen),
* merge by addition (``merge_`` here, ``all_reduce(SUM)`` across ranks), and
* round-trip through ``state_dict`` / ``load_state_dict``.

**Bin edges.** Pass ``low`` / ``high`` to fix them. Otherwise they are fixed by the first batch:
its pooled range (cut to [Q1 − 5·IQR, Q3 + 5·IQR], see :func:`robust_range`) widened by
``margin`` times its width on each side. Records that fall outside
later land in the edge bins (overflow bins) and are counted in ``n_overflow``; a large count means
the grid was fixed on an unrepresentative first batch. The functional API passes the full data
as one batch with ``margin=0``, so its grid spans the data range (MACE §9.1) unless the tails
are far heavier than a Gaussian's.

**Folds.** Record ``i`` of a class (counted from the first update) goes to fold
``hash(i) mod folds`` (a multiplicative hash, so sorted streams are still spread evenly). The fold
depends only on the record's position, never on batch sizes or on an RNG, so a stream and the same
records passed at once give identical counts.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from privmon._validation import as_scores, to_numpy
from privmon.estimators.tensors import small_tensor

__all__ = [
    "CERTIFY_FOLDS",
    "MAX_CELLS",
    "BinnedRecords",
    "BinnedScores",
    "CertificateCells",
    "ClassCounts",
    "GridSelections",
    "Selections",
    "bin_records",
    "certificate_selections",
    "fold_of",
    "fold_selections",
    "grid_selections",
    "record_selections",
    "robust_range",
    "select_folds",
]

_HASH = 0x9E3779B1  # Knuth's multiplicative hash constant (2^32 / golden ratio)
MAX_CELLS = 1 << 22
# The certificates of a 1-2-D estimate, by the folds each one certifies (its rule learns on the
# others); ``lower`` is the larger, each certified at δ / 2. A rule learned on one fold of four
# certifies on three, which wins on most leaks (benchmarks/power.py); one learned on two folds
# finds a sharp leak from few members that the first blurs (examples/dp_classifier.py's losses
# of 100 members).
CERTIFY_FOLDS: tuple[tuple[int, ...], ...] = ((0, 1, 2), (0, 1))


TAIL_IQRS = 5.0


def sort_ascending(x: torch.Tensor) -> torch.Tensor:
    """x sorted along its first dimension. On the CPU numpy's vectorized sort (3× faster than
    torch.sort or a multi-pivot selection on 4k to 200k scores, measured); elsewhere torch.sort
    on the device."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.sort(to_numpy(x), axis=0))
    return torch.sort(x, dim=0).values


def argsort_ascending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D x sorted ascending and the sorting indices (numpy's sort on the CPU, see
    :func:`sort_ascending`)."""
    if x.device.type == "cpu":
        values = to_numpy(x)
        order = np.argsort(values)
        return torch.from_numpy(values[order]), torch.from_numpy(order)
    return torch.sort(x)


def _order_statistics(x: torch.Tensor, ranks: Sequence[int], presorted: bool) -> torch.Tensor:
    """The rank-r smallest value per column of x for each r (0-based), stacked (len(ranks), d):
    read off a sort on the CPU (see :func:`sort_ascending`), kthvalue elsewhere."""
    if presorted:
        return x[list(ranks)]
    if x.device.type == "cpu":
        return sort_ascending(x)[list(ranks)]
    return torch.stack([torch.kthvalue(x, r + 1, dim=0).values for r in ranks])


def column_quantiles(
    x: torch.Tensor, qs: Sequence[float], extra: Sequence[int] = (), *, presorted: bool = False
):
    """torch.quantile(x, q, dim=0) (linear interpolation) for each q, stacked (len(qs), d), and
    the order statistics of the ranks in ``extra`` (len(extra), d), from one sort or selection
    pass. ``presorted``: x is already sorted along dim 0."""
    n = x.shape[0]
    positions = [q * (n - 1) for q in qs]
    below = [math.floor(p) for p in positions]
    above = [min(b + 1, n - 1) for b in below]
    stats = _order_statistics(x, [*below, *above, *extra], presorted)
    k = len(qs)
    fractions = [[p - b] for p, b in zip(positions, below, strict=True)]
    weights = small_tensor(fractions, np.float64, x.device).to(x.dtype)
    # torch.lerp is torch.quantile's interpolation, bit for bit
    return torch.lerp(stats[:k], stats[k : 2 * k], weights), stats[2 * k :]


def robust_range(x: torch.Tensor, *, presorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension [min, max], cut to [Q1 − 5·IQR, Q3 + 5·IQR] where the IQR is positive
    (and widened to [x − 0.5, x + 0.5] for a constant score x). ``presorted``: x is already
    sorted along dim 0 (the monitor shares one sort with the ROC).

    Heavy-tailed scores (per-record losses: most near 0, a few wrong records far out) would
    otherwise squeeze almost every record into one of the equal-width bins; the few records
    beyond the cut go to the edge bins. For Gaussian scores the cut lies 7σ out and never binds.
    """
    n = x.shape[0]
    if presorted or n <= 1 << 22:  # min and max come from the same sort as the quartiles
        (q1, q3), (lo, hi) = column_quantiles(x, (0.25, 0.75), (0, n - 1), presorted=presorted)
    else:  # quartiles of a strided sample
        (q1, q3), _ = column_quantiles(x[:: n // (1 << 22) + 1], (0.25, 0.75))
        lo, hi = torch.aminmax(x, dim=0)
    if x.device.type == "cpu":  # a few numbers per dimension: numpy is far cheaper per operation
        lo, hi = _fences(to_numpy(q1), to_numpy(q3), to_numpy(lo), to_numpy(hi), np)
        return torch.from_numpy(lo), torch.from_numpy(hi)
    return _fences(q1, q3, lo, hi, torch)


def _fences(q1, q3, lo, hi, xp):
    """[lo, hi] cut to [Q1 − 5·IQR, Q3 + 5·IQR] where the IQR is positive, a constant score
    widened to [x − 0.5, x + 0.5]; ``xp`` is numpy or torch (the same calls in both)."""
    iqr = q3 - q1
    ok = iqr > 0
    lo = xp.where(ok, xp.maximum(lo, q1 - TAIL_IQRS * iqr), lo)
    hi = xp.where(ok, xp.minimum(hi, q3 + TAIL_IQRS * iqr), hi)
    flat = hi <= lo  # a constant score: one unit-wide range around it
    return xp.where(flat, lo - 0.5, lo), xp.where(flat, hi + 0.5, hi)


def fold_of(index: torch.Tensor, folds: int) -> torch.Tensor:
    """Fold of each running record index (int64 tensor)."""
    return ((index * _HASH) % (1 << 32) >> 16) % folds


_CACHED_ROWS = 1 << 16


def _groups(start0: int, n0: int, start1: int, n1: int, folds: int, device: torch.device):
    """(class · folds + fold) and class of each row of a batch of ``n0`` members (running indices
    from ``start0``) then ``n1`` non-members (from ``start1``). A monitor bins the same record
    positions at every check, so small batches' groups are cached (read-only tensors)."""
    if n0 + n1 <= _CACHED_ROWS:
        return _cached_groups(start0, n0, start1, n1, folds, device)
    return _make_groups(start0, n0, start1, n1, folds, device)


def _make_groups(start0: int, n0: int, start1: int, n1: int, folds: int, device: torch.device):
    index = torch.cat(
        [
            torch.arange(start0, start0 + n0, device=device),
            torch.arange(start1, start1 + n1, device=device),
        ]
    )
    cls = torch.cat(
        [
            torch.zeros(n0, dtype=torch.int64, device=device),
            torch.ones(n1, dtype=torch.int64, device=device),
        ]
    )
    return fold_of(index, folds) + cls * folds, cls


_cached_groups = functools.lru_cache(maxsize=8)(_make_groups)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on ``device`` (without an operation when it is there already)."""
    return t if t.device == device else t.to(device)


def _cell_width(low: torch.Tensor, high: torch.Tensor, bins: tuple[int, ...]) -> torch.Tensor:
    return (high - low) / small_tensor(bins, np.float64, low.device)


class GridState(NamedTuple):
    """The grid and sums of a :class:`BinnedScores` whose grid is allocated
    (:meth:`BinnedScores.allocated`): ``bins`` cells per dimension, ``low`` / ``high`` the grid's
    edges (d,), ``counts`` (2, folds, cells), ``sum1`` (2, folds, d) and ``sum2``
    (2, folds, d, d)."""

    bins: tuple[int, ...]
    low: torch.Tensor
    high: torch.Tensor
    counts: torch.Tensor
    sum1: torch.Tensor
    sum2: torch.Tensor


class BinnedScores:
    """Member / non-member scores binned on a fixed grid, kept per fold, with moments.

    ``bins``: cells per dimension (an int, or one per dimension). ``folds``: cross-fitting folds
    (at least 4: folds 0-2 and 0-1 certify the lower bound against rules fitted on the rest).
    """

    def __init__(
        self,
        *,
        bins: int | Sequence[int] = 100,
        folds: int = 4,
        low: Sequence[float] | float | None = None,
        high: Sequence[float] | float | None = None,
        margin: float = 0.1,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 4:
            raise ValueError(f"folds must be an integer >= 4, got {folds!r}")
        if not (margin >= 0 and math.isfinite(margin)):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        bins_t = (bins,) if isinstance(bins, int) else tuple(bins)
        if not bins_t or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bins_t
        ):
            raise ValueError(f"bins must be a positive integer or a sequence of them, got {bins!r}")
        if (low is None) != (high is None):
            raise ValueError("low and high must be given together (or neither)")
        self._bins_arg = bins_t
        self.folds = folds
        self.margin = float(margin)
        self.device = torch.device(device) if device is not None else None
        self.bins: tuple[int, ...] | None = None
        self.low: torch.Tensor | None = None
        self.high: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # (2, folds, prod(bins)) float64
        self.sum1: torch.Tensor | None = None  # (2, folds, d)   sum of x
        self.sum2: torch.Tensor | None = None  # (2, folds, d, d) sum of x x^T
        self.n_seen = torch.zeros(2, dtype=torch.int64)
        self.n_dropped = torch.zeros(2, dtype=torch.int64)
        self.n_overflow = torch.zeros(2, dtype=torch.int64)
        if low is not None:
            d = len(bins_t) if len(bins_t) > 1 else None
            lo = torch.atleast_1d(torch.as_tensor(low, dtype=torch.float64))
            hi = torch.atleast_1d(torch.as_tensor(high, dtype=torch.float64))
            if lo.shape != hi.shape or (d is not None and lo.numel() != d):
                raise ValueError("low and high must have one value per dimension")
            if not bool((hi > lo).all()):
                raise ValueError("high must be greater than low in every dimension")
            self._allocate(lo, hi)

    # -- set-up -----------------------------------------------------------------------------
    @property
    def dim(self) -> int | None:
        """Dimensions per score, None until the grid is allocated."""
        return None if self.low is None else int(self.low.numel())

    @property
    def initialized(self) -> bool:
        """Whether the grid is allocated (``low`` / ``high`` given, or a batch seen)."""
        return self.counts is not None

    def allocated(self) -> GridState:
        """The grid and sums (each None until the grid is allocated) as non-None tensors;
        ValueError when the state holds no scores yet."""
        if (
            self.bins is None
            or self.low is None
            or self.high is None
            or self.counts is None
            or self.sum1 is None
            or self.sum2 is None
        ):
            raise ValueError("the state holds no scores yet")
        return GridState(self.bins, self.low, self.high, self.counts, self.sum1, self.sum2)

    def _allocate(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        d = lo.numel()
        bins = self._bins_arg * d if len(self._bins_arg) == 1 else self._bins_arg
        if len(bins) != d:
            raise ValueError(f"bins has {len(bins)} entries but the scores have {d} dimensions")
        cells = math.prod(bins)
        if cells > MAX_CELLS:
            raise ValueError(
                f"bins per dimension {bins} give {cells} cells in {d} dimensions, more than "
                f"{MAX_CELLS}; use fewer bins (the functional API handles high dimensions)"
            )
        dev = self.device or lo.device
        self.bins = tuple(int(b) for b in bins)
        self.low, self.high = _on(lo, dev), _on(hi, dev)
        self._width = _cell_width(self.low, self.high, self.bins)
        self.counts = torch.zeros(2, self.folds, cells, dtype=torch.float64, device=dev)
        self.sum1 = torch.zeros(2, self.folds, d, dtype=torch.float64, device=dev)
        self.sum2 = torch.zeros(2, self.folds, d, d, dtype=torch.float64, device=dev)
        for name in ("n_seen", "n_dropped", "n_overflow"):
            setattr(self, name, _on(getattr(self, name), dev))

    @property
    def width(self) -> torch.Tensor:
        """Cell width per dimension (computed once per grid: read on every update)."""
        return self._width

    def cell_index(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat cell index of each row of x (clamped into the edge bins) and an in-range mask."""
        grid = self.allocated()
        raw = torch.floor((x - grid.low) / self.width).to(torch.int64)
        inside = ((x >= grid.low) & (x <= grid.high)).all(dim=1)
        if len(grid.bins) == 1:
            return raw[:, 0].clamp(0, grid.bins[0] - 1), inside
        bins = torch.tensor(grid.bins, device=x.device)
        idx = torch.minimum(raw.clamp_min(0), bins - 1)
        strides = torch.ones_like(bins)
        strides[:-1] = torch.flip(torch.cumprod(torch.flip(bins[1:], [0]), 0), [0])
        return (idx * strides).sum(dim=1), inside

    # -- updates ----------------------------------------------------------------------------
    def update(self, member_scores: Any = None, nonmember_scores: Any = None) -> None:
        """Add a batch of member and/or non-member scores (NaN / inf rows dropped and counted)."""
        batches = []
        for cls, (scores, name) in enumerate(
            ((member_scores, "member_scores"), (nonmember_scores, "nonmember_scores"))
        ):
            if scores is None or len(scores) == 0:  # e.g. an empty shard of a rank
                continue
            dev = self.low.device if self.low is not None else self.device
            try:
                x, n_dropped = as_scores(scores, name=name, device=dev)
            except ValueError as err:
                if "no finite scores" not in str(err):
                    raise
                self.n_dropped[cls] += len(scores)
                continue
            if self.dim is not None and x.shape[1] != self.dim:
                raise ValueError(
                    f"{name} has {x.shape[1]} dimensions per score, the state holds {self.dim}"
                )
            batches.append((cls, x, n_dropped))
        if not batches:
            return
        if len({b[1].shape[1] for b in batches}) > 1:
            raise ValueError("member_scores and nonmember_scores must have the same dimension d")
        if not self.initialized:
            pooled = torch.cat([b[1] for b in batches])
            lo, hi = robust_range(pooled)
            span = hi - lo
            self._allocate(lo - self.margin * span, hi + self.margin * span)
        sizes, dropped = [0, 0], [0, 0]
        for c, x, n_dropped in batches:
            sizes[c] += x.shape[0]
            dropped[c] += n_dropped
        x = batches[0][1] if len(batches) == 1 else torch.cat([b[1] for b in batches])
        self._add(x, sizes, dropped)

    def _add(
        self, x: torch.Tensor, sizes: Sequence[int], dropped: Sequence[int] = (0, 0)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bin rows of x, ``sizes[0]`` members then ``sizes[1]`` non-members (finite float64 on
        the state's device, grid allocated), in one pass: one bincount for every (class, fold,
        cell), one index_add per moment. ``dropped``: the non-finite rows already removed.
        Returns the rows' :meth:`cell_index` (cell, in-range mask) and their groups
        (class · folds + fold)."""
        grid = self.allocated()
        dev = grid.counts.device
        seen = self.n_seen.tolist()
        group, cls = _groups(seen[0], sizes[0], seen[1], sizes[1], self.folds, dev)
        cell, inside = self.cell_index(x)
        cells = grid.counts.shape[2]
        grid.counts.view(-1).add_(
            torch.bincount(group * cells + cell, minlength=grid.counts.numel()).to(torch.float64)
        )
        grid.sum1.view(-1, grid.sum1.shape[-1]).index_add_(0, group, x)
        grid.sum2.flatten(0, 1).index_add_(0, group, x.unsqueeze(2) * x.unsqueeze(1))
        self.n_seen.add_(small_tensor(sizes, np.int64, dev))
        if any(dropped):
            self.n_dropped.add_(small_tensor(dropped, np.int64, dev))
        self.n_overflow.index_add_(0, cls, (~inside).to(torch.int64))
        return cell, inside, group

    def merge_(self, other: BinnedScores) -> BinnedScores:
        """Add another state's counts in place (same grid): all_reduce(SUM) across ranks."""
        if not other.initialized or not self.initialized:
            # A state that saw only NaN batches has no grid yet but still counts its records.
            kept = {
                name: getattr(self, name).cpu() for name in ("n_seen", "n_dropped", "n_overflow")
            }
            if not other.initialized:
                for name, value in kept.items():
                    value += getattr(other, name).cpu()
                    setattr(self, name, value.to(getattr(self, name).device))
                return self
            self.load_state_dict(other.state_dict())
            for name, value in kept.items():
                getattr(self, name).add_(value.to(getattr(self, name).device))
            return self
        grid, theirs = self.allocated(), other.allocated()
        if (
            grid.bins != theirs.bins
            or self.folds != other.folds
            or not (
                torch.equal(grid.low, theirs.low.to(grid.low))
                and torch.equal(grid.high, theirs.high.to(grid.high))
            )
        ):
            raise ValueError(
                f"cannot merge states with different grids or folds (this state: "
                f"{_grid_text(self)}; the other: {_grid_text(other)}): each state fixes its "
                "grid on its first batch "
                "unless low / high are given — create the states to merge (one per rank or "
                "worker) with the same low, high, bins and folds"
            )
        for name in self.reducible:
            getattr(self, name).add_(getattr(other, name).to(grid.low.device))
        return self

    reducible = ("counts", "sum1", "sum2", "n_seen", "n_dropped", "n_overflow")

    def reset(self) -> None:
        """Zero the counts, keeping the grid."""
        if self.initialized:
            for name in self.reducible:
                getattr(self, name).zero_()

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The configuration, grid and counts (tensors are not copied): a checkpoint."""
        out: dict[str, Any] = {
            "folds": self.folds,
            "bins": list(self._bins_arg),
            "margin": self.margin,
        }
        if self.initialized:
            grid = self.allocated()
            out.update({"grid_bins": list(grid.bins), "low": grid.low, "high": grid.high})
        for name in self.reducible:
            t = getattr(self, name)
            if t is not None:
                out[name] = t
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (same folds); shapes are checked against its grid."""
        if int(state["folds"]) != self.folds:
            raise ValueError(f"state has {state['folds']} folds, this estimator {self.folds}")
        if "low" in state:
            self._bins_arg = tuple(state["grid_bins"])
            self._allocate(state["low"].to(torch.float64), state["high"].to(torch.float64))
            grid = self.allocated()
            expected = {
                "counts": grid.counts.shape,
                "sum1": grid.sum1.shape,
                "sum2": grid.sum2.shape,
            }
            for name, shape in expected.items():
                if tuple(state[name].shape) != tuple(shape):
                    raise ValueError(
                        f"state {name} has shape {tuple(state[name].shape)}, "
                        f"expected {tuple(shape)}"
                    )
        for name in self.reducible:
            if name in state:
                setattr(
                    self,
                    name,
                    state[name].clone().to(self.low.device if self.low is not None else "cpu"),
                )

    # -- derived quantities -----------------------------------------------------------------
    def coarsen(self, factor: int | Sequence[int]) -> BinnedScores:
        """A new state on a grid ``factor`` times coarser per dimension (each new cell the sum
        of ``factor`` adjacent cells; moments, folds and counters unchanged), so one binning
        pass can serve a fine KDE grid and the 100-bin histogram at once. The bins of every
        dimension must be multiples of its factor."""
        grid = self.allocated()
        d = len(grid.bins)
        factors = (factor,) * d if isinstance(factor, int) else tuple(factor)
        if len(factors) != d or any(
            isinstance(f, bool) or not isinstance(f, int) or f < 1 or b % f
            for f, b in zip(factors, grid.bins, strict=True)
        ):
            raise ValueError(
                f"factor must be a positive integer (or one per dimension) dividing the bins "
                f"{grid.bins}, got {factor!r}"
            )
        coarse_bins = tuple(b // f for b, f in zip(grid.bins, factors, strict=True))
        out = copy.copy(self)  # the grid's edges are shared: they are never changed in place
        out._bins_arg = out.bins = coarse_bins
        out._width = _cell_width(grid.low, grid.high, coarse_bins)
        split = [s for b, f in zip(coarse_bins, factors, strict=True) for s in (b, f)]
        cells = grid.counts.reshape(2, self.folds, *split)
        out.counts = cells.sum(dim=tuple(range(3, 3 + 2 * d, 2))).reshape(2, self.folds, -1)
        for name in ("sum1", "sum2", "n_seen", "n_dropped", "n_overflow"):
            setattr(out, name, getattr(self, name).clone())
        return out

    def fold_weights(self, folds: Sequence[int] | None = None) -> torch.Tensor:
        """A (1, folds) 0/1 row selecting ``folds`` (all when None), for :meth:`pooled`."""
        w = torch.zeros(1, self.folds, dtype=torch.float64, device=self.allocated().counts.device)
        w[0, slice(None) if folds is None else list(folds)] = 1.0
        return w

    def pooled(self, weights: torch.Tensor):
        """Counts and moments of several fold selections at once.

        ``weights`` (T, folds) holds one 0/1 row per selection. Returns per class and selection:
        cell counts (2, T, cells), record counts (2, T), means (2, T, d) and unbiased covariances
        (2, T, d, d) — one matrix product each, however many selections.
        """
        grid = self.allocated()
        counts = torch.matmul(weights, grid.counts)
        d = grid.sum1.shape[-1]
        n = counts.sum(dim=2)
        s1 = torch.matmul(weights, grid.sum1)
        s2 = torch.matmul(weights, grid.sum2.flatten(2)).unflatten(2, (d, d))
        return (counts, n, *_mean_cov(n, s1, s2))

    def class_counts(self, folds: Sequence[int] | None = None) -> torch.Tensor:
        """Counts per class summed over ``folds`` (all when None): shape (2, cells)."""
        if folds is None:
            return self.allocated().counts.sum(dim=1)
        return self.pooled(self.fold_weights(folds))[0][:, 0]

    def moments(self, folds: Sequence[int] | None = None):
        """(n, mean, unbiased covariance) per class over ``folds``: shapes (2,), (2,d), (2,d,d)."""
        if folds is None:
            grid = self.allocated()
            n, s1, s2 = grid.counts.sum(dim=(1, 2)), grid.sum1.sum(dim=1), grid.sum2.sum(dim=1)
            return (n, *_mean_cov(n, s1, s2))
        _, n, mean, cov = self.pooled(self.fold_weights(folds))
        return n[:, 0], mean[:, 0], cov[:, 0]


def _mean_cov(n: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor):
    """Means and unbiased covariances from record counts (...), sums (..., d) and sums of outer
    products (..., d, d)."""
    nn = n.clamp_min(1)[..., None]
    mean = s1 / nn
    outer = mean.unsqueeze(-1) * mean.unsqueeze(-2)
    cov = (s2 - nn[..., None] * outer) / (nn - 1).clamp_min(1)[..., None]
    return mean, cov


def pooled_ranks(
    sorted_values: torch.Tensor, order: torch.Tensor, among: torch.Tensor | None = None
) -> torch.Tensor:
    """The pooled mid-ranks of 1-D scores scaled into (0, 1), in the scores' own order, from
    their ascending sort (``sorted_values``, ``order``): a score at sorted positions [s, e) of n
    (a group of ties) maps to (s + e) / (2n). ``among`` (a boolean mask over the scores): rank
    every score among those records only — m of them, b below a score and t tied with it give
    (2b + t) / (2m), a function of those records alone. A strictly increasing transform of the
    scores leaves these unchanged, so every figure computed from them is invariant under it."""
    n = sorted_values.shape[0]
    _, counts = torch.unique_consecutive(sorted_values, return_counts=True)
    ends = torch.cumsum(counts, 0)
    tied, total = counts, n
    if among is not None:  # the counted records up to each group's end, and within it
        ends = torch.cumsum(among[order].to(torch.int64), 0)[ends - 1]
        tied = torch.diff(ends, prepend=ends.new_zeros(1))
        total = max(int(ends[-1]), 1)
    mid = (2 * ends - tied).to(torch.float64) / (2 * total)
    ranks = torch.empty(n, dtype=torch.float64, device=sorted_values.device)
    ranks[order] = torch.repeat_interleave(mid, counts)
    return ranks


@dataclass(frozen=True)
class ClassCounts:
    """Scores counted per class on a fixed grid, without folds: all the paper's plug-ins need.
    ``counts`` (2, cells), ``n`` (2,) records and ``cov`` (2, d, d) unbiased covariances per
    class; ``bins`` and ``width`` the grid's (as on :class:`BinnedScores`); ``extent`` the
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
    :meth:`BinnedScores.cell_index`): one bincount. ``extent``: the scores' max − min."""
    low, high = (
        _on(torch.as_tensor(low, dtype=x.dtype), x.device),
        _on(torch.as_tensor(high, dtype=x.dtype), x.device),
    )
    width = _cell_width(low.reshape(1), high.reshape(1), (bins,))
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
    cell, _, group = fine._add(rule_x, sizes)
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
    certified._add(cert_x, sizes)
    return certified


# -- fold selections -------------------------------------------------------------------------
# Cell counts (2, T, cells), record counts (2, T), covariances (2, T, d, d) of T selections of
# folds: for the cross-fitted rules all folds then the complement of each fold (T = K + 1); for
# the certificate its held-out folds then its rule's (T = 2).
Selections = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class CertificateCells(NamedTuple):
    """The certificate's :func:`certificate_selections` (``selected``) on a grid of the same
    number of cells as its method's, of cell ``width`` (see :class:`BinnedRecords`
    ``certified``)."""

    width: torch.Tensor
    selected: Selections


class GridSelections(NamedTuple):
    """What the later stages read of one grid method's binned records, so that they never call
    back into this stage: the grid's ``bins`` and cell ``width``, its ``folds``, its per-fold
    cell ``counts`` (2, folds, cells), the records dropped (``n_dropped``, (2,)), the
    :func:`fold_selections` (``selected``) and each certificate's :class:`CertificateCells`
    (``certificates``, in the order of ``CERTIFY_FOLDS``)."""

    bins: tuple[int, ...]
    width: torch.Tensor
    folds: int
    counts: torch.Tensor
    n_dropped: torch.Tensor
    selected: Selections
    certificates: tuple[CertificateCells, ...]


def select_folds(
    state: BinnedScores,
    selected: Selections | None = None,
    certificates: tuple[CertificateCells, ...] | None = None,
) -> GridSelections:
    """The :class:`GridSelections` of a state: its :func:`fold_selections` and (read on the
    same state unless given) the certificates' cells. A stream has one state only: its
    certificates' rules read the grid the stream's first batch fixed."""
    grid = state.allocated()
    if selected is None:
        selected = fold_selections(state)
    if certificates is None:
        certificates = tuple(
            CertificateCells(state.width, certificate_selections(state, held_out))
            for held_out in CERTIFY_FOLDS
        )
    return GridSelections(
        grid.bins, state.width, state.folds, grid.counts, state.n_dropped, selected, certificates
    )


def fold_selections(state: BinnedScores) -> Selections:
    """Cell counts (2, K+1, cells), record counts (2, K+1) and covariances (2, K+1, d, d) of the
    fold selections the cross-fitted rules use: all folds (the plug-in), then the complement
    of each fold — one matrix product each."""
    device = state.allocated().counts.device
    counts, ns, _, covs = state.pooled(_selection_weights(state.folds, device))
    return counts, ns, covs


def certificate_selections(state: BinnedScores, held_out: tuple[int, ...]) -> Selections:
    """Cell counts (2, 2, cells), record counts (2, 2) and covariances (2, 2, d, d) of a
    certificate's held-out folds and of the folds its rule learns on (the others)."""
    device = state.allocated().counts.device
    counts, ns, _, covs = state.pooled(_certificate_weights(state.folds, held_out, device))
    return counts, ns, covs


@functools.lru_cache(maxsize=8)
def _selection_weights(k: int, device: torch.device) -> torch.Tensor:
    """The (K+1, K) 0/1 fold weights of :func:`fold_selections` (cached: read-only)."""
    weights = torch.ones(k + 1, k, dtype=torch.float64, device=device)
    weights[1:].fill_diagonal_(0.0)
    return weights


@functools.lru_cache(maxsize=8)
def _certificate_weights(k: int, held_out: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The (2, K) 0/1 fold weights of :func:`certificate_selections` (cached: read-only)."""
    weights = torch.zeros(2, k, dtype=torch.float64, device=device)
    weights[0, list(held_out)] = 1.0
    weights[1] = 1.0 - weights[0]
    return weights


def record_selections(binned: BinnedRecords) -> GridSelections:
    """The :class:`GridSelections` of records binned on one grid (no finer KDE grid), with the
    certificates read where :func:`bin_records` binned them."""
    return select_folds(
        binned.grid,
        certificates=tuple(
            CertificateCells(state.width, certificate_selections(state, held_out))
            for state, held_out in zip(binned.certified, CERTIFY_FOLDS, strict=True)
        ),
    )


def _coarsened(selections: Selections, bins: int, factor: int) -> Selections:
    """1-D selections on a grid ``factor`` times coarser: each cell the sum of ``factor``."""
    counts, ns, covs = selections
    return counts.reshape(*counts.shape[:2], bins, factor).sum(dim=-1), ns, covs


def grid_selections(binned: BinnedRecords) -> dict[str, GridSelections]:
    """Each grid method's :class:`GridSelections` from one binning pass: the histogram's alone,
    or (1-D, when the KDE's finer grid was binned) the KDE's and the histogram's summed from
    its cells."""
    if binned.fine is binned.grid:
        return {"histogram": record_selections(binned)}
    grid, fine = binned.grid, binned.fine
    fine_folds = fold_selections(fine)
    coarse_bins = grid.allocated().bins[0]
    factor = fine.allocated().bins[0] // coarse_bins
    fine_certificates, coarse_certificates = [], []
    for state, held_out in zip(binned.certified, CERTIFY_FOLDS, strict=True):
        selected = certificate_selections(state, held_out)
        limits = state.allocated()
        fine_certificates.append(CertificateCells(state.width, selected))
        coarse_certificates.append(
            CertificateCells(
                _cell_width(limits.low, limits.high, (coarse_bins,)),
                _coarsened(selected, coarse_bins, factor),
            )
        )
    return {
        "histogram": select_folds(
            grid, _coarsened(fine_folds, coarse_bins, factor), tuple(coarse_certificates)
        ),
        "kde": select_folds(fine, fine_folds, tuple(fine_certificates)),
    }


def _grid_text(state: BinnedScores) -> str:
    """A state's grid in words, for a merge that cannot be made."""
    grid = state.allocated()
    bins = " x ".join(map(str, np.atleast_1d(grid.bins).tolist()))
    edges = ", ".join(f"[{lo:.4g}, {hi:.4g}]" for lo, hi in zip(grid.low, grid.high, strict=True))
    return f"{bins} bins over {edges}, {state.folds} folds"
