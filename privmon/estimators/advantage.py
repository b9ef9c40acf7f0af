"""Optimal membership advantage (MACE §5): the paper's plug-in estimators, a debiased
cross-fitted estimate, a certified lower bound and the McDiarmid upper interval.

The optimal accuracy advantage at prior p is (MACE eq. 7-8)

    Adv*_p = E_z |f_p(z)| = ∫ |p·P(q) − (1−p)·Q(q)| dq,

P / Q the member / non-member distributions of the query output. It is at least |2p − 1|: the
trivial attack that always guesses the more likely class reaches it without looking at the model.

* ``plugin`` — W_N (Thm 2, histogram, 100 bins per dimension over the data range) or U_N (Thm 3,
  Gaussian KDE; grid quadrature in 1-2 dimensions, importance sampling from the mixture KDE above).
  Plug-ins over-report small leaks: sampling noise never cancels inside |·| (two identical
  distributions with 1,000 + 1,000 samples give W_N ≈ 0.14).
* In 1-D the rules below read the records' pooled ranks scaled into (0, 1) instead of the
  scores: the optimal advantage of a 1-D query is invariant under any strictly monotone
  transform of the score (loss, log-loss, confidence and logit-confidence of one model carry the
  same information), and so are ``value``, ``lower`` and the per-record risks. The plug-ins
  W_N / U_N stay the paper's, on the scores as given (they are not invariant).
* ``value`` — the debiased estimate, by cross-fitting: the records are split in ``folds``; on each
  fold the Bayes rule sign(p·P̂ − (1−p)·Q̂) is learned from the other folds and its accuracy
  advantage 2p·TPR − 2(1−p)·FPR + 1 − 2p is measured on the held-out fold. The learned rule never
  beats the optimal one, so this is nearly unbiased at small leaks and slightly conservative at
  large ones; it is floored at |2p − 1|, which the truth never falls below. The rule's densities
  are smoothed (histogram method: an average shifted histogram over the 100 bins with Scott's bin
  width 3.5·σ·n^(−1/(2+d)); KDE method: the same Gaussian KDE as U_N, Scott's factor).
* ``lower`` — a certified lower confidence bound at level 1 − δ: the rule learned on folds 2..K−1
  is applied to folds 0-1, which it has never seen; exact one-sided Clopper–Pearson bounds at
  level δ/2 on its TPR (lower) and FPR (upper) (Bonferroni across the two) bound the rule's true
  advantage, which bounds the optimal one from below. ``lower_check`` is the same bound at the
  call's ``delta``; the two differ only inside the monitor, which certifies ``lower`` at the
  share of its run-level δ that the check is allotted (:mod:`privmon.estimators.spending`).
* ``upper`` — the paper's plug-in + McDiarmid half-width sqrt(2·(p²/N1 + (1−p)²/N2)·log(2/δ))
  (Thm 2-3 (2); equals sqrt(2/N·log(2/δ)) when N1 = pN). It bounds the plug-in's deviation from
  its own mean, not the plug-in's bias, so it is **not** an upper bound on the advantage: the
  plug-in is biased up, by far more than the half-width above 2-D or on skewed scores. No
  sample-based upper bound on the optimal advantage exists without assumptions; ``upper`` is
  kept only to reproduce MACE.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, cast

import numpy as np
import torch

from privmon._validation import as_scores, check_open_unit
from privmon.estimators.density import GaussianKDE, bandwidth_factor
from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper
from privmon.estimators.learned import learned_rule_counts
from privmon.estimators.streaming import (
    BinnedRecords,
    BinnedScores,
    ClassCounts,
    bin_records,
    fold_of,
    small_tensor,
)

__all__ = [
    "AdvantageEstimate",
    "StreamingAdvantage",
    "advantage_from_state",
    "default_bins",
    "optimal_advantage",
]

Method = Literal["histogram", "kde"]
METHODS = ("histogram", "kde")
CERTIFY_FOLDS = (0, 1)


class Estimate:
    """Shared behaviour of the estimate records: ``float(est)`` is ``est.value``."""

    value: float
    # set by @dataclass on every subclass; declared so that type checkers accept asdict(self)
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def __float__(self) -> float:
        return self.value

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (``dataclasses.asdict``)."""
        return asdict(self)


@dataclass(frozen=True)
class AdvantageEstimate(Estimate):
    """One estimate of the optimal membership advantage (accuracy metric, MACE eq. 7).

    ``value`` debiased point estimate; ``lower`` certified lower bound at level 1 − ``lower_delta``
    (``delta`` in the functional API; a check's share of the run's δ in the monitor, so that it
    holds over the whole run); ``lower_check`` the same certificate at level 1 − ``delta``, valid
    for this one estimate alone; ``plugin`` the paper's W_N / U_N; ``upper`` the paper's
    plugin + ``halfwidth`` (McDiarmid), capped at 1 — a plug-in figure, not a bound on the
    advantage (see the module docstring).
    ``floor`` = |2·prior − 1|, the advantage of always guessing the majority class: at a prior
    other than 0.5 read the figures against it, or use the generalized metrics
    (:func:`privmon.generalized_advantage`, e.g. the AM metric) which do not reward that guess.
    """

    value: float
    lower: float
    upper: float
    plugin: float
    halfwidth: float
    prior: float
    method: str
    delta: float
    lower_check: float
    lower_delta: float
    n_members: int
    n_nonmembers: int
    n_dropped: int
    floor: float


