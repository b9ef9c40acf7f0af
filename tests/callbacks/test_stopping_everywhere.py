"""A stop is said where the figures are (issue #38, point 3): a run whose budget stops it and one
whose budget never does each leave the budget (figure and threshold), each check's decision and
the stop itself (step, figure, value, reason) — or that it never stopped, with the highest
certified figure and its step — in TensorBoard (a threshold series and a text entry), the JSON
lines, MLflow, W&B, the framework loggers (Lightning, Hugging Face, Ignite), the HTML report (a
marked line on the chart and a sentence in the verdict) and the console; an adapter's restore
of earlier weights (``monitor.say_restored``) reaches them too."""

from __future__ import annotations

import html
import json
import logging
import math
import re
import typing
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingSink
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util
from torch import nn

from privmon import PrivacyEarlyStopping, PrivacyMonitor
from privmon.queries import CallableQuery, LossQuery
from privmon.report import checks_from_reports, read_checks, render_html, tags, verdict
from privmon.report.figures import advantage_figure
from privmon.sinks import JsonlSink

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVERY, STEPS = 10, 40  # checks at 10, 20, 30, 40
TAG = "privacy/s/histogram/lower"
STOP_AT = 20  # a clear leak above a budget of 0.05, patience 1: the second check stops
LOW, HIGH = 0.05, 0.95  # a budget the leak crosses, and one it never reaches


def _sets():
    g = torch.Generator().manual_seed(0)
    members, nonmembers = torch.randn(300, generator=g) + 1.0, torch.randn(300, generator=g)
    return [members[:150], members[150:]], [nonmembers[:150], nonmembers[150:]]


LEAK = {"shift": 0.0}  # the members' extra shift: the leak grows over the run


def _monitor(threshold, *, writer=None, sinks=()):
    members, nonmembers = _sets()

    def score(batch):
        return batch + LEAK["shift"] if any(batch is m for m in members) else batch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget out of the certificate's reach warns
        return PrivacyMonitor(
            CallableQuery(score, name="s"),
            members,
            nonmembers,
            every_n_steps=EVERY,
            methods=("histogram",),
            planned_checks=STEPS // EVERY,
            writer=writer,
            sinks=list(sinks),
            early_stopping=PrivacyEarlyStopping("s/histogram", threshold, patience=1),
            strict=True,
        )


def _loop(monitor):
    """The training loop: step until the monitor says stop; then close it."""
    for step in range(1, STEPS + 1):
        LEAK["shift"] = step / STEPS
        if monitor.step(step):
            break
    monitor.close()
    return monitor


@pytest.fixture(params=["stop", "no stop"])
def budget(request):
    return request.param


def _threshold(budget):
    return LOW if budget == "stop" else HIGH


def _steps(budget):
    return [10, 20] if budget == "stop" else [10, 20, 30, 40]


def _highest(monitor):
    lower = monitor.history.column(TAG)
    return float(lower.max()), int(monitor.history.steps[int(lower.argmax())])


# --- the decision on the report -----------------------------------------------------------------
def test_each_report_carries_the_decision_taken_before_the_sinks_wrote_it(budget):
    seen = []

    class Probe:  # what a sink is handed: the decision is already on it
        def write(self, report):
            seen.append(report.stopping)

        def close(self):
            pass

    monitor = _loop(_monitor(_threshold(budget), sinks=[Probe()]))
    assert [d.tag for d in seen] == [TAG] * len(_steps(budget))
    assert all(d.threshold == _threshold(budget) and d.patience == 1 for d in seen)
    for d, report in zip(seen, monitor.history, strict=True):
        assert d.value == pytest.approx(report.scalars[TAG], rel=1e-6)
        assert report.scalars[tags.STOPPING_THRESHOLD] == _threshold(budget)
        assert report.scalars[tags.STOPPING_STOP] == float(d.stop)
    if budget == "stop":
        assert [d.stop for d in seen] == [False, True]
        assert [d.wait for d in seen] == [1, 2] and seen[-1].stopped_step == STOP_AT
        assert seen[0].reason.startswith("above the budget for 1 check(s), within the patience")
        assert "above the budget 0.0500 for 2 consecutive check(s)" in seen[-1].reason
        assert seen[-1].last_within is None  # no check was within the budget
    else:
        assert not any(d.stop for d in seen) and {d.reason for d in seen} == {"within the budget"}
        assert seen[-1].last_within == 40
    outcome = monitor.stopping_outcome
    assert (outcome.highest, outcome.highest_step) == pytest.approx(_highest(monitor), rel=1e-6)
    assert outcome.stopped_step == (STOP_AT if budget == "stop" else None)


