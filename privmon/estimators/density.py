"""Gaussian kernel density estimation in torch, on the data's device.

The bandwidth convention is scipy.stats.gaussian_kde's: the kernel covariance is the data covariance
(unbiased, ``ddof=1``) times ``factor**2``, with Scott's factor ``n**(-1/(d+4))`` or Silverman's
``(n*(d+2)/4)**(-1/(d+4))``; a number is used as the factor itself. With ``bandwidth="scott"`` the
log density equals ``scipy.stats.gaussian_kde(data.T).logpdf(points.T)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK_ELEMENTS_CPU", "BLOCK_ELEMENTS_DEVICE", "GaussianKDE", "bandwidth_factor"]

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
        ridge_t = torch.as_tensor(ridge, dtype=data.dtype, device=data.device)
        self.covariance = cov * self.factor**2 + torch.diag_embed(ridge_t.expand(d))
        # Rounding can leave a ~1e-17 pivot on collinear data, which Cholesky accepts: check the
        # conditioning of the correlation matrix instead (unit-free, so axes on very different
        # scales pass; scipy rejects the collinear inputs too).
        var = torch.diagonal(self.covariance)
        scale = torch.sqrt(var.clamp_min(torch.finfo(data.dtype).tiny))
        corr = self.covariance / (scale[:, None] * scale[None, :])
        if not bool((var > 0).all()) or not bool(torch.linalg.eigvalsh(corr)[0] > 1e-10):
            raise ValueError(
                "the data covariance is singular (constant or collinear scores); "
                "a Gaussian KDE needs a non-singular covariance"
            )
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
        m = x.shape[0]
        budget = BLOCK_ELEMENTS_CPU if self.data.device.type == "cpu" else BLOCK_ELEMENTS_DEVICE
        rows = max(1, min(m, budget // self.n))
        buf = torch.empty(rows, self.n, dtype=self.data.dtype, device=self.data.device)
        sums = torch.empty(m, dtype=self.data.dtype, device=self.data.device)
        for s in range(0, m, rows):
            b = buf[: min(rows, m - s)]
            torch.mm(xa[s : s + rows], self._aug_t, out=b)
            torch.sum(b.exp_(), dim=1, out=sums[s : s + rows])
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