def check_method(method: str) -> Method:
    """``method`` if it is one of "histogram" and "kde", else a ValueError naming them."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return cast(Method, method)


def check_bins(bins: int | None) -> None:
    if bins is not None and (isinstance(bins, bool) or not isinstance(bins, int) or bins < 1):
        raise ValueError(f"bins must be a positive integer or None, got {bins!r}")


def default_bins(method: str, d: int) -> int:
    """100 per dimension for histograms (MACE §9.1); a fine quadrature grid for the KDE (in
    1-D 20 × 100 cells, so one binning pass can serve both, see ``BinnedScores.coarsen``)."""
    if method == "histogram":
        return 100
    return 2000 if d == 1 else 128


def mcdiarmid_halfwidth(prior: float, n1: float, n2: float, delta: float) -> float:
    """sqrt(2·(p²/N1 + (1−p)²/N2)·log(2/δ)): bounded differences 2p/N1, 2(1−p)/N2 (Thm 2 (2))."""
    return math.sqrt(2.0 * (prior**2 / n1 + (1 - prior) ** 2 / n2) * math.log(2.0 / delta))


def accuracy_advantage(tpr, fpr, prior: float):
    """2p·TPR − 2(1−p)·FPR + 1 − 2p: the accuracy advantage 2·P(correct) − 1 of a rule."""
    return 2 * prior * tpr - 2 * (1 - prior) * fpr + 1 - 2 * prior


def _rule(diff: torch.Tensor, tie: torch.Tensor, tol: float | torch.Tensor) -> torch.Tensor:
    """Bayes rule sign(p·P̂ − (1−p)·Q̂) as 1 (member) / 0 / ``tie`` where the two agree (to
    ``tol``); ``tie`` a tensor of diff's dtype (broadcast)."""
    return torch.where(diff.abs() <= tol, tie, diff > 0)


@functools.lru_cache(maxsize=8)
def _ties(k: int, prior: float, device: torch.device) -> torch.Tensor:
    """Tie values (K+1, 1) of the K cross-fitted rules and the certificate's (cached)."""
    return small_tensor([[0.5]] * k + [[float(prior > 0.5)]], np.float64, device)


def certified_advantage(tp, n1: float, fp, n2: float, *, prior: float, delta):
    """Certified advantage of rules with ``tp`` / ``fp`` positives among ``n1`` / ``n2`` held-out
    records (scalars or arrays, one per rule; ``delta`` a scalar or one per rule): the advantage
    2p·TPR − 2(1−p)·FPR + 1 − 2p at the one-sided Clopper–Pearson bounds TPR ≥ Beta⁻¹(δ/2; tp,
    n1 − tp + 1) and FPR ≤ Beta⁻¹(1 − δ/2; fp + 1, n2 − fp), δ split between the two
    (Bonferroni), so it holds with probability ≥ 1 − δ."""
    delta = np.asarray(delta, dtype=np.float64)
    tp, fp = np.asarray(tp, dtype=np.float64), np.asarray(fp, dtype=np.float64)
    tpr_lo = clopper_pearson_lower(tp, n1, delta / 2) if n1 > 0 else np.zeros_like(tp)
    fpr_hi = clopper_pearson_upper(fp, n2, delta / 2) if n2 > 0 else np.ones_like(fp)
    return accuracy_advantage(tpr_lo, fpr_hi, prior)


def _certify(tp, n1: float, fp, n2: float, prior: float, deltas: tuple[float, float]):
    """:func:`certified_advantage` at the run's δ share and at the call's δ: (lower,
    lower_check), arrays with one entry per rule, from one pair of Clopper–Pearson calls."""
    tp, fp = np.atleast_1d(tp), np.atleast_1d(fp)
    if deltas[0] == deltas[1]:
        cert = certified_advantage(tp, n1, fp, n2, prior=prior, delta=deltas[0])
        return cert, cert
    both = certified_advantage(
        np.concatenate([tp, tp]),
        n1,
        np.concatenate([fp, fp]),
        n2,
        prior=prior,
        delta=np.repeat(np.asarray(deltas, dtype=np.float64), tp.size),
    )
    return both[: tp.size], both[tp.size :]


def _finish(
    *, plugin, tp, fp, n1, n2, cert, cert_check, prior, delta, lower_delta, method, n_dropped
) -> AdvantageEstimate:
    floor = abs(2 * prior - 1)
    value = accuracy_advantage(tp / n1, fp / n2, prior)
    halfwidth = mcdiarmid_halfwidth(prior, n1, n2, delta)
    return AdvantageEstimate(
        value=float(min(max(value, floor), 1.0)),
        lower=float(min(max(cert, floor), 1.0)),
        lower_check=float(min(max(cert_check, floor), 1.0)),
        lower_delta=float(lower_delta),
        upper=float(min(plugin + halfwidth, 1.0)),
        # W_N and U_N lie in [|2p − 1|, 1] exactly; only rounding (an ulp) can step outside
        plugin=float(min(max(plugin, floor), 1.0)),
        halfwidth=float(halfwidth),
        prior=prior,
        method=method,
        delta=delta,
        n_members=int(n1),
        n_nonmembers=int(n2),
        n_dropped=int(n_dropped),
        floor=floor,
    )