# --- the console --------------------------------------------------------------------------------
def test_the_console_says_the_stop_or_that_none_came_with_the_highest_figure(budget, caplog):
    with caplog.at_level(logging.WARNING, logger="privmon"):
        monitor = _loop(_monitor(_threshold(budget)))
    lines = [r.getMessage() for r in caplog.records]
    value, step = _highest(monitor)
    if budget == "stop":
        assert any(m.startswith(f"privmon: early stopping at step {STOP_AT} — ") for m in lines)
        said = [m for m in lines if m.startswith("privmon: Early stopping stopped training")]
        assert len(said) == 1 and f"at step {STOP_AT}: {TAG} = " in said[0]
        assert "budget privacy/s/histogram/lower (certified lower bound) ≤ 0.0500" in said[0]
    else:
        (said,) = [m for m in lines if "Early stopping never fired" in m]
        assert (
            "over 4 checks: budget privacy/s/histogram/lower (certified lower bound) ≤ 0.9500"
            in said
        )
        assert f"the highest certified figure was {value:.4f}, at step {step}" in said


# --- TensorBoard --------------------------------------------------------------------------------
def _acc(folder):
    acc = event_accumulator.EventAccumulator(
        str(folder), size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    )
    acc.Reload()
    return acc


def _texts(acc, tag):
    return [
        (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)
    ]


def test_tensorboard_has_a_threshold_series_and_a_text_of_each_decision_and_the_outcome(
    budget, tmp_path
):
    kept = RecordingSink()  # the reports whole (the history keeps the last one's decision)
    monitor = _loop(_monitor(_threshold(budget), writer=str(tmp_path), sinks=[kept]))
    steps = _steps(budget)
    main = _acc(tmp_path)
    stop = [e.value for e in main.Scalars(tags.STOPPING_STOP)]
    assert stop == ([0.0, 1.0] if budget == "stop" else [0.0] * 4)
    threshold = _acc(tmp_path / tags.SERIES_THRESHOLD)  # a run of its own: the named series
    glance = tags.glance_advantage("s", "histogram")
    events = threshold.Scalars(glance)
    assert [(e.step, e.value) for e in events] == [
        (s, np.float32(_threshold(budget))) for s in steps
    ]
    texts = _texts(main, tags.STOPPING_EVENT_TAG)
    decisions, (outcome,) = texts[:-1], texts[-1:]
    assert [s for s, _ in decisions] == steps
    for (step, text), report in zip(decisions, kept.reports, strict=True):
        assert text == report.stopping.text(step)
        assert text.startswith(f"{report.stopping.word} at step {step}: {TAG} = ")
    assert outcome == (steps[-1], monitor.stopping_outcome.sentence())
    # read back by privmon report from the event files alone
    checks = read_checks(tmp_path)
    assert checks.outcome == {"sentence": monitor.stopping_outcome.sentence()}
    assert checks.records[-1]["stopping"]["tag"] == TAG
    assert verdict(checks).details[0] == verdict(checks_from_reports(monitor.history)).details[0]


