"""Gaussian kernel density estimation in torch, on the data's device.

The bandwidth convention is scipy.stats.gaussian_kde's: the kernel covariance is the data covariance
(unbiased, ``ddof=1``) times ``factor**2``, with Scott's factor ``n**(-1/(d+4))`` or Silverman's
``(n*(d+2)/4)**(-1/(d+4))``; a number is used as the factor itself. With ``bandwidth="scott"`` the
log density equals ``scipy.stats.gaussian_kde(data.T).logpdf(points.T)``.

:class:`MixedKDE` is the product kernel of mixed-type records (Li & Racine): that Gaussian kernel
on the numeric columns times an Aitchison–Aitken kernel on each categorical column.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "BLOCK_ELEMENTS_CPU",
    "BLOCK_ELEMENTS_DEVICE",
    "GaussianKDE",
    "MixedKDE",
    "bandwidth_factor",
]

# Points per block times data points for method="matmul": ~1 MiB of float64 on a CPU (fits L2,
# measured fastest for n = 10^4, d = 8), larger on an accelerator.
BLOCK_ELEMENTS_CPU = 1 << 17
BLOCK_ELEMENTS_DEVICE = 1 << 24
# Kernel sums below this are recomputed with a max-shifted log-sum-exp (see _log_density_matmul).
_TINY_KERNEL_SUM = 1e-250


def bandwidth_factor(bandwidth: str | float, *, n: float, d: int) -> float:
    """scipy's bandwidth factor: Scott ``n**(-1/(d+4))``, Silverman ``(n(d+2)/4)**(-1/(d+4))``."""
    if isinstance(bandwidth, str):
        if bandwidth == "scott":
            return float(n) ** (-1.0 / (d + 4))
        if bandwidth == "silverman":
            return (float(n) * (d + 2) / 4.0) ** (-1.0 / (d + 4))
        raise ValueError(
            f"bandwidth must be 'scott', 'silverman' or a positive number, got {bandwidth!r}"
        )
    b = float(bandwidth)
    if not (b > 0 and math.isfinite(b)):
        raise ValueError(
            f"bandwidth must be 'scott', 'silverman' or a positive number, got {bandwidth!r}"
        )
    return b


