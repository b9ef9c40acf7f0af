"""What the specific-setup and average audits return (:class:`AuditResult`) and their comparison
(:func:`compare`, :class:`SetupComparison`; Krčo et al., "Lost in the Averages", §3.4 and §6
Theorem 1). See :mod:`privmon.audit.specific`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from privmon._validation import check_choice, check_open_interval, check_unit
from privmon.audit.records import frozen

__all__ = ["AuditResult", "SetupComparison", "compare"]

_METRICS = ("auc", "tpr")

# §4.1: high-risk threshold T = 0.8 for AUC and T = 0.6 for TPR at low FPR.
_DEFAULT_THRESHOLD = {"auc": 0.8, "tpr": 0.6}


def _fields_equal(a: Any, b: Any, names: Sequence[str]) -> bool:
    for name in names:
        u, v = getattr(a, name), getattr(b, name)
        if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
            if not (isinstance(u, np.ndarray) and isinstance(v, np.ndarray)):
                return False
            if u.shape != v.shape or not np.array_equal(u, v, equal_nan=u.dtype.kind == "f"):
                return False
        elif not (u == v or (isinstance(u, float) and math.isnan(u) and math.isnan(v))):
            return False
    return True


@dataclass(frozen=True, repr=False, eq=False)
class AuditResult:
    """Per-target membership risk over a set of evaluation models (one setup).

    Attributes:
        setup: ``"specific"`` (§3.3) or ``"average"`` (§3.2).
        targets: the audited records, as indices into the dataset (specific) or pool (average),
            shape ``(n_targets,)``.
        mask: ``mask[k, j]`` is True when target ``j`` was in model ``k``'s training set,
            shape ``(n_models, n_targets)``. Balanced per target: each target is in
            ``n_models // 2`` or ``n_models // 2 + 1`` models.
        scores: ``scores[k, j]`` is the membership score of target ``j``'s original record under
            model ``k`` (higher = member), float64, shape ``(n_models, n_targets)``.
        auc: per-target ROC AUC of the scores, members = models with the target in, non-members =
            the others; NaN when one side has no finite score. Shape ``(n_targets,)``.
        tpr: per-target TPR at FPR ``fpr`` (largest TPR over the thresholds whose FPR <= fpr).
        fpr: the false-positive rate of ``tpr`` (the paper's 0.1).
        seed: the seed the audit was run with.
        model_seeds: the training seed passed to ``train_fn`` for each model, ``(n_models,)``.
        replacement: specific setup only: ``replacement[k, j]`` is the index into ``reference``
            of the record swapped in for target ``j`` in model ``k`` (-1 where the target is
            in); None for the average setup.
        n_nonfinite: how many scores were NaN / infinite (dropped from the per-target metrics).
        attack: ``"threshold"`` (``scores`` are the ``score_fn`` scores) or ``"lira"`` /
            ``"lira_offline"`` (``scores`` are LiRA scores of the ``score_fn`` statistic, each
            model in turn the target; :func:`specific` says against which shadow models).

    Examples:
        >>> import torch
        >>> from privmon.audit import specific
        >>> data = torch.randn(30, 2, generator=torch.Generator().manual_seed(0))
        >>> def nearest(model, x, y):  # the model memorizes its records: near ones are members
        ...     return -torch.cdist(x, model).min(dim=1).values
        >>> result = specific(
        ...     lambda x, y, seed: x, data[:20], [0, 1, 2], reference=data[20:], n_models=4, seed=0,
        ...     score_fn=nearest,
        ... )
        >>> result.n_models, result.n_targets, result.mask.sum(axis=0)
        (4, 3, array([2, 2, 2]))
        >>> result.risk("auc"), result.ranking()
        (array([1., 1., 1.]), array([0, 1, 2]))
    """

    setup: str
    targets: np.ndarray
    mask: np.ndarray
    scores: np.ndarray
    auc: np.ndarray
    tpr: np.ndarray
    fpr: float
    seed: int
    model_seeds: np.ndarray
    replacement: np.ndarray | None = None
    n_nonfinite: int = 0
    attack: str = "threshold"
    elapsed_s: float = field(default=0.0, compare=False)

    def __eq__(self, other: object) -> bool:
        """Equal when every field but ``elapsed_s`` is equal (arrays elementwise, NaN == NaN)."""
        if not isinstance(other, AuditResult):
            return NotImplemented
        names = [f for f in self.__dataclass_fields__ if f != "elapsed_s"]
        return _fields_equal(self, other, names)

    __hash__ = None  # type: ignore[assignment]

    @property
    def n_models(self) -> int:
        """Number of models trained (rows of ``mask``)."""
        return int(self.mask.shape[0])

    @property
    def n_targets(self) -> int:
        """Number of target records (columns of ``mask``)."""
        return int(self.mask.shape[1])

    def risk(self, metric: str = "auc") -> np.ndarray:
        """The per-target risk under ``metric``: ``"auc"`` or ``"tpr"`` (TPR at ``fpr``)."""
        return self.auc if check_choice(metric, _METRICS, name="metric") == "auc" else self.tpr

    def ranking(self, metric: str = "auc") -> np.ndarray:
        """Positions (0 .. n_targets-1) sorted from the riskiest target down; NaN risks last.

        Ties keep target order (stable sort), so the ranking is deterministic."""
        r = self.risk(metric)
        key = np.where(np.isnan(r), -np.inf, r)
        return np.argsort(-key, kind="stable")

    def table(self, top: int | None = 10, metric: str = "auc") -> str:
        """A text table of the ``top`` riskiest targets (all when None), sorted by ``metric``."""
        order = self.ranking(metric)
        if top is not None:
            order = order[: max(int(top), 0)]
        n_in = self.mask.sum(axis=0)
        tpr_head = f"TPR@{self.fpr:g}"
        lines = [f"{'rank':>4} {'target':>7} {'AUC':>6} {tpr_head:>9} {'in':>4} {'out':>4}"]
        for rank, j in enumerate(order, start=1):
            lines.append(
                f"{rank:>4} {int(self.targets[j]):>7} {self.auc[j]:>6.3f} {self.tpr[j]:>9.3f} "
                f"{int(n_in[j]):>4} {self.n_models - int(n_in[j]):>4}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"AuditResult(setup={self.setup!r}, n_models={self.n_models}, "
            f"n_targets={self.n_targets}, seed={self.seed}, "
            f"mean_auc={np.nanmean(self.auc) if self.n_targets else float('nan'):.4f}, "
            f"mean_tpr@{self.fpr:g}={np.nanmean(self.tpr) if self.n_targets else float('nan'):.4f})"
        )


@dataclass(frozen=True, repr=False, eq=False)
class SetupComparison:
    """The §3.4 comparison of the per-target risks of the specific and the average setup.

    Attributes:
        metric: ``"auc"``, ``"tpr"``, or ``"custom"`` when plain arrays were compared.
        threshold: T; a record is high-risk in a setup when its risk is >= T.
        miss_rate: (number of records high-risk in the specific setup and low-risk in the
            average one) / (number of records high-risk in the specific setup); NaN when no
            record is high-risk in the specific setup.
        n_high_risk, n_missed: the denominator and the numerator of ``miss_rate``.
        rmse: sqrt(mean_x (R_avg(x) - R_spec(x))^2).
        pearson: Pearson correlation of R_avg and R_spec (NaN if either is constant).
        std_ratio: sqrt(var(R_avg) / var(R_spec)), the Pearson correlation that §6 Theorem 1
            predicts when the average risk is the mean of the specific risks (compare with
            ``pearson``, as in Table 3).
        mean_specific, mean_average: the mean risks (equal in expectation under that hypothesis).
        high_risk, missed: boolean masks over the compared records.
        n_compared: records compared (those with a finite risk in both setups).
        n_dropped: records left out because a risk was NaN / infinite.

    Examples:
        >>> import numpy as np
        >>> from privmon.audit import compare
        >>> comparison = compare(np.array([0.9, 0.85, 0.6, 0.9]), np.array([0.7, 0.82, 0.6, 0.75]))
        >>> comparison.high_risk, comparison.missed  # R_spec >= 0.8; R_spec >= 0.8 > R_avg
        (array([ True,  True, False,  True]), array([ True, False, False,  True]))
        >>> round(comparison.rmse, 3), comparison.n_compared
        (0.126, 4)
    """

    metric: str
    threshold: float
    miss_rate: float
    n_high_risk: int
    n_missed: int
    rmse: float
    pearson: float
    std_ratio: float
    mean_specific: float
    mean_average: float
    high_risk: np.ndarray
    missed: np.ndarray
    n_compared: int
    n_dropped: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SetupComparison):
            return NotImplemented
        return _fields_equal(self, other, list(self.__dataclass_fields__))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"SetupComparison(metric={self.metric!r}, threshold={self.threshold:g}, "
            f"miss_rate={self.miss_rate:.4f} ({self.n_missed}/{self.n_high_risk}), "
            f"rmse={self.rmse:.4f}, pearson={self.pearson:.4f}, std_ratio={self.std_ratio:.4f}, "
            f"n_compared={self.n_compared})"
        )

    def summary(self) -> str:
        """A few human-readable lines with every figure."""
        mr = "n/a (no high-risk record)" if math.isnan(self.miss_rate) else f"{self.miss_rate:.3f}"
        return "\n".join(
            [
                f"metric {self.metric}, high-risk when risk >= {self.threshold:g}",
                f"  high-risk in the specific setup: {self.n_high_risk} of {self.n_compared}",
                f"  missed by the average setup:     {self.n_missed}   miss rate {mr}",
                f"  RMSE(average, specific):         {self.rmse:.4f}",
                f"  Pearson correlation:             {self.pearson:.4f}"
                f"   (Theorem 1 predicts sqrt(var ratio) = {self.std_ratio:.4f})",
                f"  mean risk specific / average:    {self.mean_specific:.4f} / "
                f"{self.mean_average:.4f}",
            ]
        )


def _risk_array(r: Any, metric: str, *, name: str) -> np.ndarray:
    if isinstance(r, AuditResult):
        return np.asarray(r.risk(metric), dtype=np.float64)
    try:
        arr = np.asarray(r.detach().cpu() if isinstance(r, torch.Tensor) else r, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an AuditResult or an array of per-record risks") from None
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of risks, got shape {arr.shape}")
    return arr


def compare(
    specific_result: AuditResult | Any,
    average_result: AuditResult | Any,
    *,
    threshold: float | None = None,
    metric: str = "auc",
) -> SetupComparison:
    """Compare the per-record risks of the specific and the average setup (§3.4).

    With R_spec(x) and R_avg(x) the risks of record x in the two setups (both under ``metric``),
    and a record high-risk in a setup when its risk is >= T (``threshold``), low-risk otherwise:

    * miss rate = |{x : R_spec(x) >= T and R_avg(x) < T}| / |{x : R_spec(x) >= T}|, the
      fraction of the records high-risk in the specific setup that the average setup classifies
      as low-risk (NaN when no record is high-risk in the specific setup);
    * RMSE = sqrt((1/N) * sum_x (R_avg(x) - R_spec(x))^2);
    * Pearson = sum_x (R_avg(x) - mean_avg)(R_spec(x) - mean_spec) /
      sqrt(sum_x (R_avg(x) - mean_avg)^2 * sum_x (R_spec(x) - mean_spec)^2), NaN when either
      risk is constant;
    * and, from §6 Theorem 1, ``std_ratio = sqrt(var(R_avg) / var(R_spec))``: if the average
      risk is the mean of the specific risks over datasets, the expected Pearson correlation
      equals it (Table 3 compares the two).

    The measures are specific to the metric and are not comparable across metrics (§3.4). Our
    copy of the paper lost the comparison sign of "high-risk"; a risk equal to T counts as
    high-risk, in both setups alike.

    Args:
        specific_result, average_result: :class:`AuditResult` of :func:`specific` and of
            :func:`average` over the same records in the same order, or 1-D arrays of
            per-record risks.
        threshold: T, in [0, 1] for audit results (finite for arrays). Default: 0.8 for
            ``"auc"``, 0.6 for ``"tpr"`` (the paper's, §4.1).
        metric: ``"auc"`` or ``"tpr"`` (TPR at the results' ``fpr``); ignored for arrays.

    Records whose risk is NaN / infinite in either setup are left out (``n_dropped``).

    Examples:
        >>> import numpy as np
        >>> from privmon.audit import compare
        >>> specific_auc = np.array([0.95, 0.85, 0.6, 0.55, 0.9])
        >>> average_auc = np.array([0.7, 0.82, 0.6, 0.5, 0.75])
        >>> comparison = compare(specific_auc, average_auc)  # high risk: an AUC >= 0.8
        >>> comparison.n_high_risk, comparison.n_missed, round(comparison.miss_rate, 2)
        (3, 2, 0.67)
        >>> round(comparison.pearson, 2), round(comparison.std_ratio, 2)
        (0.84, 0.69)
    """
    metric = check_choice(metric, _METRICS, name="metric")
    both = isinstance(specific_result, AuditResult) and isinstance(average_result, AuditResult)
    any_result = isinstance(specific_result, AuditResult) or isinstance(average_result, AuditResult)
    if isinstance(specific_result, AuditResult) and specific_result.setup != "specific":
        raise ValueError(
            f"specific_result comes from the {specific_result.setup!r} setup; pass "
            "compare(specific_result, average_result)"
        )
    if isinstance(average_result, AuditResult) and average_result.setup != "average":
        raise ValueError(
            f"average_result comes from the {average_result.setup!r} setup; pass "
            "compare(specific_result, average_result)"
        )
    if both and specific_result.fpr != average_result.fpr and metric == "tpr":
        raise ValueError(
            f"the results use different fpr ({specific_result.fpr} vs {average_result.fpr}); "
            "their TPRs are not comparable"
        )
    spec = _risk_array(specific_result, metric, name="specific_result")
    avg = _risk_array(average_result, metric, name="average_result")
    if spec.shape != avg.shape:
        raise ValueError(
            f"specific_result and average_result must cover the same records: got {spec.size} "
            f"and {avg.size} risks"
        )
    if threshold is None:
        threshold = _DEFAULT_THRESHOLD[metric]
    if any_result:  # an AUC or a TPR: outside [0, 1] every record, or none, is high-risk
        thr = check_unit(threshold, name="threshold")
    else:  # risks of the caller's own metric
        thr = check_open_interval(threshold, name="threshold", low=-math.inf, high=math.inf)

    ok = np.isfinite(spec) & np.isfinite(avg)
    n_dropped = int((~ok).sum())
    spec, avg = spec[ok], avg[ok]
    if spec.size == 0:
        raise ValueError("no record has a finite risk in both setups")
    high = spec >= thr
    missed = high & (avg < thr)
    n_high, n_missed = int(high.sum()), int(missed.sum())
    miss_rate = n_missed / n_high if n_high else math.nan
    rmse = float(np.sqrt(np.mean((avg - spec) ** 2)))
    da, ds = avg - avg.mean(), spec - spec.mean()
    saa, sss = float(np.sum(da * da)), float(np.sum(ds * ds))
    # A constant array has an undefined correlation (tested exactly, as scipy does: its float
    # mean need not equal its value, which would leave a spurious tiny variance).
    avg_const, spec_const = bool(np.all(avg == avg[0])), bool(np.all(spec == spec[0]))
    pearson = math.nan
    if not (avg_const or spec_const):
        pearson = min(1.0, max(-1.0, float(np.sum(da * ds) / math.sqrt(saa * sss))))
    std_ratio = math.nan if spec_const else (0.0 if avg_const else math.sqrt(saa / sss))
    return SetupComparison(
        metric=metric if any_result else "custom",
        threshold=thr,
        miss_rate=float(miss_rate),
        n_high_risk=n_high,
        n_missed=n_missed,
        rmse=rmse,
        pearson=pearson,
        std_ratio=std_ratio,
        mean_specific=float(spec.mean()),
        mean_average=float(avg.mean()),
        high_risk=frozen(high),
        missed=frozen(missed),
        n_compared=int(spec.size),
        n_dropped=n_dropped,
    )
