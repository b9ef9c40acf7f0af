"""The stages of the estimators' one pipeline, each one call. :func:`~privmon.analyse` walks them
all, in order; :func:`~privmon.optimal_advantage` walks stages 0-3 for its one method, and
:class:`~privmon.StreamingAdvantage` stages 2-3 on its state:

0. :func:`finite_scores`: finite float64 rows, members first, on a safe scale
   (:mod:`~privmon.estimators.magnitude`);
1. :func:`bin_scores`: in 1-2 dimensions every record binned once on each grid its methods read
   (:mod:`~privmon.estimators.record_binning`, :mod:`~privmon.estimators.selections`);
2-3. :func:`estimate_advantages`: per grid (:func:`grid_figures`) smooth, the plug-ins, the rule
   and its certificate (:mod:`~privmon.estimators.smoothing`, :mod:`~privmon.estimators.plugins`,
   :mod:`~privmon.estimators.rules`); beside the grid, the rule learned on the scores in memory
   (:mod:`~privmon.estimators.in_memory`);
4-5. the ROC (1-D) from stage 1's sort, the per-record risks (1-2 D) from stage 3's densities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from privmon._validation import as_scores
from privmon.estimators.estimates import AdvantageEstimate, describe_error
from privmon.estimators.in_memory import in_memory_estimate, rule_figures
from privmon.estimators.magnitude import magnitude_scale
from privmon.estimators.methods import RISK_METHOD, estimator_method, registered_methods
from privmon.estimators.order_statistics import robust_range
from privmon.estimators.plugins import raw_plugins
from privmon.estimators.record_binning import BinnedRecords, bin_records
from privmon.estimators.rules import RuleDensities, grid_estimates
from privmon.estimators.selections import GridSelections, record_selections
from privmon.estimators.smoothing import smooth_selections

__all__ = [
    "Advantages",
    "Binned",
    "EstimatorOptions",
    "FiniteScores",
    "GridPass",
    "bin_scores",
    "estimate_advantages",
    "finite_scores",
    "grid_figures",
]


@dataclass(frozen=True)
class EstimatorOptions:
    """How the estimators are set (:func:`~privmon.optimal_advantage`'s keywords, checked there;
    :func:`~privmon.analyse` uses the defaults): cells per dimension (None: each method's
    :meth:`~privmon.estimators.methods.EstimatorMethod.default_bins`), the KDE ``bandwidth``,
    cross-fitting ``folds``, U_N's importance samples above 2-D and their ``seed``, and the raw
    scores' grid ``low`` / ``high`` in 1-2 D ((d,) tensors, or None: their robust range)."""

    bins: int | None = None
    bandwidth: str | float = "scott"
    folds: int = 4
    n_samples: int = 16384
    seed: int = 0
    low: Any = None
    high: Any = None

    def bins_of(self, method: str, d: int) -> int:
        """The cells per dimension of ``method``'s grid for ``d``-dimensional scores."""
        return self.bins if self.bins is not None else estimator_method(method).default_bins(d)


# -- 0. finite scores ------------------------------------------------------------------------
@dataclass(frozen=True)
class FiniteScores:
    """A pair of score sets as the stages read them: ``x`` (n, d) finite float64, the first
    ``n_members`` rows the members, multiplied by ``scale`` where a column's magnitude is
    extreme (:func:`~privmon.estimators.magnitude.magnitude_scale`, None: as given);
    ``n_dropped`` non-finite rows dropped. With aligned rows (:func:`finite_scores`): ``kept``
    marks the input rows kept (None: all), of which the first ``n_given_members`` are members."""

    x: torch.Tensor
    n_members: int
    n_dropped: int
    scale: torch.Tensor | None
    kept: torch.Tensor | None
    n_given_members: int

    @property
    def dim(self) -> int:
        """Dimensions per score."""
        return int(self.x.shape[1])

    @property
    def members(self) -> torch.Tensor:
        """The member rows."""
        return self.x[: self.n_members]

    @property
    def nonmembers(self) -> torch.Tensor:
        """The non-member rows."""
        return self.x[self.n_members :]