# --- JSON lines ---------------------------------------------------------------------------------
def test_json_lines_hold_each_decision_and_a_line_of_the_outcome(budget, tmp_path):
    path = tmp_path / "checks.jsonl"
    monitor = _loop(_monitor(_threshold(budget), sinks=[JsonlSink(path)]))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    checks, (end,) = lines[:-1], lines[-1:]
    assert [c["stopping"]["decision"] for c in checks] == (
        ["continue", "stop"] if budget == "stop" else ["continue"] * 4
    )
    for c in checks:
        assert c["stopping"]["tag"] == TAG and c["stopping"]["threshold"] == _threshold(budget)
        assert c["scalars"][tags.STOPPING_FIGURE] == c["scalars"][TAG]
    assert set(end) == {"run_id", tags.STOPPING_OUTCOME_KEY} and end["run_id"] == monitor.run_id
    said = end[tags.STOPPING_OUTCOME_KEY]
    assert said["sentence"] == monitor.stopping_outcome.sentence()
    assert said["stopped_step"] == (STOP_AT if budget == "stop" else None)
    value, step = _highest(monitor)
    assert (said["highest"], said["highest_step"]) == (pytest.approx(value, rel=1e-6), step)
    read = read_checks(tmp_path)  # the report reads the outcome back, the checks untouched
    assert read.steps == _steps(budget) and read.outcome["sentence"] == said["sentence"]


# --- MLflow -------------------------------------------------------------------------------------
def test_mlflow_tags_the_budget_each_decision_and_the_outcome(budget, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from privmon.sinks import MlflowSink

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    client = mlflow.MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("stop")).info.run_id
    monitor = _loop(
        _monitor(_threshold(budget), sinks=[MlflowSink(run_id=run_id, tracking_uri=uri)])
    )
    run = client.get_run(run_id)
    prefix = tags.MLFLOW_STOPPING_TAG
    assert run.data.tags[f"{prefix}.budget"] == (
        f"{TAG} (certified lower bound) ≤ {_threshold(budget):.4f}, patience 1"
    )
    last = monitor.history[-1]
    assert run.data.tags[f"{prefix}.decision"] == last.stopping.text(last.step)
    assert run.data.tags[f"{prefix}.outcome"] == monitor.stopping_outcome.sentence()
    stop = {m.step: m.value for m in client.get_metric_history(run_id, tags.STOPPING_STOP)}
    assert stop == ({10: 0.0, 20: 1.0} if budget == "stop" else dict.fromkeys(_steps(budget), 0.0))
    threshold = client.get_metric_history(run_id, tags.STOPPING_THRESHOLD)
    assert {m.value for m in threshold} == {_threshold(budget)}
    stopped = client.get_metric_history(run_id, tags.STOPPING_STOPPED)
    assert [(m.step, m.value) for m in stopped] == [(_steps(budget)[-1], float(budget == "stop"))]
    highest = client.get_metric_history(run_id, tags.STOPPING_HIGHEST)
    assert highest[0].value == pytest.approx(_highest(monitor)[0], rel=1e-6)