# -- grid path (1-2 dimensions, streaming) -------------------------------------------------------
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
    pad = min(math.ceil(6.0 * math.sqrt(float(variances.max()))), 4 * cells)
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


def _smooth(
    state: BinnedScores | ClassCounts,
    counts: torch.Tensor,
    ns,
    covs,
    method: str,
    bandwidth,
    extended,
):
    """Smoothed probability masses per cell for rows of counts (R, cells), in one FFT pass.

    The first ``extended`` rows are U_N's KDEs, on the extended grid; the others are the rule's
    densities, cropped to the grid, with a robust scale. Returns (extended rows, cropped rows).
    """
    bins = state.allocated().bins if isinstance(state, BinnedScores) else state.bins
    width = state.width
    d = len(bins)
    # The rule's smoothing uses a robust scale (Silverman): min(σ, IQR/1.349) per axis, so a
    # few far-out scores do not blur the bulk where the records are. U_N's rows keep σ.
    sd = torch.sqrt(torch.diagonal(covs, dim1=1, dim2=2).clamp_min(0))  # (R, d)
    rule_sd = sd[extended:] if extended else sd
    iqr = _iqr_from_counts(counts[extended:] if extended else counts, bins, width)
    robust = torch.where(iqr > 0, torch.minimum(rule_sd, iqr / 1.349), rule_sd)
    if extended:
        robust = torch.cat([sd[:extended], robust])
    masses = counts / ns.clamp_min(1)[:, None]  # per record
    if method == "kde":
        factors = _bandwidth_factors(bandwidth, ns, d, like=covs)
        if d == 1:  # kernel variances in squared cells, with the ridge (width / 4)²
            variances = (robust[:, 0] * factors / width[0]) ** 2 + 0.0625
            ext, crop = _gaussian_smooth_1d(masses, variances, bins[0], extended)
        else:  # the covariances rescaled to the robust σ, correlations kept
            scale = (torch.where(sd > 0, robust / sd, 1.0) * factors[:, None]).unsqueeze(-1)
            ridge = torch.diag_embed((width / 4) ** 2)
            kernels = _gaussian_kernels(covs * scale * scale.transpose(1, 2) + ridge, width, bins)
            ext, crop = _convolve(masses, kernels, bins, extended)
    else:
        ext, crop = _convolve(masses, _ash_kernels(robust + width / 4, ns, width), bins, extended)
    return ext.clamp_min(0), crop.clamp_min(0)


def advantage_from_state(
    state: BinnedScores,
    *,
    prior: float = 0.5,
    method: Method = "histogram",
    delta: float = 0.05,
    bandwidth: str | float = "scott",
    n_dropped: int = 0,
) -> AdvantageEstimate:
    """The estimate from a streaming state (1-2 dimensional grid); see the module docstring."""
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    check_method(method)
    if not state.initialized:
        raise ValueError("the state holds no scores yet")
    estimates = estimates_from_selections(
        {method: (state, fold_selections(state))},
        prior=prior,
        delta=delta,
        bandwidth=bandwidth,
        n_dropped=n_dropped,
    )
    return estimates[method]


