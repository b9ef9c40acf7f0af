"""Baseline membership-inference attacks against synthetic data, as DOMIAS compares them.

Source: van Breugel et al., "Membership Inference Attacks against Synthetic Data through
Overfitting Detection" (DOMIAS; Sec. 4, Table 1, Sec. 5.1) and the definitions of its
published code (``baselines.py`` of github.com/vanderschaarlab/DOMIAS), which every function here
reproduces in score order, vectorized in torch on the test records' device. Distances are
*squared* Euclidean distances, as in that code (``d(x, Y) = sum((x - Y)**2, axis=1)``).

Every function takes the test records first, then the synthetic records, then (where used) the
reference records: numpy arrays or torch tensors of shape (n, d) on any device, moved to the test
records' device and handled in float64 (LOGAN-D1 trains in float32). A higher score means "more
likely a member". Scores are returned as numpy float64 arrays of shape (n_test,), finite for
every finite input. Where the published code returns ``exp(-distance)`` (which underflows to 0
for far records and so ties them), the logarithm is returned instead: the same ranking, no ties
from underflow. ``embed`` / ``embed_dim`` work as in :func:`privmon.attacks.domias.domias_scores`
(``"pca"`` is fitted on the reference set when the attack takes one, otherwise on the synthetic
set).

Squared distances come from one matrix product per cache-sized block: after centring both sets
on the synthetic mean, ``|x - y|^2 = |x|^2 + (|y|^2 - 2 x.y)``, the bracket an inner product of
augmented vectors, followed by a row reduction; no (n_test, n) matrix is ever held. GAN-Leaks
minima are float64 (rounding ~1e-16 times the centred squared norms). MC runs both of its passes
in float32 and recomputes in float64, directly as a per-record loop does, every record that a
bound on the float32 rounding cannot settle (the records that could be the median, and the
records with a distance within rounding of eps), so its counts equal the per-record loop's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from privmon._validation import to_numpy
from privmon.attacks.domias import _kde, _prepare
from privmon.estimators.density import _BLOCK_ELEMENTS_CPU, _BLOCK_ELEMENTS_DEVICE

__all__ = ["eq1", "gan_leaks", "gan_leaks_cal", "logan_d1", "monte_carlo"]

Embed = str | Callable[..., Any] | None


def _rows_per_block(n: int, device: torch.device, dtype: torch.dtype) -> int:
    budget = _BLOCK_ELEMENTS_CPU if device.type == "cpu" else _BLOCK_ELEMENTS_DEVICE
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


class _SquaredDistances:
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
        lo, hi = _median(mins - tol), _median(mins + tol)
        cand = torch.nonzero((mins + tol >= lo) & (mins - tol <= hi)).flatten()
        for c in cand.split(exact_block):
            mins[c] = self.exact_rows(c).amin(dim=1)
        tol[cand] = 0.0
        eps = _median(mins)
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


def _median(v: torch.Tensor) -> torch.Tensor:
    """numpy's median: the middle value, or (a + b) / 2 of the two middle values."""
    s = torch.sort(v).values
    n = s.shape[0]
    return (s[(n - 1) // 2] + s[n // 2]) / 2


def eq1(
    test: Any,
    synthetic: Any,
    *,
    bandwidth: str | float = "scott",
    embed: Embed = None,
    embed_dim: int | None = None,
) -> np.ndarray:
    """Eq. 1 ablation ("ablated_eq1"): ``log p_G(x)``, p_G a Gaussian KDE of the synthetic set.

    scipy's ``gaussian_kde`` convention (Scott's factor by default), as the published code's
    ``kde_baseline``, which returns ``p_G(x)``; the log ranks identically and never underflows.
    """
    sets = _prepare(test, synthetic, None, embed=embed, embed_dim=embed_dim)
    kde = _kde(sets["synthetic"], name="synthetic", bandwidth=bandwidth)
    return to_numpy(kde.log_density(sets["test"], method="matmul"))


def gan_leaks(
    test: Any, synthetic: Any, *, embed: Embed = None, embed_dim: int | None = None
) -> np.ndarray:
    """GAN-Leaks 0 (Chen et al. 2019, full black-box): ``-min_j |x - g_j|^2`` over synthetic g.

    The published code returns ``exp(-min_j |x - g_j|^2)``; this is its logarithm.
    """
    sets = _prepare(test, synthetic, None, embed=embed, embed_dim=embed_dim)
    return to_numpy(-_SquaredDistances(sets["test"], sets["synthetic"]).min())


def gan_leaks_cal(
    test: Any,
    synthetic: Any,
    reference: Any,
    *,
    embed: Embed = None,
    embed_dim: int | None = None,
) -> np.ndarray:
    """Calibrated GAN-Leaks: ``-min_j |x - g_j|^2 + min_k |x - r_k|^2``.

    The GAN-Leaks score minus the same score against the reference records (the published code
    returns the exponential of this). Chen et al. draw the reference records from a reference
    generator; the published DOMIAS pipeline passes records generated by a CTGAN. This function
    only needs the records: pass whichever the experiment calls for (e.g. the reference set).
    """
    sets = _prepare(test, synthetic, reference, embed=embed, embed_dim=embed_dim)
    x = sets["test"]
    d_g = _SquaredDistances(x, sets["synthetic"]).min()
    d_r = _SquaredDistances(x, sets["reference"]).min()
    return to_numpy(d_r - d_g)


def monte_carlo(
    test: Any, synthetic: Any, *, embed: Embed = None, embed_dim: int | None = None
) -> np.ndarray:
    """MC (Hilprecht et al. 2019): the fraction of synthetic records in an eps-ball around x.

    Precisely, with squared Euclidean distances d(x, g) = |x - g|^2 (as the published code):

        eps      = median over the test records x of min_j d(x, g_j)   (median heuristic,
                   Hilprecht et al. Eq. 4; numpy's median: mean of the two middle values)
        score(x) = #{j : d(x, g_j) < eps} / n_synthetic                  (strict inequality)

    So roughly half the test records (those whose nearest synthetic record is at least eps away)
    score 0. The threshold depends on the whole test set: scores of one call are comparable with
    each other, not across calls.
    """
    sets = _prepare(test, synthetic, None, embed=embed, embed_dim=embed_dim)
    _, counts = _SquaredDistances(sets["test"], sets["synthetic"]).mc_counts()
    return to_numpy(counts.to(torch.float64) / sets["synthetic"].shape[0])


def _init_linear(
    fan_in: int, fan_out: int, gen: torch.Generator, device: torch.device
) -> list[torch.Tensor]:
    """torch.nn.Linear's default initialization (U(-1/sqrt(fan_in), 1/sqrt(fan_in))), drawn from
    ``gen`` on the CPU so the result does not depend on the device."""
    bound = 1.0 / fan_in**0.5
    w = (torch.rand(fan_out, fan_in, generator=gen) * 2 - 1) * bound
    b = (torch.rand(fan_out, generator=gen) * 2 - 1) * bound
    return [w.to(device).requires_grad_(), b.to(device).requires_grad_()]


def _mlp(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x
    for k in range(0, len(params) - 2, 2):
        h = torch.relu(torch.nn.functional.linear(h, params[k], params[k + 1]))
    return torch.nn.functional.linear(h, params[-2], params[-1]).squeeze(1)


def logan_d1(
    test: Any,
    synthetic: Any,
    reference: Any,
    *,
    epochs: int = 15,
    seed: int = 0,
    hidden: int = 256,
    batch_size: int = 256,
    lr: float = 1e-3,
    embed: Embed = None,
    embed_dim: int | None = None,
) -> np.ndarray:
    """LOGAN D1 (Hayes et al. 2019, discriminative setting 1): a classifier trained to tell
    synthetic records (label 1) from reference records (label 0); score = its logit on x.

    As the published code's ``LOGAN_D1``: ``num = min(n_synthetic, n_reference)``, the first
    ``num`` records of each set; an MLP ``d -> hidden -> hidden -> out`` with ReLU and
    ``torch.nn.Linear``'s default initialization; Adam (``lr`` 1e-3), batches of 256. Differences,
    none of which changes what is learned: one output logit with a logistic loss instead of two
    softmax outputs (the same model: the logit is the log-odds of "synthetic"); ``epochs`` passes
    over the 2 * num records in a shuffled order instead of ``300 * n_test / 256`` batches drawn
    with replacement (the default 15 epochs equals that count for the paper's n_test = 1000 and
    num = 10000; the published draw, ``np.random.choice(num, 256)``, only reaches the first num
    rows — all synthetic — so its classifier never sees a reference record, a slip this version
    does not copy); inputs standardized by the training records' mean and standard deviation (an
    affine map the first layer could absorb; it only conditions the optimization).

    Initialization and batch order draw from a local ``torch.Generator`` seeded with ``seed`` on
    the CPU (so the result does not depend on the device); the global RNGs are never used.
    Training runs in float32 on the test records' device.
    """
    for name, v in (("epochs", epochs), ("hidden", hidden), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not (isinstance(lr, (int, float)) and lr > 0 and np.isfinite(lr)):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    sets = _prepare(test, synthetic, reference, embed=embed, embed_dim=embed_dim)
    x, syn, ref = sets["test"], sets["synthetic"], sets["reference"]
    dev = x.device
    num = min(syn.shape[0], ref.shape[0])
    train = torch.cat([syn[:num], ref[:num]])
    mean, std = train.mean(dim=0), train.std(dim=0, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    train = ((train - mean) / std).to(torch.float32)
    labels = torch.cat([torch.ones(num), torch.zeros(num)]).to(dev)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    d = train.shape[1]
    params = (
        _init_linear(d, hidden, gen, dev)
        + _init_linear(hidden, hidden, gen, dev)
        + _init_linear(hidden, 1, gen, dev)
    )
    opt = torch.optim.Adam(params, lr=lr)
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
    n_train = train.shape[0]
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(n_train, generator=gen).to(dev)
            for s in range(0, n_train, batch_size):
                idx = order[s : s + batch_size]
                loss = loss_fn(_mlp(params, train[idx]), labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    with torch.no_grad():
        xs = ((x - mean) / std).to(torch.float32)
        logits = torch.cat([_mlp(params, xs[s : s + 65536]) for s in range(0, xs.shape[0], 65536)])
    return to_numpy(logits.to(torch.float64))
