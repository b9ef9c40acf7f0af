"""Squared Euclidean distances from records to a fixed set, in cache-sized blocks of one matrix
product each, with exact recomputation where rounding could flip a comparison. Shared by the
DOMIAS baselines and :class:`~privmon.queries.GeneratorQuery`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from privmon.estimators.density import BLOCK_ELEMENTS_CPU, BLOCK_ELEMENTS_DEVICE

__all__ = ["SquaredDistances", "median"]


def _rows_per_block(n: int, device: torch.device, dtype: torch.dtype) -> int:
    budget = BLOCK_ELEMENTS_CPU if device.type == "cpu" else BLOCK_ELEMENTS_DEVICE
    if dtype == torch.float32:
        budget *= 2  # the same bytes per block
    return max(1, budget // max(n, 1))


def _augment(
    left: Sequence[torch.Tensor], right: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack columns: ``torch.mm(A, B)`` then computes sum_k left_k * right_k per pair."""
    a = torch.cat([c.reshape(c.shape[0], -1) for c in left], dim=1).to(dtype)
    b = torch.cat([c.reshape(c.shape[0], -1) for c in right], dim=1).to(dtype).T.contiguous()
    return a, b


def _blocks(a: torch.Tensor, b: torch.Tensor):
    """Yield (start, stop, a[start:stop] @ b) in cache-sized blocks of rows (one buffer)."""
    m, n = a.shape[0], b.shape[1]
    rows = _rows_per_block(n, a.device, a.dtype)
    buf = torch.empty(min(rows, m), n, dtype=a.dtype, device=a.device)
    for s in range(0, m, rows):
        e = min(s + rows, m)
        yield s, e, torch.mm(a[s:e], b, out=buf[: e - s])


class SquaredDistances:
    """Squared Euclidean distances from test records ``x`` to a fixed set ``y``, in blocks.

    Uses |x - y|^2 = |x|^2 + (|y|^2 - 2 x.y) after centring both on the mean of ``y``: one matrix
    product per block (the bracket, as an inner product of augmented vectors), then a reduction.
    ``exact_rows`` recomputes rows directly, as a per-record loop does, from the inputs.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x_in, self.y_in = x, y
        center = y.mean(dim=0)
        self.x = x - center
        self.y = y - center
        self.xn = self.x.square().sum(dim=1)
        self.yn = self.y.square().sum(dim=1)
        self.n = y.shape[0]

    def min(self) -> torch.Tensor:
        """min_j |x_i - y_j|^2 (float64; rounding ~1e-16 times the centred squared norms)."""
        a, b = _augment([-2.0 * self.x, torch.ones_like(self.xn)], [self.y, self.yn], torch.float64)
        out = torch.empty_like(self.xn)
        for s, e, g in _blocks(a, b):
            torch.amin(g, dim=1, out=out[s:e])
        return out.add_(self.xn).clamp_min_(0.0)

    def exact_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """|x_i - y_j|^2 for the given rows i and every j, directly (shape (len(rows), n))."""
        return (self.x_in[rows, None, :] - self.y_in[None, :, :]).square().sum(dim=2)

    def _tolerance(self, xn: torch.Tensor, extra: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Bound on the rounding of |y|^2 - 2 x.y - extra in ``dtype`` for rows with squared
        norms ``xn``: the inputs and a (d + 2)-term dot product rounded in ``dtype``, times a
        safety factor of 4."""
        u = torch.finfo(dtype).eps / 2
        k = self.x.shape[1] + 2
        ymax = self.yn.max().sqrt()
        return 4 * (k + 4) * u * (2 * xn.sqrt() * ymax + ymax.square() + extra.abs())

    def mc_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """MC's eps (median of the per-record minimum) and #{j : |x_i - y_j|^2 < eps}.

        Both passes run in float32 (float64 for squared norms beyond 1e30); every record whose
        rounded value could fall on the other side of a comparison than its exact value (a
        rounding bound, :meth:`_tolerance`) is recomputed directly in float64, so the result
        equals the per-record float64 loop's."""
        dev = self.x.device
        big = max(float(self.xn.max()), float(self.yn.max()))
        dtype = torch.float32 if big < 1e30 and self.n < 2**24 else torch.float64
        exact_block = max(1, _rows_per_block(self.n, dev, torch.float64) // self.x.shape[1])
        # pass 1: rounded minima; exact values for every record that can be the median
        a, b = _augment([-2.0 * self.x, torch.ones_like(self.xn)], [self.y, self.yn], dtype)
        approx = torch.empty(self.x.shape[0], dtype=dtype, device=dev)
        for s, e, g in _blocks(a, b):
            torch.amin(g, dim=1, out=approx[s:e])
        mins = approx.to(torch.float64).add_(self.xn)
        tol = self._tolerance(self.xn, self.xn, dtype)
        lo, hi = median(mins - tol), median(mins + tol)
        cand = torch.nonzero((mins + tol >= lo) & (mins - tol <= hi)).flatten()
        for c in cand.split(exact_block):
            mins[c] = self.exact_rows(c).amin(dim=1)
        tol[cand] = 0.0
        eps = median(mins)
        # records whose nearest synthetic record is >= eps away count 0 (strict "<"): skip them
        counts = torch.zeros(self.x.shape[0], dtype=torch.long, device=dev)
        rows = torch.nonzero(mins - tol < eps).flatten()
        if rows.numel() == 0:
            return eps, counts
        # pass 2: the sign of |y|^2 - 2 x.y - (eps - |x|^2) = |x - y|^2 - eps, summed per row
        t = eps - self.xn[rows]
        a, b = _augment(
            [-2.0 * self.x[rows], torch.ones_like(t), -t],
            [self.y, self.yn, torch.ones_like(self.yn)],
            dtype,
        )
        sign_sum = torch.empty(rows.shape[0], dtype=dtype, device=dev)
        nearest = torch.empty(rows.shape[0], dtype=dtype, device=dev)
        spare = None
        for s, e, g in _blocks(a, b):
            if spare is None:
                spare = torch.empty_like(g)
            torch.amin(torch.abs(g, out=spare[: e - s]), dim=1, out=nearest[s:e])
            sign_sum[s:e] = g.sign_().sum(dim=1)
        # no value within the rounding bound of 0 -> no zeros, so #negative = (n - sum) / 2
        counts[rows] = ((self.n - sign_sum.to(torch.float64)) / 2).round_().to(torch.long)
        amb = rows[nearest.to(torch.float64) <= self._tolerance(self.xn[rows], t, dtype)]
        for c in amb.split(exact_block):
            counts[c] = (self.exact_rows(c) < eps).sum(dim=1)
        return eps, counts


def median(v: torch.Tensor) -> torch.Tensor:
    """numpy's median: the middle value, or (a + b) / 2 of the two middle values."""
    s = torch.sort(v).values
    n = s.shape[0]
    return (s[(n - 1) // 2] + s[n // 2]) / 2
