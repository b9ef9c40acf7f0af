"""MLflow sink: each report's scalars as MLflow metrics at the check's step (early stopping's
decision and LOSS TNR among them), the budget, each decision and the most vulnerable records by
LT-IQR as run tags, and the run's early-stopping outcome (tags and metrics) at its end.

``mlflow`` (or ``mlflow-skinny``) is imported at the first write, never by ``import privmon``:
``pip install 'privmon[mlflow]'``, which also installs what MLflow 3's default store,
``sqlite:///mlflow.db``, needs (SQLAlchemy, Alembic). Any tracking backend works.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

from privmon._validation import check_optional_str
from privmon.report import Report, tags
from privmon.report.stopping import StoppingOutcome, budget_text
from privmon.sinks.base import finite_scalars
from privmon.sinks.exposed import vulnerable_rows

__all__ = ["MlflowSink", "mlflow_key"]

_BATCH = 1000  # MLflow's limit on metrics per log_batch call

logger = logging.getLogger("privmon")


def mlflow_key(tag: str) -> str:
    """A privmon tag as a valid MLflow metric name: ``@`` becomes ``_at_``, any other character
    MLflow refuses becomes ``_`` (it allows letters, digits and ``_ - . : / space`` only).

    Examples:
        >>> from privmon.sinks.mlflow import mlflow_key
        >>> mlflow_key("privacy/loss/tpr@fpr=0.01")
        'privacy/loss/tpr_at_fpr_0.01'
    """
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", tag.replace("@", "_at_"))


class MlflowSink:
    """Log every report's finite scalars to an MLflow run.

    The sink never starts or ends a run: ``MlflowSink()`` logs to the run active at each write
    (``with mlflow.start_run(): ...``), or to the one named. Metric names go through
    :func:`mlflow_key` (``privacy/loss/tpr@fpr=0.01`` becomes ``privacy/loss/tpr_at_fpr_0.01``);
    NaN / infinite values are left out. The MLflow run is tagged ``privmon.run_id`` with the
    monitor's run id; MLflow cannot tell apart two privmon runs logged into one MLflow run, so
    the sink warns, naming both, when the tag already names another (start one MLflow run per
    monitor run).

    Args:
        run_id: the run to log to; ``None`` logs to the run active at each write
            (``mlflow.start_run()``).
        tracking_uri: the tracking server or store; ``None`` uses MLflow's current one
            (``mlflow.set_tracking_uri`` / ``MLFLOW_TRACKING_URI``).

    Examples:
        >>> import os
        >>> import tempfile
        >>> from pathlib import Path
        >>> from unittest import mock
        >>> import mlflow
        >>> from privmon.report import Report
        >>> from privmon.sinks import MlflowSink
        >>> report = Report(step=100, scalars={"privacy/loss/tpr@fpr=0.01": 0.02}, run_id="demo")
        >>> with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(
        ...     os.environ, MLFLOW_ALLOW_FILE_STORE="true"  # a file store, for the example
        ... ):
        ...     uri = Path(tmp).as_uri()
        ...     client = mlflow.MlflowClient(tracking_uri=uri)
        ...     run = client.create_run(client.create_experiment("demo"))
        ...     MlflowSink(run_id=run.info.run_id, tracking_uri=uri).write(report)
        ...     client.get_run(run.info.run_id).data.metrics
        {'privacy/loss/tpr_at_fpr_0.01': 0.02}
    """

    def __init__(self, *, run_id: str | None = None, tracking_uri: str | None = None) -> None:
        self.run_id = check_optional_str(run_id, name="run_id")
        self.tracking_uri = check_optional_str(tracking_uri, name="tracking_uri")
        self._client: Any = None
        self._tagged: dict[str, str] = {}  # MLflow run -> the privmon run id tagged on it
        self._last_step: int | None = None

    def _mlflow(self) -> Any:
        try:
            import mlflow
        except ImportError as err:
            raise ImportError(
                "privmon.sinks.MlflowSink needs MLflow: pip install 'privmon[mlflow]'"
            ) from err
        return mlflow

    def _target(self) -> tuple[Any, str]:
        mlflow = self._mlflow()
        if self._client is None:
            self._client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        run_id = self.run_id
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise RuntimeError(
                    "MlflowSink has no run to log to: start one with mlflow.start_run() or "
                    "pass MlflowSink(run_id=...)"
                )
            run_id = active.info.run_id
        return self._client, run_id

    def write(self, report: Report) -> None:
        """Log the report's finite scalars at ``report.step`` (one ``log_batch`` per 1,000),
        early stopping's numbers among them (``privacy/stopping/…``: threshold, figure, stop,
        wait); at a run's first report, tag the MLflow run with its run id
        (:data:`~privmon.report.tags.MLFLOW_RUN_ID_TAG`); with early stopping, tag it with the
        budget (``privmon.stopping.budget``) and this check's decision and why
        (``privmon.stopping.decision``); with loss traces, tag it with each source's most
        vulnerable records by LT-IQR at this check (``privmon.lt_iqr.<source>``: "index
        (score)", highest first)."""
        client, run_id = self._target()
        if report.run_id and self._tagged.get(run_id) != report.run_id:
            before = client.get_run(run_id).data.tags.get(tags.MLFLOW_RUN_ID_TAG)
            if before is not None and before != report.run_id:
                logger.warning(
                    "privmon: MLflow run %s already holds the figures of privmon run %s; run %s "
                    "is logged into it too, at the same steps, and MLflow cannot tell them "
                    "apart: start one MLflow run per monitor run",
                    run_id,
                    before,
                    report.run_id,
                )
            client.set_tag(run_id, tags.MLFLOW_RUN_ID_TAG, report.run_id)
            self._tagged[run_id] = report.run_id
        self._log(client, run_id, finite_scalars(report), int(report.step))
        for source, found in vulnerable_rows(report).items():  # the last check's, by LT-IQR
            listed = ", ".join(f"{i} ({v:.4g})" for _, i, v in found)
            client.set_tag(run_id, mlflow_key(f"{tags.MLFLOW_LT_IQR_TAG}.{source}"), listed)
        d = report.stopping
        if d is not None:
            budget = budget_text(d.tag, d.threshold, d.use, d.patience)
            client.set_tag(run_id, f"{tags.MLFLOW_STOPPING_TAG}.budget", budget)
            client.set_tag(run_id, f"{tags.MLFLOW_STOPPING_TAG}.decision", d.text(report.step))
        self._last_step = int(report.step)

    def _log(self, client: Any, run_id: str, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(tag), value, now, step) for tag, value in scalars.items()]
        for i in range(0, len(metrics), _BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + _BATCH])

    def write_outcome(self, outcome: StoppingOutcome) -> None:
        """The run's early-stopping outcome: the run tag ``privmon.stopping.outcome`` (its
        sentence) and its finite numbers as metrics (``privacy/stopping/stopped``, ``…/highest``
        …) at the last step written (nothing before any)."""
        if self._last_step is None:
            return
        client, run_id = self._target()
        client.set_tag(run_id, f"{tags.MLFLOW_STOPPING_TAG}.outcome", outcome.sentence())
        finite = {k: v for k, v in outcome.scalars().items() if math.isfinite(v)}
        self._log(client, run_id, finite, self._last_step)

    def close(self) -> None:
        """Nothing to release: the run stays open for its owner to end."""