def finite_scores(member_scores: Any, nonmember_scores: Any, *, aligned: bool) -> FiniteScores:
    """Stage 0: the member and non-member scores (numpy or torch, (n,) or (n, d)) as one finite
    float64 tensor on the member scores' device, NaN / inf rows dropped and counted.

    ``aligned``: keep track of the input rows (``kept``) so that per-record outputs can be
    aligned with them, and refuse a class without finite scores once both are read; else each
    class is refused on its own as it is read (:func:`~privmon._validation.as_scores`)."""
    mem, dropped_m = as_scores(member_scores, name="member_scores", drop=not aligned)
    non, dropped_n = as_scores(
        nonmember_scores, name="nonmember_scores", device=mem.device, drop=not aligned
    )
    if mem.shape[1] != non.shape[1]:
        raise ValueError(
            f"member_scores and nonmember_scores must have the same dimension d, got "
            f"{mem.shape[1]} and {non.shape[1]}"
        )
    x = torch.cat([mem, non])
    kept = None  # rows kept (None: all, the usual case)
    if aligned and (dropped_m or dropped_n):
        kept = torch.isfinite(x).all(dim=1)
        x = x[kept]
    n1 = mem.shape[0] - (dropped_m if aligned else 0)
    for n, side in ((n1, "member_scores"), (x.shape[0] - n1, "nonmember_scores")):
        if n == 0:
            raise ValueError(f"{side} has no finite scores")
    scale = magnitude_scale(x)
    if scale is not None:  # extreme magnitudes: the same figures, on a scale safe to compute on
        x = x * scale
    return FiniteScores(x, n1, dropped_m + dropped_n, scale, kept, mem.shape[0])


# -- 1. bin ----------------------------------------------------------------------------------
class GridPass(NamedTuple):
    """Records binned once (``records``) and the :class:`~privmon.estimators.selections.
    GridSelections` of each grid method that reads them (``selections``)."""

    records: BinnedRecords
    selections: dict[str, GridSelections]


@dataclass(frozen=True)
class Binned:
    """What stage 1 hands on: the binning ``passes`` (the first one holds the histogram's
    records when per-record risks were asked for, and in 1-D the check's one sort), the methods
    whose rule reads the scores in memory (``in_memory``), and the grid methods whose binning
    failed (``failures``, method -> error; only when errors are skipped)."""

    passes: tuple[GridPass, ...]
    in_memory: tuple[str, ...]
    failures: dict[str, str]

    def pass_of(self, method: str) -> GridPass | None:
        """The pass whose grid ``method`` reads, None when its rule reads the scores in memory."""
        return next((p for p in self.passes if method in p.selections), None)


def bin_scores(
    scores: FiniteScores,
    *,
    methods: Sequence[str],
    per_record: bool,
    options: EstimatorOptions,
    skip_errors: bool,
) -> Binned:
    """Stage 1: bin every record once on each grid ``methods`` read (1-2 dimensions).

    ``per_record``: the rule the per-record risks read (:data:`~privmon.estimators.methods.
    RISK_METHOD`) is binned first even when it is not among ``methods``. In 1-D every method
    reads one pass, whose one sort gives the ranks the rules read, the raw scores' grid for the
    paper's plug-ins and the ROC's ranking; the finest grid serves the others, summed. In 2-D
    each method bins on its own grid over the same range, except one whose rule reads the
    scores in memory (:meth:`~privmon.estimators.methods.EstimatorMethod.reads_memory`: a KDE
    whose bandwidth is below a grid cell); above 2-D every method does.
    ``skip_errors``: a pass after the first that fails is reported in ``failures``."""
    d = scores.dim
    if d > 2:
        return Binned((), tuple(methods), {})
    wanted = {*methods, *([RISK_METHOD] if per_record else [])}
    grid_methods = [m for m in registered_methods() if m in wanted]  # the risks' rule first
    x, n1 = scores.x, scores.n_members
    if d == 1:  # one pass: the rules read the pooled ranks, the plug-ins the scores
        bins = {m: options.bins_of(m, d) for m in grid_methods}
        records = bin_records(
            x,
            n1,
            bins=bins[grid_methods[0]],
            fine_bins=max(bins.values()) if len(grid_methods) > 1 else None,
            folds=options.folds,
            low=options.low,
            high=options.high,
        )
        return Binned((GridPass(records, record_selections(records, bins)),), (), {})
    low, high = options.low, options.high
    if low is None:  # one range for every grid
        low, high = robust_range(x)
    passes: list[GridPass] = []
    in_memory: list[str] = []
    failures: dict[str, str] = {}
    for method in grid_methods:
        try:
            bins_2d = options.bins_of(method, d)
            if estimator_method(method).reads_memory(
                scores.members, scores.nonmembers, bins=bins_2d, bandwidth=options.bandwidth
            ):
                in_memory.append(method)
                continue
            records = bin_records(x, n1, bins=bins_2d, folds=options.folds, low=low, high=high)
            passes.append(GridPass(records, record_selections(records, {method: bins_2d})))
        except Exception as err:
            if not (skip_errors and passes):
                raise
            failures[method] = describe_error(err)
    return Binned(tuple(passes), tuple(in_memory), failures)