def _exp_row_sums(xa: torch.Tensor, aug_t: torch.Tensor) -> torch.Tensor:
    """``exp(xa @ aug_t).sum(dim=1)`` in cache-sized blocks of rows, one buffer, in place."""
    m, n = xa.shape[0], aug_t.shape[1]
    budget = BLOCK_ELEMENTS_CPU if xa.device.type == "cpu" else BLOCK_ELEMENTS_DEVICE
    rows = max(1, min(m, budget // max(n, 1)))
    buf = torch.empty(rows, n, dtype=xa.dtype, device=xa.device)
    sums = torch.empty(m, dtype=xa.dtype, device=xa.device)
    for s in range(0, m, rows):
        b = buf[: min(rows, m - s)]
        torch.mm(xa[s : s + rows], aug_t, out=b)
        torch.sum(b.exp_(), dim=1, out=sums[s : s + rows])
    return sums


def _kernel_covariance(cov: torch.Tensor, factor: float, ridge: Any = 0.0) -> torch.Tensor:
    """``cov * factor**2`` plus ``ridge`` on the diagonal, refused when singular (ValueError)."""
    d = cov.shape[0]
    ridge_t = torch.as_tensor(ridge, dtype=cov.dtype, device=cov.device)
    covariance = cov * factor**2 + torch.diag_embed(ridge_t.expand(d))
    # Rounding can leave a ~1e-17 pivot on collinear data, which Cholesky accepts: check the
    # conditioning of the correlation matrix instead (unit-free, so axes on very different
    # scales pass; scipy rejects the collinear inputs too).
    var = torch.diagonal(covariance)
    scale = torch.sqrt(var.clamp_min(torch.finfo(cov.dtype).tiny))
    corr = covariance / (scale[:, None] * scale[None, :])
    if not bool((var > 0).all()) or not bool(torch.linalg.eigvalsh(corr)[0] > 1e-10):
        raise ValueError(
            "the data covariance is singular (constant or collinear scores); "
            "a Gaussian KDE needs a non-singular covariance"
        )
    return covariance


class GaussianKDE:
    """Exact Gaussian KDE with full covariance (scipy convention), evaluated in chunks.

    ``data`` is a float tensor of shape (n, d). Memory per evaluation is bounded by ``chunk``
    points times n kernel terms; the log-sum-exp keeps far-away points finite (no log 0).

    Examples:
        >>> import torch
        >>> from scipy.stats import gaussian_kde
        >>> from privmon.estimators import GaussianKDE
        >>> gen = torch.Generator().manual_seed(0)
        >>> data = torch.randn(500, 2, generator=gen, dtype=torch.float64)
        >>> points = torch.zeros(3, 2, dtype=torch.float64)
        >>> log_p = GaussianKDE(data).log_density(points)
        >>> log_p.shape, round(log_p[0].exp().item(), 3)
        (torch.Size([3]), 0.152)
        >>> reference = gaussian_kde(data.T.numpy()).logpdf(points.T.numpy())
        >>> bool(torch.allclose(log_p, torch.from_numpy(reference)))
        True
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        bandwidth: str | float = "scott",
        chunk: int = 2048,
        ridge: torch.Tensor | float = 0.0,
        robust: bool = False,
    ):
        """``ridge``: variance added to the kernel covariance's diagonal (0 = scipy's KDE).
        A positive ridge lets degenerate data (point masses, collinear scores) have a KDE.
        ``robust``: scale each axis by min(σ, IQR/1.349)/σ (Silverman), so a few far-out points
        do not widen the kernel for the bulk (not scipy's convention)."""
        if data.ndim != 2 or data.shape[0] < 2:
            raise ValueError("data must have shape (n, d) with n >= 2 for a KDE")
        self.data = data
        n, d = data.shape
        self.n, self.d = n, d
        self.factor = bandwidth_factor(bandwidth, n=n, d=d)
        cov = torch.cov(data.T).reshape(d, d)
        if robust:
            sd = torch.sqrt(torch.diagonal(cov))
            q = torch.quantile(
                data, torch.tensor([0.25, 0.75], dtype=data.dtype, device=data.device), dim=0
            )
            iqr = q[1] - q[0]
            rob = torch.where(iqr > 0, torch.minimum(sd, iqr / 1.349), sd)
            scale = torch.where(sd > 0, rob / sd.clamp_min(1e-300), torch.ones_like(sd))
            cov = cov * scale[:, None] * scale[None, :]
        self.covariance = _kernel_covariance(cov, self.factor, ridge)
        chol = torch.linalg.cholesky(self.covariance)
        self._chol = chol
        # Whitened data: the kernel becomes isotropic, so distances are plain squared norms.
        self._white = torch.linalg.solve_triangular(chol, data.T, upper=False).T
        log_det = 2.0 * torch.log(torch.diagonal(chol)).sum()
        self._log_norm = -0.5 * (d * math.log(2 * math.pi) + log_det) - math.log(n)
        self.chunk = chunk
        self._aug_t: torch.Tensor | None = None  # built on the first matmul evaluation

    def log_density(self, points: torch.Tensor, *, method: str = "cdist") -> torch.Tensor:
        """log p̂(x) for points of shape (m, d); shape (m,).

        ``method="cdist"`` (default): chunked ``torch.cdist`` and ``torch.logsumexp``.
        ``method="matmul"``: the same values (to ~1e-12) several times faster; see
        :meth:`_log_density_matmul`.
        """
        if method == "matmul":
            return self._log_density_matmul(points)
        if method != "cdist":
            raise ValueError(f"method must be 'cdist' or 'matmul', got {method!r}")
        w = torch.linalg.solve_triangular(self._chol, points.to(self.data).T, upper=False).T
        out = torch.empty(points.shape[0], dtype=self.data.dtype, device=self.data.device)
        for s in range(0, points.shape[0], self.chunk):
            d2 = torch.cdist(w[s : s + self.chunk], self._white).square_()
            out[s : s + self.chunk] = torch.logsumexp(d2.mul_(-0.5), dim=1)
        return out + self._log_norm

    def _log_density_matmul(self, points: torch.Tensor) -> torch.Tensor:
        """log p̂(x) with one matrix product per block of points and no log-sum-exp pass.

        In whitened, centred coordinates the kernel exponent is
        ``-|x - y|^2 / 2 = [x, -|x|^2/2, 1] . [y, 1, -|y|^2/2]``, an inner product in d + 2
        dimensions, so one ``torch.mm`` per block gives every exponent, ``exp_`` runs in place on
        a cache-sized buffer and a row sum gives the kernel sum S(x). The exponents are <= 0 (up
        to rounding), so nothing overflows; where S(x) < 1e-250 (a point so far from the data that
        terms underflow or turn subnormal) the row is recomputed with the max-shifted
        log-sum-exp of :meth:`log_density`, so far-away points keep full precision and are never
        ``-inf``. Above 1e-250, terms lost to underflow are < 1e-58 of S(x). Rounding of the
        expansion is ~1e-16 times the centred squared norms, the same as ``torch.cdist``'s own
        matrix-product path.
        """
        if self._aug_t is None:
            self._center = self._white.mean(dim=0)
            y = self._white - self._center
            self._aug_t = torch.cat(
                [y, torch.ones_like(y[:, :1]), -0.5 * y.square().sum(dim=1, keepdim=True)], dim=1
            ).T.contiguous()
        pts = points.to(self.data)
        x = torch.linalg.solve_triangular(self._chol, pts.T, upper=False).T - self._center
        xa = torch.cat(
            [x, -0.5 * x.square().sum(dim=1, keepdim=True), torch.ones_like(x[:, :1])], dim=1
        )
        sums = _exp_row_sums(xa, self._aug_t)
        far = sums < _TINY_KERNEL_SUM
        out = sums.log_().add_(self._log_norm)
        if bool(far.any()):
            out[far] = self.log_density(pts[far])
        return out

    def density(self, points: torch.Tensor) -> torch.Tensor:
        """The KDE's density at ``points`` (exp of :meth:`log_density`)."""
        return self.log_density(points).exp()

    def sample(self, m: int, *, generator: torch.Generator) -> torch.Tensor:
        """m draws from the KDE (a random data point plus kernel noise), from ``generator``."""
        dev = self.data.device
        idx = torch.randint(self.n, (m,), generator=generator, device=generator.device).to(dev)
        noise = torch.randn(
            m, self.d, generator=generator, device=generator.device, dtype=self.data.dtype
        ).to(dev)
        return self.data[idx] + noise @ self._chol.T


class MixedKDE:
    """Product-kernel KDE of mixed-type records: numeric columns first, then category codes.

    The kernel of records x, y is ``N(x_num - y_num; 0, H) * prod_l K_l(x_l, y_l)``: a Gaussian
    on the q numeric columns with :class:`GaussianKDE`'s bandwidth matrix H (the columns'
    covariance, or ``covariance``, times ``factor**2``; scipy's convention) and, on each
    categorical column l with ``levels[l]`` = c levels (codes 0 … c − 1), the Aitchison–Aitken
    kernel ``K_l = 1 - λ_l`` where the codes are equal and ``λ_l / (c - 1)`` where they are not,
    as statsmodels' ``KDEMultivariate`` (var_type ``"u"``). Each record spreads the share λ of
    its mass evenly over the other levels, so a level absent from the data keeps a positive
    density. With no categorical column it equals :class:`GaussianKDE`; with no numeric column
    it is the product of the categorical kernels alone. Evaluation is one matrix product per
    block of points: the categorical factor is ``exp(sum_l w_l [x_l = y_l])`` up to a constant,
    ``w_l = log((1 - λ_l)(c - 1) / λ_l)``, an inner product of one-hot codes.

    Args:
        data: (n, q + k) float tensor, the q numeric columns then the k category codes
            (integers in [0, levels[l])).
        levels: the number of levels of each categorical column (k entries, each >= 2).
        bandwidth: ``"scott"``, ``"silverman"`` or the factor itself, for q dimensions.
        category_bandwidth: λ, one number or one per categorical column, each in
            (0, (c − 1)/c] ((c − 1)/c: the uniform kernel); default ``min(factor**2, (c − 1)/c)``
            (the rates of Li & Racine: h ~ n^(-1/(q+4)), λ ~ n^(-2/(q+4))).
        covariance: (q, q) matrix (tensor or array) that stands in for the numeric columns'
            covariance.

    Examples:
        >>> import torch
        >>> from privmon.estimators import MixedKDE
        >>> gen = torch.Generator().manual_seed(0)
        >>> numbers = torch.randn(400, 1, generator=gen, dtype=torch.float64)
        >>> codes = (numbers > 0).to(torch.float64)  # a category that follows the number
        >>> kde = MixedKDE(torch.cat([numbers, codes], dim=1), levels=(2,))
        >>> kde.category_bandwidth
        (0.0910...,)
        >>> p = kde.log_density(torch.tensor([[1.0, 1.0], [1.0, 0.0]])).exp()
        >>> bool(p[0] > 5 * p[1])  # the level seen with positive numbers is the likely one
        True
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        levels: Sequence[int],
        bandwidth: str | float = "scott",
        category_bandwidth: float | Sequence[float] | None = None,
        covariance: torch.Tensor | None = None,
    ) -> None:
        self.levels = tuple(int(c) for c in levels)
        k = len(self.levels)
        if data.ndim != 2 or data.shape[1] < max(k, 1) or data.shape[0] < 1:
            raise ValueError(
                f"data must have shape (n, q + {k}) with n >= 1 (q numeric columns, then {k} "
                f"category codes), got {tuple(data.shape)}"
            )
        if any(c < 2 for c in self.levels):
            raise ValueError(f"levels must each be >= 2, got {self.levels}")
        self.data, self.n = data, data.shape[0]
        self.q = q = data.shape[1] - k
        dev, dtype = data.device, data.dtype
        self.factor = bandwidth_factor(bandwidth, n=self.n, d=q)
        codes = data[:, q:]
        limits = torch.tensor(self.levels, dtype=dtype, device=dev)
        if k and not bool(((codes == codes.round()) & (codes >= 0) & (codes < limits)).all()):
            raise ValueError("data's category codes must be integers in [0, levels) per column")
        self.category_bandwidth = self._lambdas(category_bandwidth)
        lam = torch.tensor(self.category_bandwidth, dtype=dtype, device=dev)
        c = limits
        self._weights = torch.log((1 - lam) * (c - 1) / lam)  # >= 0: lam <= (c - 1) / c
        sizes = torch.tensor(self.levels, dtype=torch.long, device=dev)
        self._offsets = sizes.cumsum(0) - sizes  # where each column's one-hot block starts
        self._slot_weights = torch.repeat_interleave(self._weights, sizes)
        log_norm = float(torch.log(lam / (c - 1)).sum()) - math.log(self.n)
        self._max_match = float(self._weights.sum())
        if q:
            cov = _numeric_covariance(data[:, :q], covariance)
            self.covariance = _kernel_covariance(cov, self.factor)
            self._chol = torch.linalg.cholesky(self.covariance)
            log_norm -= 0.5 * q * math.log(2 * math.pi)
            log_norm -= float(torch.log(torch.diagonal(self._chol)).sum())
            white = torch.linalg.solve_triangular(self._chol, data[:, :q].T, upper=False).T
            self._center = white.mean(dim=0)
            self._white = white - self._center
        else:
            self.covariance = torch.zeros(0, 0, dtype=dtype, device=dev)
            self._white = torch.zeros(self.n, 0, dtype=dtype, device=dev)
        self._log_norm = log_norm
        y = self._white
        self._onehot = self._one_hot(codes)
        self._aug_t = torch.cat(
            [y, y.new_ones(self.n, 1), -0.5 * y.square().sum(dim=1, keepdim=True), self._onehot],
            dim=1,
        ).T.contiguous()

    def _lambdas(self, given: float | Sequence[float] | None) -> tuple[float, ...]:
        most = [(c - 1) / c for c in self.levels]
        if given is None:
            return tuple(min(self.factor**2, m) for m in most)
        # a numpy or torch number or array: Python floats
        raw: Any = given.tolist() if hasattr(given, "tolist") else given
        values: list[Any] = [raw] * len(most) if isinstance(raw, numbers.Real | str) else list(raw)
        if len(values) != len(most):
            raise ValueError(
                f"category_bandwidth must be one number or {len(most)} (one per categorical "
                f"column), got {len(values)}"
            )
        for v, m in zip(values, most, strict=True):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < float(v) <= m:
                raise ValueError(
                    f"category_bandwidth must be in (0, (c - 1)/c] for a column of c levels "
                    f"(here <= {m:.4g}), got {v!r}"
                )
        return tuple(float(v) for v in values)

    def _one_hot(self, codes: torch.Tensor) -> torch.Tensor:
        """(m, sum(levels)) one-hot blocks of the codes, one block per categorical column."""
        out = torch.zeros(
            codes.shape[0], sum(self.levels), dtype=self.data.dtype, device=self.data.device
        )
        if self.levels:
            cols = codes.long() + self._offsets
            out.scatter_(1, cols, 1.0)
        return out

    def log_density(self, points: torch.Tensor, *, method: str = "matmul") -> torch.Tensor:
        """log p̂(x) for points of shape (m, q + k) (codes as in ``data``); shape (m,).

        ``method="matmul"`` (default), as :class:`GaussianKDE`'s: one matrix product per block,
        the exponents shifted by the largest categorical factor so that none is positive; a
        point whose kernel sum still underflows (< 1e-250, far from every record) is recomputed
        with a max-shifted log-sum-exp by direct differences (``method="cdist"``, for every
        point), so it is never ``-inf``."""
        if method not in ("matmul", "cdist"):
            raise ValueError(f"method must be 'cdist' or 'matmul', got {method!r}")
        pts = points.to(self.data)
        q = self.q
        if q:
            x = torch.linalg.solve_triangular(self._chol, pts[:, :q].T, upper=False).T
            x = x - self._center
        else:
            x = pts[:, :0]
        match = self._one_hot(pts[:, q:]) * self._slot_weights
        # [x, -|x|^2/2 - shift, 1, w * onehot(x)] . [y, 1, -|y|^2/2, onehot(y)]
        #   = -|x - y|^2 / 2 + sum_l w_l [x_l = y_l] - shift
        xa = torch.cat(
            [
                x,
                -0.5 * x.square().sum(dim=1, keepdim=True) - self._max_match,
                pts.new_ones(pts.shape[0], 1),
                match,
            ],
            dim=1,
        )
        if method == "matmul":
            sums = _exp_row_sums(xa, self._aug_t)
            far = sums < _TINY_KERNEL_SUM
            out = sums.log_().add_(self._log_norm + self._max_match)
        else:
            far = torch.ones(pts.shape[0], dtype=torch.bool, device=pts.device)
            out = torch.empty(pts.shape[0], dtype=pts.dtype, device=pts.device)
        if bool(far.any()):
            d2 = torch.cdist(x[far], self._white).square_()
            exponent = match[far] @ self._onehot.T - 0.5 * d2
            out[far] = torch.logsumexp(exponent, dim=1) + self._log_norm
        return out


def _numeric_covariance(numbers: torch.Tensor, covariance: torch.Tensor | None) -> torch.Tensor:
    """The (q, q) covariance of a mixed KDE's numeric columns: ``covariance`` as given, or the
    data's (n >= 2, no constant column)."""
    q = numbers.shape[1]
    if covariance is not None:
        return torch.as_tensor(covariance, dtype=numbers.dtype, device=numbers.device).reshape(q, q)
    if numbers.shape[0] < 2:
        raise ValueError("data needs n >= 2 records for a KDE of its numeric columns")
    # A constant column's computed variance is rounding (~1e-33 where its mean does not round
    # back to the constant), which the check below would pass.
    flat = numbers.amax(dim=0) == numbers.amin(dim=0)
    if bool(flat.any()):
        cols = torch.nonzero(flat).flatten().tolist()
        raise ValueError(f"the data covariance is singular: numeric columns {cols} are constant")
    return torch.cov(numbers.T).reshape(q, q)
