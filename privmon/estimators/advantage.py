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
* ``lower`` — a certified lower confidence bound at level 1 − δ: a rule learned on some folds
  is applied to the others, which it has never seen, and an exact bound on its true advantage
  — which bounds the optimal one from below — is read from its correct calls
  (:mod:`privmon.estimators.certificate`: one Clopper–Pearson bound on members' and
  non-members' correct calls pooled, without splitting δ, when the records are balanced for
  the prior; else bounds on its TPR and FPR at δ/2 each). In 1-2 D two rules are certified,
  learned on folds 3..K−1 and on folds 2..K−1, each at δ/2, and ``lower`` is the larger; above
  2-D the one learned on folds 2..K−1, at δ.
  ``lower_check`` is the same bound at the call's ``delta``; the two differ only inside the
  monitor, which certifies ``lower`` at the share of its run-level δ that the check is allotted
  (:mod:`privmon.estimators.spending`). What it can detect at a given audit size:
  :func:`~privmon.estimators.certificate.detectable_advantage`.
* ``upper`` — the paper's plug-in + McDiarmid half-width sqrt(2·(p²/N1 + (1−p)²/N2)·log(2/δ))
  (Thm 2-3 (2); equals sqrt(2/N·log(2/δ)) when N1 = pN). It bounds the plug-in's deviation from
  its own mean, not the plug-in's bias, so it is **not** an upper bound on the advantage: the
  plug-in is biased up, by far more than the half-width above 2-D or on skewed scores. No
  sample-based upper bound on the optimal advantage exists without assumptions; ``upper`` is
  kept only to reproduce MACE.
"""

from __future__ import annotations

from typing import Any

import torch

from privmon._validation import check_open_unit
from privmon.estimators.binned_scores import BinnedScores
from privmon.estimators.density import bandwidth_factor
from privmon.estimators.estimates import AdvantageEstimate, check_bins, default_bins
from privmon.estimators.methods import Method, check_method
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
    """The estimate from a streaming state (1-2 dimensional grid); see the module docstring."""
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
        low, high: the grid's range per dimension in 1-2 dimensions, or one number for every
            dimension (records outside land in the edge bins). Default: the pooled data range
            cut at 5 IQRs beyond the quartiles
            (:func:`~privmon.estimators.order_statistics.robust_range`). Ignored above 2
            dimensions.

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

    ``update(member_scores, nonmember_scores)`` bins each batch on the scores' device;
    ``compute()`` returns the same :class:`AdvantageEstimate` as :func:`advantage_from_state` on
    the same records binned at once. In 2-D that is the functional form's estimate when the grid
    is the same (pass ``low`` / ``high``, or let the first batch fix it, see
    :class:`~privmon.estimators.binned_scores.BinnedScores`), except for ``lower`` (the functional
    certificate bins its rule's records again, on their own range; a stream's certificate reads
    the stream's one grid, whose edges the first batch fixed — a dependence on the certified
    records, through those edges, that the proof in :mod:`privmon.estimators.certificate` does
    not cover: pass ``low`` / ``high`` to remove it) and where a class's KDE bandwidth is
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
