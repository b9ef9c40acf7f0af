"""Optimal membership advantage (MACE §5): :func:`optimal_advantage` on all scores at once,
:class:`StreamingAdvantage` on batches, :func:`advantage_from_state` on a binned state.

The optimal accuracy advantage at prior p, Adv*_p = ∫ |p·P(q) − (1−p)·Q(q)| dq (MACE eq. 7-8,
P / Q the member / non-member distributions of the query output), is at least |2p − 1|. Each
estimate reports the paper's plug-in (W_N for "histogram", U_N for "kde"), a debiased
cross-fitted ``value``, a certified lower bound ``lower``
(:mod:`privmon.estimators.certificate`) and the paper's McDiarmid ``upper`` — a plug-in figure,
not an upper bound on the advantage. In 1-D the rules read the pooled ranks, so ``value`` and
``lower`` do not depend on how the score is scaled.

Derivations: Theory, *The optimal advantage and its estimators*.
"""

from __future__ import annotations

from typing import Any

import torch

from privmon._validation import check_open_unit
from privmon.estimators.binned_scores import BinnedScores
from privmon.estimators.density import bandwidth_factor
from privmon.estimators.estimates import AdvantageEstimate, check_bins
from privmon.estimators.methods import Method, check_method, estimator_method
from privmon.estimators.selections import stream_selections
from privmon.estimators.stages import (
    EstimatorOptions,
    bin_scores,
    estimate_advantages,
    finite_scores,
    grid_figures,
)

__all__ = ["StreamingAdvantage", "advantage_from_state", "optimal_advantage"]


def advantage_from_state(
    state: BinnedScores,
    *,
    prior: float = 0.5,
    method: Method = "histogram",
    delta: float = 0.05,
    bandwidth: str | float = "scott",
    n_dropped: int = 0,
) -> AdvantageEstimate:
    """The estimate of :func:`optimal_advantage` from a streaming state (1-2 dimensional grid):
    what :meth:`StreamingAdvantage.compute` returns.

    Args:
        state: binned member and non-member scores, both classes seen.
        prior, method, delta, bandwidth: as for :func:`optimal_advantage`.
        n_dropped: non-finite records dropped before binning, reported in the estimate.

    Examples:
        >>> import torch
        >>> from privmon.estimators import BinnedScores, advantage_from_state
        >>> gen = torch.Generator().manual_seed(0)
        >>> state = BinnedScores(bins=100)
        >>> state.update(torch.randn(500, generator=gen) + 0.5, torch.randn(500, generator=gen))
        >>> round(advantage_from_state(state).plugin, 3)
        0.282
    """
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    check_method(method)
    if not state.initialized:
        raise ValueError("the state holds no scores yet")
    estimates, _, _ = grid_figures(
        {method: stream_selections(state)},
        prior=prior,
        delta=delta,
        bandwidth=bandwidth,
        n_dropped=n_dropped,
    )
    return estimates[method]


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
        member_scores, nonmember_scores: query outputs, (n,) or (n, d), numpy or torch on any
            device, in either orientation; NaN / inf rows are dropped, counted in ``n_dropped``.
        prior: P(a probed record is a member), in (0, 1). The advantage is at least |2p − 1|.
        method: "histogram" (W_N) or "kde" (U_N).
        delta: 1 − confidence level of ``lower`` and ``upper``, in (0, 1).
        bins: cells per dimension (histogram default 100, MACE §9.1; KDE quadrature grid default
            2000 in 1-D, 128 per axis in 2-D; above 2 dimensions the histogram bins per axis).
        bandwidth: KDE bandwidth factor, "scott" (default), "silverman" or a number (scipy's
            gaussian_kde convention). A bandwidth below one grid cell takes exact kernel sums.
        folds: cross-fitting folds (>= 4).
        n_samples: importance samples for U_N above 2 dimensions; ``seed`` seeds them (a local
            generator: the global RNG is never touched).
        low, high: the grid's range in 1-2 dimensions, one number or one per dimension; default
            the pooled range cut at 5 IQRs beyond the quartiles. Ignored above 2 dimensions.

    Returns:
        :class:`AdvantageEstimate` with ``value`` (debiased), ``lower`` (certified, level
        1 − delta), ``plugin`` (W_N / U_N), ``upper`` and ``halfwidth`` (McDiarmid), counts.

    Examples:
        >>> import torch
        >>> from privmon import optimal_advantage
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> est = optimal_advantage(members, torch.randn(500, generator=gen))
        >>> round(est.value, 3), round(est.lower, 3)
        (0.23, 0.17)
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
    scores = finite_scores(member_scores, nonmember_scores, aligned=False)
    if scores.dim <= 2:
        low, high = _grid_bounds(low, high, scores.dim, scores.scale)
    options = EstimatorOptions(
        bins=bins,
        bandwidth=bandwidth,
        folds=folds,
        n_samples=n_samples,
        seed=seed,
        low=low,
        high=high,
    )
    binned = bin_scores(
        scores, methods=[method], per_record=False, options=options, skip_errors=False
    )
    advantages = estimate_advantages(
        scores,
        binned,
        methods=[method],
        prior=prior,
        delta=delta,
        lower_delta=delta,
        options=options,
        skip_errors=False,
    )
    return advantages.estimates[method]


def _grid_bounds(low: Any, high: Any, d: int, scale: torch.Tensor | None) -> tuple[Any, Any]:
    """``low`` / ``high`` as (d,) float64 tensors (a single number serves every dimension),
    multiplied by ``scale`` when the scores were
    (:func:`~privmon.estimators.magnitude.magnitude_scale`); None as given."""
    if low is None or high is None:
        if (low is None) != (high is None):
            raise ValueError("low and high must be given together (or neither)")
        return low, high
    bounds = []
    for bound, name in ((low, "low"), (high, "high")):
        t = torch.atleast_1d(torch.as_tensor(bound, dtype=torch.float64))
        if t.ndim != 1 or t.numel() not in (1, d):
            raise ValueError(
                f"{name} must be one number or one per dimension ({d}), got shape "
                f"{tuple(torch.as_tensor(bound).shape)}"
            )
        t = t.expand(d)
        bounds.append(t if scale is None else t * scale.cpu())
    return bounds[0], bounds[1]


class StreamingAdvantage:
    """Stateful, mergeable form of :func:`optimal_advantage` (torchmetrics style).

    ``update(member_scores, nonmember_scores)`` bins each batch on the scores' device (the first
    batch fixes the grid unless ``low`` / ``high`` are given); ``compute()`` returns the
    :class:`AdvantageEstimate` of :func:`advantage_from_state` on every record binned so far.
    State tensors reduce by sum across ranks (``state.reducible``); ``state_dict`` is a
    checkpoint. A stream keeps no records: its 1-D rule reads its grid, not the pooled ranks,
    so ``value`` and ``lower`` depend on the scores' scale, and its certificate depends on the
    first batch through the grid's edges unless ``low`` / ``high`` are given (Theory, *The
    optimal advantage and its estimators*). Choose a finer grid (``bins``) for very
    concentrated scores.

    Examples:
        >>> import torch
        >>> from privmon import StreamingAdvantage
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> nonmembers = torch.randn(500, generator=gen)
        >>> stream = StreamingAdvantage(low=-4.0, high=4.0)
        >>> for m, n in zip(members.split(100), nonmembers.split(100)):  # five batches
        ...     stream.update(m, n)
        >>> est = stream.compute()
        >>> est.n_members, round(est.value, 3), round(est.lower, 3)
        (500, 0.232, 0.181)
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
            bins=bins if bins is not None else estimator_method(method).default_bins(dim),
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
