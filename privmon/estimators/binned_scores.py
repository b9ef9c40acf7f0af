"""Member / non-member scores binned on a fixed grid, per class and per fold, with their first
two moments: the streaming state (:class:`BinnedScores`) that every grid estimate reads.

Every estimate privmon makes from a stream (W_N, binned U_N, the cross-fitted advantage, its
certificate, individual risks) is a function of these counts and moments, so the state is a
handful of tensors that live on the scores' device, are updated batch by batch (memory
independent of batches seen), merge by addition (``merge_``, ``all_reduce(SUM)`` across ranks)
and round-trip through ``state_dict``. The grid's edges are ``low`` / ``high`` when given, else
fixed by the first batch (its robust range widened by ``margin``); later records outside land in
the edge bins and are counted in ``n_overflow``. A record's fold follows from its position within
its class (:mod:`~privmon.estimators.folds`), so a stream and the same records passed at once give
identical counts. Theory, *The optimal advantage and its estimators* (*Grids*).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from privmon._validation import as_scores
from privmon.estimators.folds import record_groups
from privmon.estimators.order_statistics import robust_range
from privmon.estimators.tensors import on_device, small_tensor

__all__ = ["MAX_CELLS", "BinnedScores", "GridState", "cell_width"]

MAX_CELLS = 1 << 22


def cell_width(low: torch.Tensor, high: torch.Tensor, bins: tuple[int, ...]) -> torch.Tensor:
    """The width per dimension of ``bins`` equal cells over [low, high]."""
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

    Examples:
        >>> import torch
        >>> from privmon.estimators import BinnedScores
        >>> gen = torch.Generator().manual_seed(0)
        >>> state = BinnedScores(bins=50, low=-3.0, high=3.0)
        >>> state.update(torch.randn(300, generator=gen) + 0.5, torch.randn(300, generator=gen))
        >>> state.class_counts().shape, state.n_seen.tolist(), state.n_overflow.tolist()
        (torch.Size([2, 50]), [300, 300], [2, 3])
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
        self.low, self.high = on_device(lo, dev), on_device(hi, dev)
        self._width = cell_width(self.low, self.high, self.bins)
        self.counts = torch.zeros(2, self.folds, cells, dtype=torch.float64, device=dev)
        self.sum1 = torch.zeros(2, self.folds, d, dtype=torch.float64, device=dev)
        self.sum2 = torch.zeros(2, self.folds, d, d, dtype=torch.float64, device=dev)
        for name in ("n_seen", "n_dropped", "n_overflow"):
            setattr(self, name, on_device(getattr(self, name), dev))

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
        self.add_finite(x, sizes, dropped)

    def add_finite(
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
        group, cls = record_groups(seen[0], sizes[0], seen[1], sizes[1], self.folds, dev)
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
        out._width = cell_width(grid.low, grid.high, coarse_bins)
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


def _grid_text(state: BinnedScores) -> str:
    """A state's grid in words, for a merge that cannot be made."""
    grid = state.allocated()
    bins = " x ".join(map(str, np.atleast_1d(grid.bins).tolist()))
    edges = ", ".join(f"[{lo:.4g}, {hi:.4g}]" for lo, hi in zip(grid.low, grid.high, strict=True))
    return f"{bins} bins over {edges}, {state.folds} folds"
