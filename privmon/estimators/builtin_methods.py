"""The built-in advantage estimators as objects, registered in
:mod:`privmon.estimators.methods`: the histogram (W_N, an average shifted histogram's rule,
MACE Lemma 5 per record) and the Gaussian KDE (U_N, a KDE's rule, Lemma 6 / 11 per record);
above 2 dimensions both measure the learned rule (:data:`~privmon.estimators.in_memory.
LEARNED_RULE`)."""

from __future__ import annotations

import torch

from privmon.estimators.in_memory import KERNEL_SUM_RULE, LEARNED_RULE
from privmon.estimators.methods import EstimatorMethod, MemoryRule, register_method
from privmon.estimators.plugins import (
    cell_histogram_plugin,
    histogram_plugin,
    kde_plugin,
    sampled_kde_plugin,
)
from privmon.estimators.record_binning import ClassCounts
from privmon.estimators.risk import IndividualRisk, histogram_individual_risk, kde_individual_risk
from privmon.estimators.smoothing import ash_smooth, kde_grid_too_coarse, kde_smooth, smooth_raw

__all__ = ["HistogramMethod", "KDEMethod"]


class HistogramMethod(EstimatorMethod):
    """The histogram method: 100 cells per dimension (MACE §9.1), the rule of an average
    shifted histogram, W_N, Lemma 5 per record. Subclass it for a histogram of another grid.

    Examples:
        >>> from privmon.estimators.builtin_methods import HistogramMethod
        >>> HistogramMethod().name, HistogramMethod().default_bins(2)
        ('histogram', 100)
    """

    name = "histogram"

    def default_bins(self, d: int) -> int:
        """100 per dimension (MACE §9.1)."""
        return 100

    def memory_rule(self, d: int) -> MemoryRule:
        """The learned rule (a histogram's rule reads its grid in 1-2 D)."""
        return LEARNED_RULE

    def smooth(self, bins, width, counts, ns, covs, *, bandwidth, extended: int):
        """An average shifted histogram (``bandwidth`` unused)."""
        return ash_smooth(bins, width, counts, ns, covs, extended=extended)

    def grid_plugin(self, total, rows, *, prior: float, n) -> torch.Tensor:
        """W_N from the cell counts."""
        return histogram_plugin(total, prior=prior, n=n)

    def raw_plugin(
        self, raw: ClassCounts, members, nonmembers, *, prior, bandwidth, bins, n_samples, seed
    ) -> torch.Tensor:
        """W_N on ``bins`` cells of the raw scores' grid (its cells summed)."""
        coarse = raw.counts.reshape(2, bins, -1).sum(dim=-1)
        return histogram_plugin(coarse, prior=prior, n=raw.n.tolist())

    def memory_plugin(
        self, m, h, *, prior, bandwidth, bins, low, span, ridge, n_samples, seed
    ) -> float:
        """W_N over the occupied cells."""
        return cell_histogram_plugin(m, h, prior=prior, bins=bins, low=low, span=span)

    def individual_risk(
        self, x, m, h, *, prior, delta, bins, bandwidth, n_dropped
    ) -> IndividualRisk:
        """Lemma 5 on the method's grid."""
        nbins = bins if bins is not None else self.default_bins(m.shape[1])
        return histogram_individual_risk(
            x, m, h, prior=prior, delta=delta, bins=nbins, n_dropped=n_dropped, method=self.name
        )


class KDEMethod(EstimatorMethod):
    """The KDE method: a Gaussian KDE's rule on a fine quadrature grid (2000 cells in 1-D, 128
    per axis in 2-D; exact kernel sums where a bandwidth is below a cell), U_N, Lemma 6 / 11
    per record. It does not apply to discrete scores.

    Examples:
        >>> from privmon.estimators.builtin_methods import KDEMethod
        >>> KDEMethod().default_bins(1), KDEMethod().discrete
        (2000, False)
    """

    name = "kde"
    discrete = False
    plugin_reads_density = True

    def default_bins(self, d: int) -> int:
        """A fine quadrature grid: in 1-D 20 × 100 cells, so that one binning pass serves the
        histogram too (``BinnedScores.coarsen``)."""
        return 2000 if d == 1 else 128

    def reads_memory(self, members: torch.Tensor, nonmembers: torch.Tensor, *, bins, bandwidth):
        """Whether a class's bandwidth is below a cell of the 2-D grid over the pooled range
        (:func:`~privmon.estimators.smoothing.kde_grid_too_coarse`)."""
        if members.shape[0] < 2 or nonmembers.shape[0] < 2:
            return False
        d = members.shape[1]
        pooled = torch.cat([members, nonmembers])
        width = (pooled.amax(dim=0) - pooled.amin(dim=0)) / bins
        covs = torch.stack(
            [torch.cov(members.T).reshape(d, d), torch.cov(nonmembers.T).reshape(d, d)]
        )
        ns = torch.tensor(
            [members.shape[0], nonmembers.shape[0]], dtype=members.dtype, device=members.device
        )
        return kde_grid_too_coarse(ns, covs, width, bandwidth)

    def memory_rule(self, d: int) -> MemoryRule:
        """Above 2-D the learned rule, else the KDE's rule by exact kernel sums."""
        return LEARNED_RULE if d > 2 else KERNEL_SUM_RULE

    def smooth(self, bins, width, counts, ns, covs, *, bandwidth, extended: int):
        """Gaussian kernels of the classes' covariances."""
        return kde_smooth(bins, width, counts, ns, covs, bandwidth=bandwidth, extended=extended)

    def grid_plugin(self, total, rows, *, prior: float, n) -> torch.Tensor:
        """U_N by quadrature of the smoothed full-data densities."""
        return kde_plugin(rows, prior=prior)

    def raw_plugin(
        self, raw: ClassCounts, members, nonmembers, *, prior, bandwidth, bins, n_samples, seed
    ) -> torch.Tensor:
        """U_N on the raw scores' grid, or by importance sampling where a bandwidth is below a
        cell of it (heavy tails); scores as extreme as 1e200 overflow (the error)."""
        rows = smooth_raw(raw, bandwidth)
        if rows is not None:
            return kde_plugin(rows, prior=prior)
        ridge = 1e-6 * (raw.extent / 4) ** 2
        return members.new_tensor(
            sampled_kde_plugin(
                members, nonmembers, prior=prior, bandwidth=bandwidth, ridge=ridge,
                n_samples=n_samples, seed=seed,
            )
        )  # fmt: skip

    def memory_plugin(
        self, m, h, *, prior, bandwidth, bins, low, span, ridge, n_samples, seed
    ) -> float:
        """U_N by importance sampling from the mixture KDE."""
        return sampled_kde_plugin(
            m, h, prior=prior, bandwidth=bandwidth, ridge=ridge, n_samples=n_samples, seed=seed
        )

    def individual_risk(
        self, x, m, h, *, prior, delta, bins, bandwidth, n_dropped
    ) -> IndividualRisk:
        """Lemma 6 with Lemma 11's normal approximation."""
        return kde_individual_risk(
            x, m, h, prior=prior, delta=delta, bandwidth=bandwidth, n_dropped=n_dropped,
            method=self.name,
        )  # fmt: skip


register_method(HistogramMethod())
register_method(KDEMethod())