# -- 2-3. smooth, plug-ins, rule + certificate -----------------------------------------------
class Advantages(NamedTuple):
    """What stages 2-3 hand on: each method's estimate, what failed (a method, or
    ``<method>/plugin`` for a plug-in alone -> the error), and the densities of the rule the
    per-record risks read (None above 2-D or when they failed)."""

    estimates: dict[str, AdvantageEstimate]
    failures: dict[str, str]
    densities: RuleDensities | None


@dataclass(frozen=True)
class _Call:
    """The arguments every method of one :func:`estimate_advantages` call shares."""

    scores: FiniteScores
    methods: Sequence[str]
    prior: float
    delta: float
    lower_delta: float
    options: EstimatorOptions


def estimate_advantages(
    scores: FiniteScores,
    binned: Binned,
    *,
    methods: Sequence[str],
    prior: float,
    delta: float,
    lower_delta: float,
    options: EstimatorOptions,
    skip_errors: bool,
) -> Advantages:
    """Stages 2-3: each method's estimate, ``lower`` certified at ``lower_delta`` and
    ``lower_check`` at ``delta`` (arguments already checked).

    The methods of the first binning pass are estimated together (every figure in one device
    transfer; :func:`grid_figures`), those of the other passes and those reading the scores in
    memory one by one; above 2-D methods that read the same rule (the learned rule) share it,
    learned once. ``skip_errors``: a method that raises is left out and reported in
    ``failures`` instead of failing the others."""
    call = _Call(scores, methods, prior, delta, lower_delta, options)
    estimates: dict[str, AdvantageEstimate] = {}
    densities: dict[str, RuleDensities] = {}
    failures: dict[str, str] = {}
    if binned.passes:
        first = binned.passes[0]
        try:  # every method of the first pass at once (one device transfer)
            _on_grid(call, first, first.selections, estimates, densities, failures)
        except Exception:
            if not skip_errors:
                raise
            for method, one in first.selections.items():  # one by one, to isolate the failure
                try:
                    _on_grid(call, first, {method: one}, estimates, densities, failures)
                except Exception as err:
                    failures[method] = describe_error(err)
    try:
        rule = _shared_rule(call)
    except Exception as err:
        if not skip_errors:
            raise
        return Advantages({}, dict.fromkeys(methods, describe_error(err)), None)
    for method in methods:
        if method in estimates or method in failures:
            continue
        if method in binned.failures:
            failures[method] = binned.failures[method]
            continue
        try:
            grid_pass = binned.pass_of(method)
            if grid_pass is not None:
                _on_grid(call, grid_pass, grid_pass.selections, estimates, densities, failures)
            else:
                estimates[method] = _in_memory(call, method, rule)
        except Exception as err:
            if not skip_errors:
                raise
            failures[method] = describe_error(err)
    return Advantages(
        {m: estimates[m] for m in methods if m in estimates},
        {k: e for k, e in failures.items() if k.split("/")[0] in methods},
        densities.get(RISK_METHOD),
    )


def _on_grid(
    call: _Call,
    grid_pass: GridPass,
    chosen: dict[str, GridSelections],
    estimates: dict[str, AdvantageEstimate],
    densities: dict[str, RuleDensities],
    failures: dict[str, str],
) -> None:
    """:func:`grid_figures` of the ``chosen`` methods of one pass, into the three dicts (the
    accumulators of :func:`estimate_advantages`)."""
    scores, options = call.scores, call.options
    raw = None  # 1-D: the rules read ranks, the plug-ins the scores
    if grid_pass.records.raw is not None:
        raw = (grid_pass.records, scores.members, scores.nonmembers)
    raw_methods = [m for m in chosen if m in call.methods]
    found, dens, lost = grid_figures(
        chosen,
        prior=call.prior,
        delta=call.delta,
        bandwidth=options.bandwidth,
        n_dropped=scores.n_dropped,
        certify_delta=call.lower_delta,
        raw=raw,
        raw_methods=raw_methods,
        raw_bins={m: options.bins_of(m, scores.dim) for m in raw_methods},
        n_samples=options.n_samples,
        seed=options.seed,
    )
    estimates.update(found)
    densities.update(dens)
    failures.update({f"{m}/plugin": e for m, e in lost.items()})


