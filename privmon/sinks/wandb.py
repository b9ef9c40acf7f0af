"""Weights & Biases sink: each check's figures (early stopping's decision among them), ROC, ε chart,
most exposed records and most vulnerable records (LT-IQR) in a W&B run; the budget in its config,
each decision and the run's early-stopping outcome in its summary.

``wandb`` is imported when the sink is made, never by ``import privmon``:
``pip install 'privmon[wandb]'``. The sink never starts, finishes or configures a run beyond
its own keys: the run is the user's (``wandb.init``), as with any other W&B logging of the loop.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from privmon._validation import check_flag, check_has_methods, check_str
from privmon.estimators import roc_curve
from privmon.report import Report, tags
from privmon.report.stopping import StoppingOutcome
from privmon.sinks.base import finite_scalars
from privmon.sinks.exposed import COLUMNS, VULNERABLE_COLUMNS, ExposedRecords, vulnerable_rows

__all__ = ["WandbSink"]

logger = logging.getLogger("privmon")

ROC_POINTS = 1000
"""At most this many points of each ROC curve are logged (W&B tables hold 10,000 rows): evenly
spaced along the curve, its two ends kept."""


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            "privmon.sinks.WandbSink needs Weights & Biases: pip install 'privmon[wandb]'"
        ) from err
    return wandb


class WandbSink:
    """Log every check to a Weights & Biases run.

    At each check, one ``run.log`` call holds: every finite scalar of the report under its tag
    (NaN / infinite values are left out, as by the other loggers), the check's training step
    under :data:`~privmon.report.tags.WANDB_STEP`, against which every ``privacy/`` figure is
    drawn (``define_metric``, so the figures line up with the training steps whatever W&B's own
    step counter is); per query the ROC of the membership posterior as a line chart
    (:func:`~privmon.report.tags.roc`, at most 1,000 points along the curve) and, with
    ``log_records``, the most exposed member records as a table
    (:func:`~privmon.report.tags.most_exposed`: rank, member index, risk, times among the most
    exposed; indices and risks only, never records); and, when the checks have an ε (the
    accountant's or a measured lower bound), the ε chart over the checks so far
    (:data:`~privmon.report.tags.EPSILON_CHART`). The sink logs without W&B's ``step=``: each
    check adds one W&B step, as the Hugging Face and Lightning W&B loggers do.

    The monitor writes its sinks on rank 0 only, and a sink's failure (no run, a finished run)
    is logged, never raised out of a check (``strict=True`` re-raises). The W&B run's config
    gets :data:`~privmon.report.tags.WANDB_RUN_ID_KEY`, the privmon run id; a second privmon run
    logged into the same W&B run is warned about. The sink keeps each check's ε figures (a few
    numbers a check) for the ε chart, and how often each member record was among the most
    exposed.

    Args:
        run: the W&B run (``wandb.init()``'s result) to log to; ``None`` (default) logs to the
            run active at each write (``wandb.run``). The sink never starts a run itself: with
            none active, the check's write fails with an error that says to call
            ``wandb.init()`` (logged), and the training goes on.
        prefix: put before every key (e.g. ``"audit/"``), step axis included.
        log_records: log the tables of the most exposed member records and of the most
            vulnerable records by LT-IQR (default True).

    Examples:
        >>> import os
        >>> import tempfile
        >>> from unittest import mock
        >>> import wandb
        >>> from privmon.report import Report
        >>> from privmon.sinks import WandbSink
        >>> report = Report(step=100, scalars={"privacy/loss/auc": 0.61}, run_id="demo")
        >>> with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(
        ...     os.environ, WANDB_MODE="offline", WANDB_DIR=tmp, WANDB_SILENT="true"
        ... ):  # an offline run, for the example: no server, no key
        ...     with wandb.init(project="demo") as run:
        ...         WandbSink(run).write(report)
        ...         dict(run.summary)["privacy/loss/auc"], dict(run.summary)["privacy/step"]
        (0.61, 100)
    """

    def __init__(self, run: Any = None, *, prefix: str = "", log_records: bool = True) -> None:
        self._wandb = _wandb()
        if run is not None:
            check_has_methods(
                run, "log", "define_metric", name="run", expected="a wandb Run (wandb.init())"
            )
        self.run = run
        self.prefix = check_str(prefix, name="prefix")
        self.log_records = check_flag(log_records, name="log_records")
        self._defined: set[int] = set()  # the W&B runs (by id()) given the privmon step axis
        self._epsilon: dict[str, list[tuple[int, float]]] = {}  # tag -> (step, value) per check
        self._exposed = ExposedRecords()
        self._last_step: int | None = None

    def _target(self) -> Any:
        run = self.run if self.run is not None else self._wandb.run
        if run is None:
            raise RuntimeError(
                "WandbSink has no run to log to: start one with wandb.init() or pass "
                "WandbSink(run=...)"
            )
        return run

    def _first_write(self, run: Any, report: Report) -> None:
        """The privmon step axis, and the privmon run id in the W&B run's config."""
        step = self.prefix + tags.WANDB_STEP
        run.define_metric(step)
        run.define_metric(self.prefix + tags.WANDB_FIGURES, step_metric=step)
        before = run.config.get(tags.WANDB_RUN_ID_KEY)
        if before is not None and before != report.run_id:
            logger.warning(
                "privmon: W&B run %s already holds the figures of privmon run %s; run %s is "
                "logged into it too, and its checks go on the same step axis: start one W&B run "
                "per monitor run",
                getattr(run, "id", run),
                before,
                report.run_id,
            )
        run.config.update({tags.WANDB_RUN_ID_KEY: report.run_id}, allow_val_change=True)
        d = report.stopping
        if d is not None:  # the budget: the figure, its use, the threshold, the patience
            budget = {"tag": d.tag, "use": d.use, "threshold": d.threshold, "patience": d.patience}
            run.config.update({tags.WANDB_STOPPING_KEY: budget}, allow_val_change=True)
        self._defined.add(id(run))

    def write(self, report: Report) -> None:
        """Log the report's figures, ROC curves, most exposed records and the ε chart in one
        ``run.log`` call at the step axis :data:`~privmon.report.tags.WANDB_STEP` =
        ``report.step``."""
        run = self._target()
        if id(run) not in self._defined:
            self._first_write(run, report)
        p, step = self.prefix, int(report.step)
        scalars = finite_scalars(report)
        data: dict[str, Any] = {p + tag: value for tag, value in scalars.items()}
        data[p + tags.WANDB_STEP] = step
        for name, q in report.queries.items():
            if q.member_posterior is not None and q.nonmember_posterior is not None:
                chart = self._roc(name, q.member_posterior, q.nonmember_posterior, step)
                if chart is not None:
                    data[p + tags.roc(name)] = chart
        if self.log_records:
            for name, rows in self._exposed.rows(report).items():
                table = [[r.rank, r.index, r.risk, r.times] for r in rows]
                data[p + tags.most_exposed(name)] = self._wandb.Table(
                    columns=list(COLUMNS), data=table
                )
            for source, found in vulnerable_rows(report).items():
                data[p + tags.most_vulnerable(source)] = self._wandb.Table(
                    columns=list(VULNERABLE_COLUMNS), data=[list(r) for r in found]
                )
        epsilon = [t for t in scalars if t == tags.EPSILON or tags.is_epsilon_lower_bound(t)]
        for tag in epsilon:
            self._epsilon.setdefault(tag, []).append((step, scalars[tag]))
        if epsilon:
            data[p + tags.EPSILON_CHART] = self._epsilon_chart()
        run.log(data)
        if report.stopping is not None:  # the decision and why, in words
            run.summary[f"{tags.WANDB_STOPPING_KEY}/decision"] = report.stopping.text(step)
        self._last_step = step

    def write_outcome(self, outcome: StoppingOutcome) -> None:
        """The run's early-stopping outcome: its sentence in the run's summary
        (``privmon_stopping/outcome``) and its finite numbers logged once at the last step
        written (``privacy/stopping/stopped``, ``…/highest`` …; nothing before any write)."""
        if self._last_step is None:
            return
        run, p = self._target(), self.prefix
        numbers = {p + k: v for k, v in outcome.scalars().items() if math.isfinite(v)}
        run.log({**numbers, p + tags.WANDB_STEP: self._last_step})
        run.summary[f"{tags.WANDB_STOPPING_KEY}/outcome"] = outcome.sentence()

    def _roc(self, name: str, member: np.ndarray, nonmember: np.ndarray, step: int) -> Any:
        """The ROC of the posterior ("member when the posterior is at least t") as a W&B line
        chart, or None without finite posteriors on both sides."""
        member, nonmember = member[np.isfinite(member)], nonmember[np.isfinite(nonmember)]
        if not len(member) or not len(nonmember):
            return None
        fpr, tpr, _ = roc_curve(member, nonmember)
        if len(fpr) > ROC_POINTS:
            keep = np.unique(np.linspace(0, len(fpr) - 1, ROC_POINTS).round().astype(int))
            fpr, tpr = fpr[keep], tpr[keep]
        return self._wandb.plot.line_series(
            xs=fpr.tolist(),
            ys=[tpr.tolist()],
            keys=["membership posterior"],
            title=f"{name}: ROC of the membership posterior at step {step}",
            xname="false positive rate",
        )

    def _epsilon_chart(self) -> Any:
        """ε over the checks: each ε figure (its finite values), its own line."""
        return self._wandb.plot.line_series(
            xs=[[s for s, _ in v] for v in self._epsilon.values()],
            ys=[[x for _, x in v] for v in self._epsilon.values()],
            keys=list(self._epsilon),
            title="ε: accountant vs measured lower bounds",
            xname="training step",
        )

    def close(self) -> None:
        """Nothing to release: the run stays open for its owner to finish."""