def fold_selections(state: BinnedScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cell counts (2, K+2, cells), record counts (2, K+2) and covariances (2, K+2, d, d) of the
    fold selections an estimate uses: all folds (the plug-in), the complement of each fold
    (cross-fitting), then folds 2.. (the certificate's rule) — one matrix product each."""
    device = state.allocated().counts.device
    counts, ns, _, covs = state.pooled(_selection_weights(state.folds, device))
    return counts, ns, covs


@functools.lru_cache(maxsize=8)
def _selection_weights(k: int, device: torch.device) -> torch.Tensor:
    """The (K+2, K) 0/1 fold weights of :func:`fold_selections` (cached: read-only)."""
    weights = torch.ones(k + 2, k, dtype=torch.float64, device=device)
    weights[1 : k + 1].fill_diagonal_(0.0)
    weights[k + 1, list(CERTIFY_FOLDS)] = 0.0
    return weights


Selections = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def estimates_from_selections(
    grids: dict[str, tuple[BinnedScores, Selections]],
    *,
    prior: float,
    delta: float,
    bandwidth: str | float,
    n_dropped: int,
    certify_delta: float | None = None,
) -> dict[str, AdvantageEstimate]:
    """:func:`advantage_from_state` for several methods (arguments already checked), each from a
    state of the same records and its precomputed :func:`fold_selections`: the analysis derives
    the histogram's selections from the KDE grid's by summing cells. Every figure of every
    method comes back in one device transfer, and the certificates share one pair of
    Clopper–Pearson calls."""
    return _grid_estimates(
        grids,
        prior=prior,
        delta=delta,
        bandwidth=bandwidth,
        n_dropped=n_dropped,
        certify_delta=certify_delta,
    )[0]


@dataclass(frozen=True)
class RuleDensities:
    """The cross-fitted rules' smoothed densities of one grid method: ``mass`` (2, K, cells) the
    per-record probability mass per cell of members (0) and non-members (1) learned without
    fold k; ``n_train`` (2, K) the records they were learned from. Record i of fold k is scored
    by row k only: out of sample."""

    mass: torch.Tensor
    n_train: torch.Tensor


def _grid_estimates(
    grids: dict[str, tuple[BinnedScores, Selections]],
    *,
    prior: float,
    delta: float,
    bandwidth: str | float,
    n_dropped: int,
    certify_delta: float | None,
    plugins: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, AdvantageEstimate], dict[str, RuleDensities]]:
    """:func:`estimates_from_selections` and each method's :class:`RuleDensities`; ``plugins``
    replace the methods' W_N / U_N (see :func:`raw_plugins`)."""
    first, (_, ns, _) = next(iter(grids.values()))
    n1, n2 = ns[:, 0].tolist()
    if n1 == 0 or n2 == 0:
        which = "member" if n1 == 0 else "non-member"
        raise ValueError(f"the state holds no {which} scores")
    k = first.folds
    parts, densities = [], {}
    for method, (state, selections) in grids.items():
        figures, mass = _method_figures(
            state,
            selections,
            method,
            prior=prior,
            bandwidth=bandwidth,
            n=(n1, n2),
            plugin=(plugins or {}).get(method),
        )
        parts.append(figures)
        densities[method] = RuleDensities(mass[:, :k], selections[1][:, 1 : k + 1])
    n_certified = ns[:, 0] - ns[:, k + 1]  # the certificate's folds: all but its rule's
    dropped = first.n_dropped.sum().reshape(1).to(n_certified.dtype)
    *values, n1c, n2c, extra = torch.cat([*parts, n_certified, dropped]).tolist()
    plugin, tp, fp, tpc, fpc = np.asarray(values).reshape(len(grids), 5).T
    lower_delta = delta if certify_delta is None else certify_delta
    certs, certs_check = _certify(tpc, n1c, fpc, n2c, prior, (lower_delta, delta))
    estimates = {
        method: _finish(
            plugin=plugin[i],
            tp=tp[i],
            fp=fp[i],
            n1=n1,
            n2=n2,
            cert=certs[i],
            cert_check=certs_check[i],
            prior=prior,
            delta=delta,
            lower_delta=lower_delta,
            method=method,
            n_dropped=n_dropped + int(extra),
        )
        for i, method in enumerate(grids)
    }
    return estimates, densities


def _method_figures(
    state: BinnedScores,
    selections: Selections,
    method: str,
    *,
    prior: float,
    bandwidth,
    n,
    plugin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W_N / U_N, the held-out true / false positives of the cross-fitted rules and those of
    the certificate's rule, as a (5,) tensor on the state's device (no sync), and the rules'
    smoothed densities (2, K + 1, cells). ``n``: the classes' record counts. ``plugin``: W_N /
    U_N computed elsewhere (1-D: on the raw scores, while the rules read their ranks)."""
    k = state.folds
    counts, ns, covs = selections
    total = counts[:, 0]
    t = k + 1  # training selections
    rows = counts[:, 1:].reshape(2 * t, -1)
    row_ns = ns[:, 1:].reshape(-1)
    row_covs = covs[:, 1:].flatten(0, 1)
    extended = 2 if method == "kde" and plugin is None else 0
    if extended:  # U_N needs the full-data KDEs on the extended grid: two more rows
        rows = torch.cat([total, rows])
        row_ns = torch.cat([ns[:, 0], row_ns])
        row_covs = torch.cat([covs[:, 0], row_covs])
    plug_rows, mass = _smooth(state, rows, row_ns, row_covs, method, bandwidth, extended)
    mass = mass.reshape(2, t, -1)
    if plugin is None:
        plugin = _plugin_from(total, plug_rows, method, prior=prior, n=n)
    diff = prior * mass[0] - (1 - prior) * mass[1]  # (train sets, cells)
    # the cross-fitted rules break ties with 1/2, the certificate's rule with the prior's side
    rules = _rule(diff, _ties(k, prior, diff.device), 1e-9 * mass.amax())
    rule, cert_rule = rules[:k], rules[k]
    cert = total - counts[:, k + 1]  # the certificate's folds: all but those its rule learned on
    figures = torch.cat(
        [
            plugin.reshape(1),
            (rule * state.allocated().counts).sum(dim=(1, 2)),  # held-out true / false positives
            cert @ cert_rule,
        ]
    )
    return figures, mass


def _plugin_from(total: torch.Tensor, kde_rows: torch.Tensor, method: str, *, prior, n):
    """W_N from the classes' cell counts ``total`` (2, cells), or U_N from their KDEs' masses
    on the extended grid ``kde_rows`` (2, cells')."""
    if method == "kde":
        return (prior * kde_rows[0] - (1 - prior) * kde_rows[1]).abs().sum()
    return (total[0] * (prior / n[0]) - total[1] * ((1 - prior) / n[1])).abs().sum()


def raw_plugins(
    binned: BinnedRecords,
    members: torch.Tensor,
    nonmembers: torch.Tensor,
    methods: Sequence[str],
    *,
    prior: float,
    bandwidth: str | float = "scott",
    hist_bins: int = 100,
    n_samples: int = 16384,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The paper's W_N / U_N of 1-D scores on their own scale (``binned.raw``), 0-d tensors:
    the rules read the scores' ranks, but the plug-ins are defined on the query as given.
    U_N takes exact kernel sums (importance sampling) when a class's bandwidth is below one
    cell of the raw grid (heavy-tailed scores). A plug-in that cannot be computed (scores so
    extreme that their variance overflows) is NaN, its error in the second dict."""
    raw = binned.raw
    if raw is None:
        raise ValueError("the plug-ins on the raw scale need 1-D scores (binned.raw is None)")
    total = raw.counts
    n = raw.n.tolist()
    out, failed = {}, {}
    if "histogram" in methods:
        coarse = total.reshape(2, hist_bins, -1).sum(dim=-1)
        out["histogram"] = _plugin_from(coarse, coarse, "histogram", prior=prior, n=n)
    if "kde" in methods:
        try:  # scores as extreme as 1e200 overflow a KDE: the plug-in alone is lost
            ns, covs = raw.n, raw.cov
            if kde_grid_too_coarse(ns, covs, raw.extent / raw.bins[0], bandwidth):
                ridge = 1e-6 * (raw.extent / 4) ** 2
                out["kde"] = members.new_tensor(
                    _sampled_kde_plugin(
                        members, nonmembers, prior=prior, bandwidth=bandwidth, ridge=ridge,
                        n_samples=n_samples, seed=seed,
                    )
                )  # fmt: skip
            else:
                rows, _ = _smooth(raw, total, ns, covs, "kde", bandwidth, 2)
                out["kde"] = _plugin_from(total, rows, "kde", prior=prior, n=n)
        except (ValueError, RuntimeError) as err:
            out["kde"] = members.new_tensor(math.nan)
            failed["kde"] = describe_error(err)
    return out, failed


def _sampled_kde_plugin(m, h, *, prior, bandwidth, ridge, n_samples, seed) -> float:
    """U_N = E_mix |p·p̂ − (1−p)·q̂| / mix with mix = (p̂ + q̂)/2, by importance sampling from the
    mixture KDE (exact kernel sums; a local generator seeded by ``seed``)."""
    gen = torch.Generator(device=m.device).manual_seed(seed)
    kp = GaussianKDE(m, bandwidth=bandwidth, ridge=ridge)
    kq = GaussianKDE(h, bandwidth=bandwidth, ridge=ridge)
    half = n_samples // 2
    x = torch.cat([kp.sample(half, generator=gen), kq.sample(n_samples - half, generator=gen)])
    lp, lq = kp.log_density(x), kq.log_density(x)
    lmix = torch.logaddexp(lp, lq) - math.log(2)
    return float((prior * torch.exp(lp - lmix) - (1 - prior) * torch.exp(lq - lmix)).abs().mean())


# -- high-dimensional path (d >= 3, all scores in memory) -------------------------------------
def _cells(x: torch.Tensor, low, width, bins: torch.Tensor) -> torch.Tensor:
    """Multi-index rows of the cells holding x (clamped into the grid)."""
    return torch.minimum(torch.floor((x - low) / width).to(torch.int64).clamp_min(0), bins - 1)


def _kde_rule_counts(m, h, *, prior, bandwidth, ridge, folds, deltas):
    """The cross-fitted Gaussian-KDE rules' held-out true / false positives and the certificate
    (at both δ) from exact kernel sums."""
    fm = fold_of(torch.arange(m.shape[0], device=m.device), folds)
    fh = fold_of(torch.arange(h.shape[0], device=m.device), folds)

    def predict(train_m, train_h, test, tie):
        """Rule on test points learned from the training records; (len(test),) in {0, tie, 1}."""
        kp = GaussianKDE(train_m, bandwidth=bandwidth, ridge=ridge, robust=True)
        kq = GaussianKDE(train_h, bandwidth=bandwidth, ridge=ridge, robust=True)
        diff = kp.log_density(test) + math.log(prior) - kq.log_density(test) - math.log(1 - prior)
        return _rule(diff, diff.new_full((1,), tie), 1e-12)

    tp = fp = 0.0
    for k in range(folds):
        tm, th = m[fm != k], h[fh != k]
        if tm.shape[0] < 2 or th.shape[0] < 2:
            continue
        tp += float(predict(tm, th, m[fm == k], 0.5).sum())
        fp += float(predict(tm, th, h[fh == k], 0.5).sum())
    cm, ch = (fm < 2), (fh < 2)
    tie = float(prior > 0.5)
    if int((~cm).sum()) < 2 or int((~ch).sum()) < 2:
        return tp, fp, 0.0, 0.0
    tpc = float(predict(m[~cm], h[~ch], m[cm], tie).sum())
    fpc = float(predict(m[~cm], h[~ch], h[ch], tie).sum())
    cert, cert_check = (
        float(c[0]) for c in _certify(tpc, float(cm.sum()), fpc, float(ch.sum()), prior, deltas)
    )
    return tp, fp, cert, cert_check


def learned_rule(m, h, *, prior: float, folds: int, deltas: tuple[float, float]):
    """The learned classifier's rule (:mod:`privmon.estimators.learned`; densities lose most of
    a leak above 2 dimensions): held-out true / false positives of the cross-fitted rules and
    the certificate at the run's δ share and at the call's δ."""
    counts = learned_rule_counts(m, h, prior=prior, folds=folds)
    cert, cert_check = _certify(
        counts.cert_tp, counts.n1_cert, counts.cert_fp, counts.n2_cert, prior, deltas
    )
    return counts.tp, counts.fp, float(cert[0]), float(cert_check[0])


def _high_dim(
    m,
    h,
    *,
    prior,
    method,
    delta,
    lower_delta,
    bins,
    bandwidth,
    folds,
    n_samples,
    seed,
    n_dropped,
    rule=None,
):
    """All scores in memory: above 2 dimensions the rule is learned by a classifier
    (:func:`learned_rule`), in 1-2 dimensions with a bandwidth below one grid cell by exact
    Gaussian kernel sums; the plug-ins W_N / U_N as the paper defines them. ``rule``: the
    rule's figures (tp, fp, lower, lower_check) when already learned."""
    deltas = (lower_delta, delta)
    n1, n2 = m.shape[0], h.shape[0]
    d = m.shape[1]
    pooled = torch.cat([m, h])
    low, high = pooled.min(0).values, pooled.max(0).values
    span = torch.where(high > low, high - low, torch.ones_like(high))

    # The tiny ridge gives degenerate classes (point masses, dead units, collinear scores) a
    # kernel without changing regular ones.
    ridge = 1e-6 * (span / 4) ** 2
    if rule is not None:  # the caller learned it already (shared between methods)
        tp, fp, cert, cert_check = rule
    elif d >= 3:
        tp, fp, cert, cert_check = learned_rule(m, h, prior=prior, folds=folds, deltas=deltas)
    else:  # 1-2 D with a bandwidth below a grid cell: exact Gaussian kernel sums
        tp, fp, cert, cert_check = _kde_rule_counts(
            m, h, prior=prior, bandwidth=bandwidth, ridge=ridge, folds=folds, deltas=deltas,
        )  # fmt: skip
    if method == "kde":
        plugin = _sampled_kde_plugin(
            m, h, prior=prior, bandwidth=bandwidth, ridge=ridge, n_samples=n_samples, seed=seed
        )
    else:
        nb = torch.full((d,), bins, dtype=torch.int64, device=m.device)
        cells = _cells(pooled, low, span / bins, nb)
        _, inv = torch.unique(cells, dim=0, return_inverse=True)
        u = int(inv.max()) + 1
        pm = torch.bincount(inv[:n1], minlength=u).to(m.dtype) / n1
        ph = torch.bincount(inv[n1:], minlength=u).to(m.dtype) / n2
        plugin = float((prior * pm - (1 - prior) * ph).abs().sum())
    return _finish(
        plugin=plugin,
        tp=tp,
        fp=fp,
        n1=n1,
        n2=n2,
        cert=cert,
        cert_check=cert_check,
        prior=prior,
        delta=delta,
        lower_delta=lower_delta,
        method=method,
        n_dropped=n_dropped,
    )


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


def optimal_advantage(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    prior: float = 0.5,
    method: Method = "histogram",
    delta: float = 0.05,
    bins: int | None = None,
    bandwidth: str | float = "scott",
    folds: int = 4,
    n_samples: int = 16384,
    seed: int = 0,
    low: Any = None,
    high: Any = None,
) -> AdvantageEstimate:
    """Estimate the optimal membership advantage of a query (MACE eq. 7, Thm 2-3).

    Args:
        member_scores, nonmember_scores: query outputs on member / held-out records, numpy or
            torch on any device, shape (n,) or (n, d); higher need not mean "member". NaN / inf
            rows are dropped and counted in ``n_dropped``.
        prior: P(a probed record is a member), in (0, 1). The advantage is at least |2p − 1|.
        method: "histogram" (W_N) or "kde" (U_N).
        delta: 1 − confidence level of ``lower`` and ``upper``, in (0, 1).
        bins: cells per dimension (histogram default 100, MACE §9.1; KDE quadrature grid default
            2000 in 1-D, 128 per axis in 2-D; above 2 dimensions the histogram bins per axis).
            When a class's KDE bandwidth is narrower than one grid cell (heavy-tailed scores),
            the KDE method evaluates exact kernel sums instead of the grid (slower, O(N²)).
        bandwidth: KDE bandwidth factor, "scott" (default), "silverman" or a number, scipy's
            gaussian_kde convention (full covariance).
        folds: cross-fitting folds (>= 4).
        n_samples: importance samples for U_N above 2 dimensions; ``seed`` seeds them (a local
            generator: the global RNG is never touched).
        low, high: the grid's range per dimension in 1-2 dimensions (records outside land in
            the edge bins). Default: the pooled data range cut at 5 IQRs beyond the quartiles
            (:func:`~privmon.estimators.streaming.robust_range`). Ignored above 2 dimensions.

    Returns:
        :class:`AdvantageEstimate` with ``value`` (debiased), ``lower`` (certified, level
        1 − delta), ``plugin`` (W_N / U_N), ``upper`` and ``halfwidth`` (McDiarmid), counts.
    """
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    check_method(method)
    check_bins(bins)
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 2:
        raise ValueError(f"n_samples must be an integer >= 2, got {n_samples!r}")
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 4:
        raise ValueError(f"folds must be an integer >= 4, got {folds!r}")
    bandwidth_factor(bandwidth, n=2, d=1)  # validate early
    m, dm = as_scores(member_scores, name="member_scores")
    h, dh = as_scores(nonmember_scores, name="nonmember_scores", device=m.device)
    if m.shape[1] != h.shape[1]:
        raise ValueError(
            f"member_scores and nonmember_scores must have the same dimension d, got "
            f"{m.shape[1]} and {h.shape[1]}"
        )
    return estimate_from_scores(
        m,
        h,
        method=method,
        prior=prior,
        delta=delta,
        lower_delta=delta,
        bins=bins,
        bandwidth=bandwidth,
        folds=folds,
        n_samples=n_samples,
        seed=seed,
        low=low,
        high=high,
        n_dropped=dm + dh,
    )


def estimate_from_scores(
    m: torch.Tensor,
    h: torch.Tensor,
    *,
    method: str,
    prior: float,
    delta: float,
    lower_delta: float,
    bins: int | None = None,
    bandwidth: str | float = "scott",
    folds: int = 4,
    n_samples: int = 16384,
    seed: int = 0,
    low: Any = None,
    high: Any = None,
    n_dropped: int = 0,
    rule: tuple[float, float, float, float] | None = None,
) -> AdvantageEstimate:
    """:func:`optimal_advantage` on finite float64 scores (n, d) already checked, with
    ``lower`` certified at ``lower_delta`` (``lower_check`` at ``delta``); above 2 dimensions
    ``rule`` may carry the :func:`learned_rule` figures already learned."""
    d = m.shape[1]
    nbins = bins if bins is not None else default_bins(method, d)
    if d == 1:  # the rule reads the pooled ranks; the plug-in the scores (bin_records)
        binned = bin_records(
            torch.cat([m, h]), m.shape[0], bins=nbins, folds=folds, low=low, high=high
        )
        plugins, _ = raw_plugins(  # a lost plug-in reads NaN; the rule's figures stand
            binned, m, h, [method], prior=prior, bandwidth=bandwidth, hist_bins=nbins,
            n_samples=n_samples, seed=seed,
        )  # fmt: skip
        return _grid_estimates(
            {method: (binned.grid, fold_selections(binned.grid))},
            prior=prior,
            delta=delta,
            bandwidth=bandwidth,
            n_dropped=n_dropped,
            certify_delta=lower_delta,
            plugins=plugins,
        )[0][method]
    exact = False
    if d == 2 and method == "kde" and m.shape[0] >= 2 and h.shape[0] >= 2:
        pooled = torch.cat([m, h])
        width = (pooled.amax(dim=0) - pooled.amin(dim=0)) / nbins
        covs = torch.stack([torch.cov(m.T).reshape(d, d), torch.cov(h.T).reshape(d, d)])
        ns = torch.tensor([m.shape[0], h.shape[0]], dtype=m.dtype, device=m.device)
        exact = kde_grid_too_coarse(ns, covs, width, bandwidth)
    if d == 2 and not exact:
        state = BinnedScores(
            bins=nbins, folds=folds, margin=0.0, low=low, high=high, device=m.device
        )
        state.update(m, h)
        return estimates_from_selections(
            {method: (state, fold_selections(state))},
            prior=prior,
            delta=delta,
            bandwidth=bandwidth,
            n_dropped=n_dropped,
            certify_delta=lower_delta,
        )[method]
    return _high_dim(
        m,
        h,
        prior=prior,
        method=method,
        delta=delta,
        lower_delta=lower_delta,
        bins=nbins,
        bandwidth=bandwidth,
        folds=folds,
        n_samples=n_samples,
        seed=seed,
        n_dropped=n_dropped,
        rule=rule,
    )


def describe_error(err: BaseException) -> str:
    """How a failed method or stage is reported: the exception's type and message."""
    return f"{type(err).__name__}: {err}"


def estimate_methods(
    members: torch.Tensor,
    nonmembers: torch.Tensor,
    binned: BinnedRecords | None,
    *,
    methods: Sequence[str],
    prior: float,
    delta: float,
    lower_delta: float,
    n_dropped: int,
    skip_errors: bool,
) -> tuple[dict[str, AdvantageEstimate], dict[str, str], RuleDensities | None]:
    """Each method's :func:`optimal_advantage` of finite float64 scores (arguments checked),
    ``lower`` certified at ``lower_delta``: the analysis's rule-and-certify step.

    In 1-2 dimensions the grid methods read the records' one binning pass (``binned``): the
    histogram's fold selections are sums of the KDE grid's cells when the KDE's finer grid was
    binned, and every grid figure comes back in one device transfer. The KDE takes exact kernel
    sums instead when its bandwidth is below a grid cell, and above 2 dimensions every method
    runs on the scores. ``skip_errors``: a method that raises is left out and reported in the
    second dict (method -> error) instead of failing the others. The third value: the histogram
    rules' :class:`RuleDensities` (learned even when the histogram is not among ``methods``: the
    per-record risks read them), None above 2 dimensions or when they failed.
    """
    selections: dict[str, tuple[BinnedScores, Selections]] = {}
    if binned is not None and binned.fine is binned.grid:
        selections["histogram"] = (binned.grid, fold_selections(binned.grid))
    elif binned is not None:  # 1-D: the KDE's fine grid coarsened into the histogram's
        grid, fine = binned.grid, binned.fine
        counts, ns, covs = fine_folds = fold_selections(fine)
        coarse_bins = grid.allocated().bins[0]
        factor = fine.allocated().bins[0] // coarse_bins
        coarse = counts.reshape(*counts.shape[:2], coarse_bins, factor).sum(dim=-1)
        selections["histogram"] = (grid, (coarse, ns, covs))
        selections["kde"] = (fine, fine_folds)
    plugins = None
    failures: dict[str, str] = {}
    if binned is not None and binned.raw is not None:  # 1-D: rules on ranks, plug-ins raw
        plugins, lost = raw_plugins(
            binned, members, nonmembers, [m for m in selections if m in methods], prior=prior
        )
        failures.update({f"{m}/plugin": e for m, e in lost.items()})
    estimates: dict[str, AdvantageEstimate] = {}
    densities: dict[str, RuleDensities] = {}
    if selections:

        def estimate(chosen: dict[str, Any]) -> None:
            found, dens = _grid_estimates(
                chosen,
                bandwidth="scott",
                certify_delta=lower_delta,
                plugins=plugins,
                prior=prior,
                delta=delta,
                n_dropped=n_dropped,
            )
            estimates.update(found)
            densities.update(dens)

        try:  # every grid method in one pass (one device transfer)
            estimate(selections)
        except Exception:
            if not skip_errors:
                raise
            for method, one in selections.items():  # again one by one, to isolate the failure
                try:
                    estimate({method: one})
                except Exception as err:
                    failures[method] = describe_error(err)
    low = high = rule = None
    if binned is not None:
        low, high = binned.fine.low, binned.fine.high
    elif len(methods) > 1:  # above 2-D every method measures the same learned rule: learn it once
        try:
            rule = learned_rule(
                members, nonmembers, prior=prior, folds=4, deltas=(lower_delta, delta)
            )
        except Exception as err:
            if not skip_errors:
                raise
            return {}, dict.fromkeys(methods, describe_error(err)), None
    for method in methods:
        if method in estimates or method in failures:
            continue
        try:
            estimates[method] = estimate_from_scores(
                members,
                nonmembers,
                method=method,
                lower_delta=lower_delta,
                low=low,
                high=high,
                rule=rule,
                prior=prior,
                delta=delta,
                n_dropped=n_dropped,
            )
        except Exception as err:
            if not skip_errors:
                raise
            failures[method] = describe_error(err)
    reported = {m: estimates[m] for m in methods if m in estimates}
    reported_failures = {k: e for k, e in failures.items() if k.split("/")[0] in methods}
    return reported, reported_failures, densities.get("histogram")


class StreamingAdvantage:
    """Stateful, mergeable form of :func:`optimal_advantage` (torchmetrics style).

    ``update(member_scores, nonmember_scores)`` bins each batch on the scores' device;
    ``compute()`` returns the same :class:`AdvantageEstimate` as :func:`advantage_from_state` on
    the same records binned at once. In 2-D that is the functional form's estimate when the grid
    is the same (pass ``low`` / ``high``, or let the first batch fix it, see
    :class:`~privmon.estimators.streaming.BinnedScores`), except where a class's KDE bandwidth is
    narrower than a grid cell (the functional KDE then takes exact kernel sums, which a stream
    keeping no records cannot). In 1-D the functional rule reads the pooled ranks of all records,
    which a stream cannot know: the stream's rule reads its fixed grid on the scores' own scale,
    so its ``value`` and ``lower`` depend on how the scores are scaled; its plug-ins equal the
    functional ones. Choose a finer grid (``bins``) for very concentrated scores. State tensors
    reduce by sum across ranks (``state.reducible``); ``state_dict`` is persistent.
    """

    def __init__(
        self,
        *,
        prior: float = 0.5,
        method: Method = "histogram",
        delta: float = 0.05,
        bins: int | None = None,
        bandwidth: str | float = "scott",
        folds: int = 4,
        low: Any = None,
        high: Any = None,
        margin: float = 0.1,
        dim: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        self.prior = check_open_unit(prior, name="prior")
        self.delta = check_open_unit(delta, name="delta")
        self.method = check_method(method)
        bandwidth_factor(bandwidth, n=2, d=1)
        self.bandwidth = bandwidth
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 2:
            raise ValueError(
                f"dim must be 1 or 2 for a streaming estimate, got {dim!r}; "
                "use optimal_advantage on all scores above 2 dimensions"
            )
        self.state = BinnedScores(
            bins=bins if bins is not None else default_bins(method, dim),
            folds=folds,
            low=low,
            high=high,
            margin=margin,
            device=device,
        )

    def update(self, member_scores: Any = None, nonmember_scores: Any = None) -> None:
        """Bin a batch of member and / or non-member scores (NaN / inf rows dropped and
        counted); the first batch fixes the grid unless ``low`` / ``high`` were given."""
        self.state.update(member_scores, nonmember_scores)

    def compute(self) -> AdvantageEstimate:
        """The estimate from every record binned so far (ValueError before the first batch
        of each class)."""
        return advantage_from_state(
            self.state,
            prior=self.prior,
            method=self.method,
            delta=self.delta,
            bandwidth=self.bandwidth,
        )

    def reset(self) -> None:
        """Zero the counts, keeping the grid."""
        self.state.reset()

    def merge_(self, other: StreamingAdvantage) -> StreamingAdvantage:
        """Add another estimator's counts in place (same grid and folds) and return self."""
        self.state.merge_(other.state)
        return self

    def state_dict(self) -> dict[str, Any]:
        """``prior``, ``method``, ``delta`` and the binned state: a checkpoint."""
        return {
            "prior": self.prior,
            "method": self.method,
            "delta": self.delta,
            "state": self.state.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; ``prior``, ``method`` and ``delta`` must match."""
        for key in ("prior", "method", "delta"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict has {key}={state[key]!r}, this estimator {getattr(self, key)!r}"
                )
        self.state.load_state_dict(state["state"])