# --- W&B ----------------------------------------------------------------------------------------
def test_wandb_has_the_budget_in_its_config_each_decision_and_the_outcome(
    budget, tmp_path, monkeypatch
):
    wandb = pytest.importorskip("wandb")
    from wandb_files import OfflineRun, read_items, read_records

    from privmon.sinks import WandbSink

    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                       "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    run = wandb.init(project="privmon-test", dir=str(tmp_path))
    monitor = _loop(_monitor(_threshold(budget), sinks=[WandbSink(run)]))
    run.finish()
    wandb.teardown()  # the service process writes the run's file: wait until it is done
    (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{run.id}")
    written = OfflineRun(run_dir)
    assert written.config[tags.WANDB_STOPPING_KEY] == {
        "tag": TAG, "use": "lower", "threshold": _threshold(budget), "patience": 1,
    }  # fmt: skip
    checks = {row[tags.WANDB_STEP]: row for row in written.rows if tags.STOPPING_STOP in row}
    assert [checks[s][tags.STOPPING_STOP] for s in _steps(budget)] == (
        [0.0, 1.0] if budget == "stop" else [0.0] * 4
    )
    (end,) = [row for row in written.rows if tags.STOPPING_STOPPED in row]
    assert end[tags.STOPPING_STOPPED] == float(budget == "stop")
    assert end[tags.STOPPING_HIGHEST] == pytest.approx(_highest(monitor)[0], rel=1e-6)
    summary = {}
    for record in read_records(next(run_dir.glob("run-*.wandb"))):
        if record.HasField("summary"):
            summary.update(read_items(record.summary.update))
    key = tags.WANDB_STOPPING_KEY
    assert summary[f"{key}/outcome"] == monitor.stopping_outcome.sentence()
    last = monitor.history[-1]
    assert summary[f"{key}/decision"] == last.stopping.text(last.step)


# --- the HTML report ----------------------------------------------------------------------------
def test_the_html_report_marks_the_budget_on_the_chart_and_says_it_in_the_verdict(budget, tmp_path):
    pytest.importorskip("matplotlib")
    _loop(_monitor(_threshold(budget), sinks=[JsonlSink(tmp_path / "checks.jsonl")]))
    checks = read_checks(tmp_path)
    said = verdict(checks).details[0]
    if budget == "stop":
        assert said.startswith(f"Early stopping stopped training at step {STOP_AT} (budget: {TAG}")
        assert "above 0.0500 for 2 consecutive check(s)" in said
    else:
        value, step = max((r["scalars"][TAG], r["step"]) for r in checks.records)
        assert said == (
            "Early stopping never fired over 4 checks (budget: privacy/s/histogram/lower "
            "(certified lower bound) ≤ 0.9500, patience 1); the highest certified figure was "
            f"{value:.4f}, at step {step}."
        )
    page = html.unescape(re.sub(r"<[^>]+>", "", render_html(checks)))  # the text a reader sees
    assert said in page
    ax = advantage_figure(checks, "s", None).axes[0]
    assert ax.get_title() == "s: advantage estimate, certified lower bound and stopping threshold"
    lines = {line.get_label(): line for line in ax.lines}
    mark = lines[f"stopping threshold {_threshold(budget):g}"]
    assert set(mark.get_ydata()) == {_threshold(budget)}
    assert ("early stop, step 20" in lines) == (budget == "stop")


# --- a restore said by an adapter ---------------------------------------------------------------
def test_a_restore_reaches_the_sinks_and_the_verdict(tmp_path, caplog):
    monitor = _monitor(LOW, writer=str(tmp_path), sinks=[JsonlSink(tmp_path / "checks.jsonl")])
    for step in range(1, STEPS + 1):
        LEAK["shift"] = step / STEPS
        if monitor.step(step):
            break
    with caplog.at_level(logging.WARNING, logger="privmon"):
        monitor.say_restored(step=10)  # as a synthesizer adapter does after the stop
    monitor.close()
    said = "The weights of step 10 were restored."
    assert monitor.stopping_outcome.restored_step == 10
    assert any(said in r.getMessage() for r in caplog.records)
    lines = (tmp_path / "checks.jsonl").read_text().splitlines()
    outcomes = [json.loads(line)[tags.STOPPING_OUTCOME_KEY] for line in lines[-2:]]
    assert [o["restored_step"] for o in outcomes] == [10, 10]  # the restore, then the close
    checks = read_checks(tmp_path)
    assert verdict(checks).details[0].endswith(said)
    _, text = _texts(_acc(tmp_path), tags.STOPPING_EVENT_TAG)[-1]
    assert text.endswith(said)
    with pytest.raises(ValueError, match="step"):
        monitor.say_restored(step=-1)


# --- the framework loggers ----------------------------------------------------------------------
N_TRAIN, BATCH, MAX_STEPS = 64, 16, 8


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(128, 6, generator=g), torch.randint(0, 2, (128,), generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def _model_monitor(model, budget, *, as_dict=False):
    x, y = _data()

    def batch(lo, hi):
        return {"x": x[lo:hi], "labels": y[lo:hi]} if as_dict else (x[lo:hi], y[lo:hi])

    # the AUC is above 0 at every check; no certified bound is above 1
    metric, threshold = ("privacy/loss/auc", 0.0) if budget == "stop" else ("loss/histogram", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyMonitor(
            LossQuery(model),
            [batch(0, N_TRAIN)],
            [batch(N_TRAIN, 128)],
            every_n_steps=2,
            methods=("histogram",),
            early_stopping=PrivacyEarlyStopping(metric, threshold, patience=1),
        )


def _expect_logged(logged, budget):
    """The framework logger's entries: each check's decision, then the outcome at the end."""
    decisions = [  # (the outcome's entry in Ignite's metrics keeps the last check's too)
        (s, m[tags.STOPPING_STOP])
        for s, m in logged
        if tags.STOPPING_STOP in m and tags.STOPPING_STOPPED not in m
    ]
    assert decisions == ([(2, 0.0), (4, 1.0)] if budget == "stop" else [(2, 0.0), (4, 0.0),
                         (6, 0.0), (8, 0.0)])  # fmt: skip
    assert all(
        m[tags.STOPPING_THRESHOLD] in (0.0, 1.0) for s, m in logged if tags.STOPPING_STOP in m
    )
    (end,) = [m for _, m in logged if tags.STOPPING_STOPPED in m]
    assert end[tags.STOPPING_STOPPED] == float(budget == "stop")
    assert math.isfinite(end[tags.STOPPING_HIGHEST]) and end[tags.STOPPING_HIGHEST_STEP] in (
        2,
        4,
        6,
        8,
    )
    assert (tags.STOPPING_STOPPED_STEP in end) == (budget == "stop")


def test_lightning_loggers_get_each_decision_and_the_outcome(budget):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import Logger

    from privmon.integrations.lightning import PrivacyMonitorCallback

    class Keep(Logger):
        name, version = "keep", 0
        logged: typing.ClassVar[list] = []

        def log_metrics(self, metrics, step=None):
            self.logged.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lit, keep = Lit(), Keep()
    keep.logged = []
    monitor = _model_monitor(lit.net, budget)
    x, y = _data()
    trainer = pl.Trainer(
        max_steps=MAX_STEPS, logger=keep, callbacks=[PrivacyMonitorCallback(monitor)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BATCH
    )
    trainer.fit(lit, loader)
    monitor.close()
    _expect_logged(keep.logged, budget)


def test_transformers_log_history_gets_each_decision_and_the_outcome(budget, tmp_path):
    hf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from privmon.integrations.transformers import attach

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"logits": logits, "loss": F.cross_entropy(logits, labels)}

    model = Tiny()
    monitor = _model_monitor(model.net, budget, as_dict=True)
    x, y = _data()
    args = hf.TrainingArguments(
        output_dir=str(tmp_path), max_steps=MAX_STEPS, per_device_train_batch_size=BATCH,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    train = [{"x": x[i], "labels": y[i]} for i in range(N_TRAIN)]
    trainer = hf.Trainer(model=model, args=args, train_dataset=train)
    attach(trainer, monitor, console="none")
    trainer.train()
    monitor.close()
    _expect_logged([(log.get("step"), log) for log in trainer.state.log_history], budget)


def test_ignite_state_metrics_get_each_decision_and_the_outcome(budget):
    engine_module = pytest.importorskip("ignite.engine")
    from privmon.integrations.ignite import attach

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def update(engine, batch):
        opt.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    engine = engine_module.Engine(update)
    monitor = _model_monitor(model, budget)
    logged = []
    attach(engine, monitor)

    @engine.on(engine_module.Events.ITERATION_COMPLETED)
    def keep(engine):
        logged.append((engine.state.iteration, dict(engine.state.metrics)))

    @engine.on(engine_module.Events.COMPLETED)
    def end(engine):
        logged.append((engine.state.iteration, dict(engine.state.metrics)))

    x, y = _data()
    engine.run(
        [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, N_TRAIN, BATCH)], max_epochs=2
    )
    monitor.close()
    # the metrics stay until the next check: keep one entry per check, then the end's
    per_check = {s: m for s, m in logged[:-1] if s % 2 == 0 and tags.STOPPING_STOP in m}
    _expect_logged([*per_check.items(), logged[-1]], budget)
