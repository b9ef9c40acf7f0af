"""Stage 2 of the estimators: smooth. Per-record probability masses of binned counts, smoothed
on the grid in one FFT pass per check: an average shifted histogram (the histogram method's
rule) or a Gaussian KDE (the KDE method's rule, and U_N), with a robust scale for the rules."""

from __future__ import annotations

import math

import numpy as np
import torch

from privmon.estimators.density import bandwidth_factor
from privmon.estimators.methods import EstimatorMethod
from privmon.estimators.record_binning import ClassCounts
from privmon.estimators.selections import GridSelections
from privmon.estimators.tensors import small_tensor

__all__ = ["ash_smooth", "kde_grid_too_coarse", "kde_smooth", "smooth_raw", "smooth_selections"]


def _convolve(grid: torch.Tensor, kernels: torch.Tensor, bins: tuple[int, ...], extended: int):
    """Convolve rows of grid counts (R, cells) with per-row kernels (R, *k) by FFT, all rows in
    one transform. The first ``extended`` rows keep the full support (grid + kernel tails, for
    quadrature) and come back as (extended, cells_out); the rest are cropped to the grid and
    come back as (R − extended, cells)."""
    r, d = grid.shape[0], len(bins)
    ksize = kernels.shape[1:]
    full = tuple(b + k - 1 for b, k in zip(bins, ksize, strict=True))
    size = tuple(_fft_size(n) for n in full)  # zero-padded past `full`: still linear
    dims = tuple(range(1, d + 1))
    f = torch.fft.rfftn(grid.reshape(r, *bins), s=size, dim=dims)
    f *= torch.fft.rfftn(kernels, s=size, dim=dims)
    out = torch.fft.irfftn(f, s=size, dim=dims)
    ext, crop = out[:extended], out[extended:]
    for axis, (b, k, n) in enumerate(zip(bins, ksize, full, strict=True), start=1):
        ext = ext.narrow(axis, 0, n)
        crop = crop.narrow(axis, (k - 1) // 2, b)
    return ext.flatten(1), crop.flatten(1)


def _fft_size(n: int) -> int:
    """The smallest 2^a·3^b·5^c >= n: FFT lengths with a large prime factor (2684 = 4·11·61)
    run several times slower."""
    best = 1 << max(n - 1, 0).bit_length()
    p3 = 1
    while p3 < best:
        p35 = p3
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 5
        p3 *= 3
    return best


def _inverse(cov: torch.Tensor) -> torch.Tensor:
    """Inverse of a batch of (d, d) matrices; closed form in 1-2 dimensions (the grid path),
    where a LAPACK call per check costs more than the arithmetic."""
    d = cov.shape[-1]
    if d == 1:
        return 1.0 / cov
    if d == 2:
        a, b, c, e = cov[..., 0, 0], cov[..., 0, 1], cov[..., 1, 0], cov[..., 1, 1]
        adj = torch.stack([torch.stack([e, -b], -1), torch.stack([-c, a], -1)], -2)
        return adj / (a * e - b * c)[..., None, None]
    return torch.linalg.inv(cov)


def _determinant(cov: torch.Tensor) -> torch.Tensor:
    """Determinant of a batch of (d, d) matrices; closed form in 1-2 dimensions (see
    :func:`_inverse`)."""
    d = cov.shape[-1]
    if d == 1:
        return cov[..., 0, 0]
    if d == 2:
        return cov[..., 0, 0] * cov[..., 1, 1] - cov[..., 0, 1] * cov[..., 1, 0]
    return torch.linalg.det(cov)


def _gaussian_kernels(cov: torch.Tensor, width: torch.Tensor, bins: tuple[int, ...]):
    """Gaussian kernels with covariances (R, d, d) on the grid lattice, each cut at 4 of its own
    standard deviations per axis (so a row's kernel does not depend on the other rows') and
    summing to 1. The lattice spans the widest row's cut."""
    d = width.numel()
    sd = torch.sqrt(torch.diagonal(cov, dim1=1, dim2=2))  # (R, d)
    cut = torch.minimum(
        torch.ceil(4 * sd / width), 4 * torch.tensor(bins, dtype=sd.dtype, device=sd.device)
    )  # (R, d) lattice steps
    half = [int(h) for h in cut.amax(dim=0).tolist()]
    steps = [torch.arange(-h, h + 1, device=cov.device, dtype=cov.dtype) for h in half]
    lattice = torch.stack(torch.meshgrid(*steps, indexing="ij"), dim=-1).reshape(-1, d)
    inside = (lattice.abs().unsqueeze(0) <= cut.unsqueeze(1)).all(dim=-1)  # (R, points)
    lattice = lattice * width
    prec = _inverse(cov)
    logk = -0.5 * (torch.matmul(lattice, prec) * lattice).sum(-1)  # (R, lattice points)
    k = torch.exp(logk - logk.amax(dim=1, keepdim=True)) * inside
    k = k / k.sum(dim=1, keepdim=True)
    return k.reshape(cov.shape[0], *[2 * h + 1 for h in half])


def _gaussian_spectra(variances: torch.Tensor, size: int) -> torch.Tensor:
    """Real FFT (length ``size``) of zero-phase sampled Gaussian kernels with the given
    variances (R,) in squared cells, each summing to 1, untruncated. By Poisson summation the
    DFT of the sampled Gaussian is S(ω) / S(0) with S(ω) = Σ_m exp(−v (ω + 2πm)² / 2); alias
    terms m are kept while they can reach e^-36 of the total (none beyond m = 0 once v > 7).
    Frequencies where every row's spectrum has underflowed to 0 are not evaluated."""
    v = variances.reshape(-1, 1)
    v_min = float(variances.min())
    most = max(0, math.ceil((math.sqrt(72.0 / v_min) / math.pi - 1) / 2))
    step = 2 * math.pi / size
    n_freq = size // 2 + 1
    if most == 0:  # exp(-v ω² / 2) underflows (< e^-745) beyond ω = sqrt(1490 / v)
        n_freq = min(n_freq, math.ceil(math.sqrt(1490.0 / v_min) / step) + 1)
    omega = torch.arange(n_freq, dtype=v.dtype, device=v.device) * step
    if most == 0:  # no alias term reaches e^-36: S(ω) / S(0) = exp(-v ω² / 2)
        spectra = torch.exp(-0.5 * v * omega**2)
    else:
        m = 2 * math.pi * torch.arange(-most, most + 1, dtype=v.dtype, device=v.device)
        s = torch.exp(-0.5 * v[..., None] * (omega[:, None] + m) ** 2).sum(dim=-1)
        spectra = s / torch.exp(-0.5 * v * m**2).sum(dim=-1, keepdim=True)
    return torch.nn.functional.pad(spectra, (0, size // 2 + 1 - n_freq))


def _gaussian_smooth_1d(counts: torch.Tensor, variances: torch.Tensor, cells: int, extended: int):
    """Rows of 1-D cell counts (R, cells) convolved with the sampled Gaussian kernels of
    ``variances`` (R,) (squared cells), untruncated: one FFT each way with the kernels' exact
    spectra (:func:`_gaussian_spectra`), no kernel arrays. The grid is padded by 6 standard
    deviations of the widest kernel on each side (at most 4 grids), so the tails that wrap around
    the FFT's circle carry < 1e-8 of a row's mass. The first ``extended`` rows come back on the
    whole circle (U_N's quadrature), the others cropped to the grid."""
    widest = float(variances.max())
    if math.isnan(widest):  # a class of one record has no spread to scale a kernel by
        raise ValueError("a KDE needs at least 2 records in each class to set its bandwidth")
    if not math.isfinite(widest):  # σ over ~1e154 cells: a score that far beyond the others
        raise ValueError(
            "a KDE kernel is wider than float64 can express in cells of the grid (a score "
            "~1e154 times the others' spread away); the KDE cannot be evaluated on this grid"
        )
    pad = min(math.ceil(6.0 * math.sqrt(widest)), 4 * cells)
    size = _fft_size(cells + 2 * pad)
    f = torch.fft.rfft(counts, n=size)
    torch.view_as_real(f).mul_(_gaussian_spectra(variances, size).unsqueeze(-1))  # real × complex
    out = torch.fft.irfft(f, n=size)
    return out[:extended], out[extended:, :cells]


def _ash_kernels(sigma: torch.Tensor, n: torch.Tensor, width: torch.Tensor):
    """Average-shifted-histogram weights: triangle (m − |j|) over m bins per dimension, where
    m·width ≈ Scott's bin width 3.5·σ·n^(−1/(2+d)). sigma (R, d), n (R,)."""
    r, d = sigma.shape
    h = 3.5 * sigma * n.clamp_min(2)[:, None] ** (-1.0 / (2 + d))
    m = torch.clamp(torch.round(h / width), min=1).to(torch.int64)  # (R, d)
    mmax = [int(v) for v in m.amax(dim=0).tolist()]
    out = None
    for k in range(d):
        j = torch.arange(-(mmax[k] - 1), mmax[k], device=sigma.device, dtype=sigma.dtype)
        mk = m[:, k : k + 1].to(sigma.dtype)
        # the triangle sums to m² exactly: normalised per axis, the product sums to 1
        tri = (mk - j.abs()).clamp_min(0) / mk**2  # (R, L)
        shape = [r] + [1] * d
        shape[k + 1] = tri.shape[1]
        out = tri.reshape(shape) if out is None else out * tri.reshape(shape)
    return out


def _iqr_from_counts(counts: torch.Tensor, bins: tuple[int, ...], width: torch.Tensor):
    """Interquartile range per row and axis from cell counts (R, cells), to one cell's width."""
    grid = counts.reshape(counts.shape[0], *bins)
    levels = small_tensor((0.25, 0.75), np.float64, counts.device)
    out = []
    for axis in range(len(bins)):
        other = [a for a in range(1, len(bins) + 1) if a != axis + 1]
        marginal = grid.sum(dim=other) if other else grid
        cum = marginal.cumsum(dim=1)
        # the cells holding the quartiles (both 0 for an empty row)
        out.append(torch.searchsorted(cum, cum[:, -1:] * levels).diff(dim=1))
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).to(counts.dtype) * width


def _bandwidth_factors(bandwidth, ns: torch.Tensor, d: int, *, like: torch.Tensor):
    """KDE bandwidth factor of each row (record counts ``ns``, floored at 2), as a tensor on the
    device and dtype of ``like``."""
    factors = [bandwidth_factor(bandwidth, n=max(n, 2.0), d=d) for n in ns.tolist()]
    return small_tensor(factors, np.float64, like.device).to(like.dtype)


def _robust_scale(bins, width: torch.Tensor, counts: torch.Tensor, covs, extended: int):
    """Each row's σ per axis and the scale its kernel reads: the rule's rows a robust scale
    (Silverman): min(σ, IQR/1.349) per axis, so a few far-out scores do not blur the bulk
    where the records are; the first ``extended`` rows (U_N's) keep σ."""
    sd = torch.sqrt(torch.diagonal(covs, dim1=1, dim2=2).clamp_min(0))  # (R, d)
    rule_sd = sd[extended:] if extended else sd
    iqr = _iqr_from_counts(counts[extended:] if extended else counts, bins, width)
    robust = torch.where(iqr > 0, torch.minimum(rule_sd, iqr / 1.349), rule_sd)
    if extended:
        robust = torch.cat([sd[:extended], robust])
    return sd, robust


def kde_smooth(
    bins: tuple[int, ...], width: torch.Tensor, counts: torch.Tensor, ns, covs, *, bandwidth,
    extended: int,
):  # fmt: skip
    """Gaussian-KDE masses per cell for rows of counts (R, cells) on a grid of ``bins`` cells of
    ``width`` per dimension, in one FFT pass. The first ``extended`` rows are U_N's KDEs, on the
    extended grid; the others are the rule's densities, cropped to the grid, with a robust
    scale. Returns (extended rows, cropped rows)."""
    d = len(bins)
    sd, robust = _robust_scale(bins, width, counts, covs, extended)
    masses = counts / ns.clamp_min(1)[:, None]  # per record
    factors = _bandwidth_factors(bandwidth, ns, d, like=covs)
    if d == 1:  # kernel variances in squared cells, with the ridge (width / 4)²
        variances = (robust[:, 0] * factors / width[0]) ** 2 + 0.0625
        ext, crop = _gaussian_smooth_1d(masses, variances, bins[0], extended)
    else:  # the covariances rescaled to the robust σ, correlations kept
        scale = (torch.where(sd > 0, robust / sd, 1.0) * factors[:, None]).unsqueeze(-1)
        ridge = torch.diag_embed((width / 4) ** 2)
        kernels = _gaussian_kernels(covs * scale * scale.transpose(1, 2) + ridge, width, bins)
        ext, crop = _convolve(masses, kernels, bins, extended)
    return ext.clamp_min(0), crop.clamp_min(0)


def ash_smooth(
    bins: tuple[int, ...], width: torch.Tensor, counts: torch.Tensor, ns, covs, *, extended: int
):
    """Average-shifted-histogram masses per cell (:func:`kde_smooth`'s rows and returns)."""
    _, robust = _robust_scale(bins, width, counts, covs, extended)
    masses = counts / ns.clamp_min(1)[:, None]  # per record
    ext, crop = _convolve(masses, _ash_kernels(robust + width / 4, ns, width), bins, extended)
    return ext.clamp_min(0), crop.clamp_min(0)


def kde_grid_too_coarse(
    ns: torch.Tensor, covs: torch.Tensor, width: torch.Tensor, bandwidth: str | float
) -> bool:
    """True when a class's KDE bandwidth is below one grid cell (heavy-tailed or very
    concentrated scores): the binned KDE would then act as a fine histogram and over-report, so
    the exact KDE path is used instead — when both classes have at least 2 records and
    non-singular covariances (``ns`` (2,), ``covs`` (2, d, d); ``width`` the cell width over
    the pooled data range, (d,))."""
    d = covs.shape[-1]
    parts = [ns, _determinant(covs), torch.diagonal(covs, dim1=1, dim2=2), width]
    figures = torch.cat([t.reshape(-1) for t in parts]).tolist()  # one transfer
    n, dets, variances, widths = figures[:2], figures[2:4], figures[4 : 4 + 2 * d], figures[-d:]
    if min(n) < 2 or min(dets) <= 0:
        return False
    return any(
        bandwidth_factor(bandwidth, n=n[c], d=d) * math.sqrt(variances[c * d + a]) < widths[a]
        for c in range(2)
        for a in range(d)
    )


def smooth_selections(
    grid: GridSelections, method: EstimatorMethod, *, bandwidth, extended: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rules' smoothed densities (``method.smooth``) of one grid method's fold selections,
    (2, K + C, cells):
    the complement of each fold (the cross-fitted rules), then the folds each of the C
    certificates' rules learns on (on that certificate's coordinates). With ``extended``, also
    the classes' full-data KDEs on the extended grid (U_N's rows, (2, cells')); else that first
    value is empty."""
    k = grid.folds
    counts, ns, covs = grid.selected
    # the cross-fitted rules' selections (and U_N's) in one pass, each certificate's rule's in
    # a pass of its own: a pass's padding follows its widest kernel, so the cross-fitted
    # densities (the value, the per-record risks) and U_N do not depend on the certificates'
    # training folds, nor one certificate's rule on another's
    rows = counts[:, 1:].reshape(2 * k, -1)
    row_ns = ns[:, 1:].reshape(-1)
    row_covs = covs[:, 1:].flatten(0, 1)
    n_extended = 2 if extended else 0
    if extended:  # U_N needs the full-data KDEs on the extended grid: two more rows
        rows = torch.cat([counts[:, 0], rows])
        row_ns = torch.cat([ns[:, 0], row_ns])
        row_covs = torch.cat([covs[:, 0], row_covs])
    plug_rows, mass = method.smooth(
        grid.bins, grid.width, rows, row_ns, row_covs, bandwidth=bandwidth, extended=n_extended
    )
    masses = [mass.reshape(2, k, -1)]
    for cells in grid.certificates:  # each on its own: a function of its own rule's records
        train_counts, train_ns, train_covs = (t[:, 1] for t in cells.selected)
        masses.append(
            method.smooth(
                grid.bins,
                cells.width,
                train_counts,
                train_ns,
                train_covs,
                bandwidth=bandwidth,
                extended=0,
            )[1].unsqueeze(1)
        )
    return plug_rows, torch.cat(masses, dim=1)


def smooth_raw(raw: ClassCounts, bandwidth) -> torch.Tensor | None:
    """U_N's KDEs of 1-D scores on their own scale (the classes' rows on the extended raw grid),
    or None when a class's bandwidth is below a cell of that grid (heavy-tailed scores: U_N then
    takes exact kernel sums, :func:`privmon.estimators.plugins.sampled_kde_plugin`)."""
    if kde_grid_too_coarse(raw.n, raw.cov, raw.extent / raw.bins[0], bandwidth):
        return None
    return kde_smooth(
        raw.bins, raw.width, raw.counts, raw.n, raw.cov, bandwidth=bandwidth, extended=2
    )[0]