def _shared_rule(call: _Call) -> tuple[float, float, float, float] | None:
    """Above 2-D, the figures of the rule every method reads when they read the same one (the
    learned rule), learned once; else None (each method learns its own)."""
    scores, d = call.scores, call.scores.dim
    rules = {id(estimator_method(m).memory_rule(d)) for m in call.methods}
    if d <= 2 or len(call.methods) < 2 or len(rules) > 1:
        return None
    return rule_figures(
        estimator_method(call.methods[0]).memory_rule(d),
        scores.members,
        scores.nonmembers,
        prior=call.prior,
        folds=call.options.folds,
        deltas=(call.lower_delta, call.delta),
        scale=scores.scale,
        bandwidth=call.options.bandwidth,
    )


def _in_memory(call: _Call, method: str, rule) -> AdvantageEstimate:
    """One method's estimate from the scores in memory (``rule``: the shared rule's figures)."""
    scores, options = call.scores, call.options
    return in_memory_estimate(
        scores.members,
        scores.nonmembers,
        method=estimator_method(method),
        prior=call.prior,
        delta=call.delta,
        lower_delta=call.lower_delta,
        bins=options.bins_of(method, scores.dim),
        bandwidth=options.bandwidth,
        folds=options.folds,
        n_samples=options.n_samples,
        seed=options.seed,
        n_dropped=scores.n_dropped,
        scale=scores.scale,
        rule=rule,
    )


def grid_figures(
    grids: dict[str, GridSelections],
    *,
    prior: float,
    delta: float,
    bandwidth: str | float,
    n_dropped: int,
    certify_delta: float | None = None,
    raw: tuple[BinnedRecords, torch.Tensor, torch.Tensor] | None = None,
    raw_methods: Sequence[str] = (),
    raw_bins: dict[str, int] | None = None,
    n_samples: int = 16384,
    seed: int = 0,
) -> tuple[dict[str, AdvantageEstimate], dict[str, RuleDensities], dict[str, str]]:
    """Stages 2-3 for several grid methods (arguments already checked), each from the
    :class:`~privmon.estimators.selections.GridSelections` of the same records, in order:

    1. smooth (:mod:`~privmon.estimators.smoothing`) every selection, with the classes'
       full-data densities on the extended grid for a plug-in that reads them;
    2. the plug-ins (:mod:`~privmon.estimators.plugins`): in 1-D (``raw``: the binned records
       with the member and non-member scores) those of ``raw_methods`` on the raw scale, of
       ``raw_bins`` cells (the rules read ranks; W_N / U_N are defined on the query as given),
       else from the grid;
    3. the rules and their certificates (:mod:`~privmon.estimators.rules`).

    Returns each method's estimate, its rules' densities, and the plug-ins that could not be
    computed (method -> error; they read NaN)."""
    ns = next(iter(grids.values())).selected[1]
    n1, n2 = ns[:, 0].tolist()
    if n1 == 0 or n2 == 0:
        raise ValueError(f"the state holds no {'member' if n1 == 0 else 'non-member'} scores")
    objects = {name: estimator_method(name) for name in grids}
    on_raw = raw_methods if raw is not None else ()
    smoothed = {
        name: smooth_selections(
            grid,
            objects[name],
            bandwidth=bandwidth,
            extended=objects[name].plugin_reads_density and name not in on_raw,
        )
        for name, grid in grids.items()
    }
    plugins: dict[str, torch.Tensor] = {}
    lost: dict[str, str] = {}
    if raw is not None:
        plugins, lost = raw_plugins(
            {name: objects[name] for name in on_raw}, *raw, prior=prior, bandwidth=bandwidth,
            bins=raw_bins or {}, n_samples=n_samples, seed=seed,
        )  # fmt: skip
    for name, grid in grids.items():
        if name not in plugins:
            total = grid.selected[0][:, 0]
            plugins[name] = objects[name].grid_plugin(
                total, smoothed[name][0], prior=prior, n=(n1, n2)
            )
    estimates, densities = grid_estimates(
        grids,
        {name: mass for name, (_, mass) in smoothed.items()},
        plugins,
        prior=prior,
        delta=delta,
        n_dropped=n_dropped,
        certify_delta=certify_delta,
    )
    return estimates, densities, lost
