"""MlflowSink against a real local MLflow file store, read back with ``mlflow.MlflowClient``;
the :class:`privmon.sinks.Sink` protocol."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from conftest import traced_run
from torch import nn

from privmon import PrivacyMonitor
from privmon.queries import LossQuery
from privmon.report import Report, tags
from privmon.report.tags import MLFLOW_RUN_ID_TAG
from privmon.sinks import JsonlSink, MlflowSink, Sink, TensorBoardSink, finite_scalars
from privmon.sinks.mlflow import mlflow_key

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A file store (MLflow 3 keeps it behind an opt-in flag) and a run in it."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("privmon-test"))
    return uri, client, run.info.run_id


def _history(client, run_id, key):
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_monitor_figures_reach_the_mlflow_run_at_each_check_step(store):
    uri, client, run_id = store
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2))
    x, y = torch.randn(120, 5), torch.randint(0, 2, (120,))
    members = [(x[i : i + 30], y[i : i + 30]) for i in range(0, 60, 30)]
    nonmembers = [(x[i : i + 30], y[i : i + 30]) for i in range(60, 120, 30)]
    monitor = PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        every_n_steps=2,
        methods=("histogram",),
        sinks=[MlflowSink(run_id=run_id, tracking_uri=uri)],
        strict=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, 7):
        for xb, yb in members:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        monitor.step(step)
    monitor.close()
    assert [r.step for r in monitor.history] == [2, 4, 6]
    logged = client.get_run(run_id).data.metrics  # the latest value of each key
    expected_keys = {mlflow_key(k) for k in finite_scalars(monitor.history[-1])}
    assert expected_keys <= set(logged) and len(expected_keys) >= 10
    for tag in finite_scalars(monitor.history[-1]):
        by_step = _history(client, run_id, mlflow_key(tag))
        # float64: exact (the sink got whole reports; the history keeps float32 figures)
        assert by_step == pytest.approx({r.step: r.scalars[tag] for r in monitor.history}, rel=1e-7)
        assert by_step[6] == monitor.history[-1].scalars[tag], tag
    assert client.get_run(run_id).info.status == "RUNNING"  # the sink never ends the run
    assert client.get_run(run_id).data.tags[MLFLOW_RUN_ID_TAG] == monitor.run_id


def test_a_second_privmon_run_in_one_mlflow_run_is_said(store, caplog):
    # MLflow keeps every value at a step: two privmon runs in one MLflow run cannot be told
    # apart afterwards, so the sink says so, naming both.
    uri, client, run_id = store
    first, second = "f6" * 16, "a7" * 16
    with caplog.at_level(logging.WARNING, logger="privmon"):
        for rid in (first, first):  # one run, written by two sinks (a resumed run): no warning
            MlflowSink(run_id=run_id, tracking_uri=uri).write(
                Report(1, {"privacy/a": 0.5}, run_id=rid)
            )
        assert caplog.text == ""
        assert client.get_run(run_id).data.tags[MLFLOW_RUN_ID_TAG] == first
        MlflowSink(run_id=run_id, tracking_uri=uri).write(
            Report(1, {"privacy/a": 0.1}, run_id=second)
        )
    assert f"MLflow run {run_id} already holds the figures of privmon run {first}" in caplog.text
    assert f"run {second} is logged into it too" in caplog.text
    assert client.get_run(run_id).data.tags[MLFLOW_RUN_ID_TAG] == second


def test_keys_are_made_valid_and_non_finite_values_left_out(store):
    uri, client, run_id = store
    report = Report(
        step=7,
        scalars={
            "privacy/loss/tpr@fpr=0.01": 0.25,
            "privacy/loss/histogram/epsilon_lower_bound": math.inf,
            "privacy/loss/auc": float("nan"),
            "privacy/loss/histogram/value": 0.125,
        },
    )
    MlflowSink(run_id=run_id, tracking_uri=uri).write(report)
    assert mlflow_key("privacy/loss/tpr@fpr=0.01") == "privacy/loss/tpr_at_fpr_0.01"
    assert client.get_run(run_id).data.metrics == {
        "privacy/loss/tpr_at_fpr_0.01": 0.25,
        "privacy/loss/histogram/value": 0.125,
    }
    assert _history(client, run_id, "privacy/loss/histogram/value") == {7: 0.125}


def test_active_run_is_used_and_missing_run_is_an_error(store, tmp_path):
    uri, client, _ = store
    sink = MlflowSink(tracking_uri=uri)
    report = Report(step=3, scalars={"privacy/loss/auc": 0.75})
    with pytest.raises(RuntimeError, match=r"mlflow.start_run\(\) or pass MlflowSink\(run_id"):
        sink.write(report)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run() as run:
            sink.write(report)
    finally:
        mlflow.set_tracking_uri(previous)
    assert _history(client, run.info.run_id, "privacy/loss/auc") == {3: 0.75}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"run_id": ""}, "run_id must be None or a non-empty"), ({"tracking_uri": 3}, "tracking_uri")],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MlflowSink(**kwargs)


def test_sink_protocol_is_structural(tmp_path):
    class PrintSink:
        def __init__(self):
            self.steps = []

        def write(self, report):
            self.steps.append(report.step)

        def close(self):
            pass

    sinks = [PrintSink(), MlflowSink(), JsonlSink(tmp_path / "x.jsonl"), TensorBoardSink(tmp_path)]
    assert all(isinstance(s, Sink) for s in sinks)
    assert not isinstance(object(), Sink)
    scores = np.linspace(0, 1, 40)
    monitor = PrivacyMonitor(
        _split_query(scores), [0], [1], every_n_steps=1, methods=("histogram",), sinks=[sinks[0]]
    )
    monitor.step(1)
    assert sinks[0].steps == [1]


def _split_query(scores):
    """A minimal query object: callable with a string name; batch 0 members, 1 non-members."""

    class Query:
        name = "q"

        def __call__(self, batch):
            half = len(scores) // 2
            return torch.as_tensor(scores[:half] if batch == 0 else scores[half:])

    return Query()


def test_loss_tnr_and_the_most_vulnerable_records_reach_the_mlflow_run(store):
    """LOSS TNR as metrics at each check's step; the last check's most vulnerable records by
    LT-IQR, per source, as run tags ("index (score)", highest first)."""
    uri, client, run_id = store
    _, reports = traced_run([MlflowSink(run_id=run_id, tracking_uri=uri)])
    key = mlflow_key(tags.loss_tnr("loss", 0.001))
    want = {r.step: r.scalars[tags.loss_tnr("loss", 0.001)] for r in reports}
    assert _history(client, run_id, key) == pytest.approx(want)
    run_tags = client.get_run(run_id).data.tags
    for source, top in reports[-1].vulnerable.items():
        listed = run_tags[mlflow_key(f"{tags.MLFLOW_LT_IQR_TAG}.{source}")]
        assert listed == ", ".join(
            f"{i} ({v:.4g})" for i, v in zip(top.records, top.scores, strict=True)
        )
