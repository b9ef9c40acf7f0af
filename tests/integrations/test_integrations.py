"""The framework adapters, run with the real frameworks: PyTorch Lightning, Hugging Face
transformers (a real ``Trainer`` on a tiny torch model, nothing downloaded) and PyTorch-Ignite.

Each framework test checks that checks ran at the expected steps (``monitor.history``), that the
privacy tags are in the event files (read back with TensorBoard's EventAccumulator), that an
early-stopping budget that must trip stops training before ``max_steps`` (the framework's own final
step), and — for Lightning, transformers and Ignite checkpoints — that a resumed run continues the
monitor's history and early-stopping counters with no step checked twice.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingSink
from sklearn.datasets import load_breast_cancer
from tensorboard.backend.event_processing import event_accumulator
from torch import nn

from privmon import PrivacyEarlyStopping, PrivacyMonitor, detectable_advantage
from privmon.estimators.spending import check_delta
from privmon.queries import LossQuery

EVERY = 5
MAX_STEPS = 30
BATCH = 10
N_TRAIN = 100  # 10 batches per epoch
TAGS = ("privacy/loss/histogram/value", "privacy/loss/histogram/lower", "privacy/loss/auc")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def data():
    x, y = load_breast_cancer(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y).long()


def _mlp():
    return nn.Sequential(nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 2))


def _audit(x, y, as_dict=False):
    """Audit sets: 100 training records (members), 100 never trained on (non-members)."""

    def batches(lo, hi):
        out = []
        for i in range(lo, hi, 50):
            xb, yb = x[i : min(i + 50, hi)], y[i : min(i + 50, hi)]
            out.append({"x": xb, "labels": yb} if as_dict else (xb, yb))
        return out

    return batches(0, N_TRAIN), batches(300, 400)


def _budget(patience):
    """A budget that must trip: the AUC is above 0 unless every member scores below every
    non-member."""
    return PrivacyEarlyStopping("privacy/loss/auc", 0.0, patience=patience)


def _reports(monitor):
    return next(s for s in monitor.sinks if isinstance(s, RecordingSink)).reports


def _monitor(model, data, logdir=None, patience=None, as_dict=False, planned_checks=None):
    members, nonmembers = _audit(*data, as_dict=as_dict)
    return PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        every_n_steps=EVERY,
        methods=("histogram",),
        writer=None if logdir is None else str(logdir),
        early_stopping=None if patience is None else _budget(patience),
        sinks=RecordingSink(),
        planned_checks=planned_checks,
        strict=True,
    )


def _assert_planned(monitor, planned):
    """Every check certified at the share of a run of ``planned`` checks (one figure per
    check: one query, one method), and reports what that share detects on 100 + 100 records."""
    assert monitor.planned_checks == planned
    for k, report in enumerate(_reports(monitor), 1):
        share = check_delta(k, delta=monitor.interval_delta, planned_checks=planned)
        assert report.scalars["privacy/certify_delta"] == share
        assert report.scalars["privacy/loss/detectable"] == detectable_advantage(
            N_TRAIN, N_TRAIN, delta=share
        )


def _event_steps(logdir, tag):
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _assert_event_files(logdir, steps):
    for tag in TAGS:
        assert _event_steps(logdir, tag) == steps, tag


def _steps(monitor):
    return [r.step for r in monitor.history]


def _expected(last):
    return list(range(EVERY, last + 1, EVERY))


def test_import_privmon_needs_no_framework():
    code = (
        "import sys, privmon, privmon.integrations, privmon.sinks; "
        "mods = ('lightning', 'pytorch_lightning', 'transformers', 'ignite', 'matplotlib', "
        "'wandb', 'mlflow'); "
        "print([m for m in mods if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# --------------------------------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pl():
    return pytest.importorskip("lightning.pytorch")


def _lit(pl):
    class LitMLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            # The checks leave the module in the mode Lightning put it in.
            assert self.training and self.net[0].training
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LitMLP()


def _trainer(pl, callbacks, max_steps=MAX_STEPS, **kw):
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=kw.pop("logger", False),
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        **kw,
    )


def _loader(data):
    x, y = data
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BATCH, shuffle=True
    )


def test_lightning_checks_and_event_files(pl, data, tmp_path):
    from privmon.integrations.lightning import PrivacyMonitorCallback

    pl.seed_everything(0, verbose=False)
    lit = _lit(pl)
    monitor = _monitor(lit, data, logdir=tmp_path / "tb")
    trainer = _trainer(pl, [PrivacyMonitorCallback(monitor)])
    trainer.fit(lit, _loader(data))
    monitor.close()
    assert trainer.global_step == MAX_STEPS
    assert _steps(monitor) == _expected(MAX_STEPS)
    _assert_event_files(tmp_path / "tb", _expected(MAX_STEPS))
    assert lit.training  # the last check left the module in train mode
    _assert_planned(monitor, MAX_STEPS // EVERY)  # from trainer.max_steps


def test_lightning_plans_from_the_epochs_and_keeps_a_users_plan(pl, data):
    from privmon.integrations.lightning import PrivacyMonitorCallback

    pl.seed_everything(0, verbose=False)
    lit = _lit(pl)
    monitor = _monitor(lit, data)
    # no max_steps: 2 epochs of 10 batches, trainer.estimated_stepping_batches = 20
    _trainer(pl, [PrivacyMonitorCallback(monitor)], max_steps=-1, max_epochs=2).fit(
        lit, _loader(data)
    )
    assert _steps(monitor) == _expected(20)
    _assert_planned(monitor, 20 // EVERY)

    # max_steps far beyond what the epochs allow: the epochs end the run, and the plan
    bounded = _monitor(lit, data)
    _trainer(pl, [PrivacyMonitorCallback(bounded)], max_steps=1000, max_epochs=2).fit(
        lit, _loader(data)
    )
    assert _steps(bounded) == _expected(20)
    _assert_planned(bounded, 20 // EVERY)

    mine = _monitor(lit, data, planned_checks=3)
    with pytest.warns(UserWarning, match=r"planned_checks=3 is kept, but .* has 4 checks"):
        _trainer(pl, [PrivacyMonitorCallback(mine)], max_steps=-1, max_epochs=2).fit(
            lit, _loader(data)
        )
    assert mine.planned_checks == 3
    # the 4th check is beyond the user's plan: the overflow share
    assert _reports(mine)[3].scalars["privacy/certify_delta"] == check_delta(
        4, delta=mine.interval_delta, planned_checks=3
    )


def test_lightning_early_stopping_stops_the_trainer(pl, data):
    from privmon.integrations.lightning import PrivacyMonitorCallback

    pl.seed_everything(0, verbose=False)
    lit = _lit(pl)
    monitor = _monitor(lit, data, patience=1)  # trips at the second check
    trainer = _trainer(pl, [PrivacyMonitorCallback(monitor)])
    trainer.fit(lit, _loader(data))
    assert trainer.should_stop
    assert trainer.global_step == 2 * EVERY < MAX_STEPS
    assert _steps(monitor) == [EVERY, 2 * EVERY]
    assert monitor.early_stopping.stopped_step == 2 * EVERY


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_lightning_resume_from_checkpoint_continues_the_history(pl, data, tmp_path):
    from privmon.integrations.lightning import PrivacyMonitorCallback

    # Run 1: 15 steps, a checkpoint every 10 (ModelCheckpoint runs after the monitor's hook, so
    # the step-10 checkpoint holds the step-10 check). patience=3 would stop at the 4th check.
    pl.seed_everything(0, verbose=False)
    lit = _lit(pl)
    first = _monitor(lit, data, patience=3)
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=10, save_top_k=-1
    )
    _trainer(
        pl, [PrivacyMonitorCallback(first), ckpt], max_steps=15, enable_checkpointing=True
    ).fit(lit, _loader(data))
    assert _steps(first) == [5, 10, 15] and not first.should_stop
    path = tmp_path / "ckpt" / "step=10.ckpt"
    assert path.is_file()
    saved = torch.load(path, weights_only=False)["callbacks"]
    saved_history = next(iter(saved.values()))["monitor"]["history"]
    assert saved_history["fields"]["steps"].tolist() == [5, 10]

    # Run 2: a new module, monitor and Trainer resumed from the step-10 checkpoint.
    lit2 = _lit(pl)
    second = _monitor(lit2, data, patience=3)
    trainer = _trainer(pl, [PrivacyMonitorCallback(second)], max_steps=MAX_STEPS)
    # the checkpoint restores the monitor before on_train_start: the run's plan of 3 checks
    # (15 steps) goes on, although the resumed Trainer runs to 30 steps
    with pytest.warns(UserWarning, match=r"has 6 checks .* under planned_checks=3, which is kept"):
        trainer.fit(lit2, _loader(data), ckpt_path=str(path))
    assert first.planned_checks == second.planned_checks == 3
    steps = _steps(second)
    assert steps == [5, 10, 15, 20]  # restored 5, 10; then 15, 20 — no step twice
    assert len(set(steps)) == len(steps)
    for a, b in zip(first.history[:2], second.history[:2], strict=True):
        assert a.scalars == b.scalars
    # The early-stopping wait came back too: 2 checks above budget before the checkpoint, so the
    # 4th check (step 20) trips patience=3 — a fresh counter would have run to max_steps.
    assert trainer.global_step == 20
    assert second.early_stopping.stopped_step == 20


# --------------------------------------------------------------------------------------------------
# Hugging Face transformers
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("accelerate")  # the Trainer needs it with PyTorch
    return pytest.importorskip("transformers")


class TinyClassifier(nn.Module):
    """A transformers-style model without pretrained weights: returns {"loss", "logits"}."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _hf_trainer(
    hf, model, data, callbacks, output_dir, max_steps=MAX_STEPS, save_steps=None, report_to=()
):
    args = hf.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        report_to=list(report_to),
        use_cpu=True,
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or 500,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    x, y = data
    return hf.Trainer(
        model=model,
        args=args,
        train_dataset=DictDataset(x[:N_TRAIN], y[:N_TRAIN]),
        callbacks=callbacks,
    )


def _mode_probe(hf):
    class ModeProbe(hf.TrainerCallback):
        """Runs after the monitor's callback: the model must still be in train mode."""

        def __init__(self):
            self.modes = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.modes.append(model.training)

    return ModeProbe()


def test_transformers_checks_and_event_files(hf, data, tmp_path):
    from privmon.integrations.transformers import PrivacyMonitorCallback

    model = TinyClassifier()
    monitor = _monitor(model, data, logdir=tmp_path / "tb", as_dict=True)
    probe = _mode_probe(hf)
    trainer = _hf_trainer(hf, model, data, [PrivacyMonitorCallback(monitor), probe], tmp_path)
    trainer.train()
    monitor.close()
    assert trainer.state.global_step == MAX_STEPS
    assert _steps(monitor) == _expected(MAX_STEPS)
    _assert_event_files(tmp_path / "tb", _expected(MAX_STEPS))
    assert probe.modes == [True] * MAX_STEPS
    _assert_planned(monitor, MAX_STEPS // EVERY)  # from state.max_steps


def test_transformers_early_stopping_stops_the_trainer(hf, data, tmp_path):
    from privmon.integrations.transformers import PrivacyMonitorCallback

    model = TinyClassifier()
    monitor = _monitor(model, data, patience=1, as_dict=True)
    trainer = _hf_trainer(hf, model, data, [PrivacyMonitorCallback(monitor)], tmp_path)
    trainer.train()
    assert trainer.state.global_step == 2 * EVERY < MAX_STEPS
    assert _steps(monitor) == [EVERY, 2 * EVERY]


def test_transformers_resume_from_checkpoint(hf, data, tmp_path):
    from privmon.integrations.transformers import STATE_FILE, PrivacyMonitorCallback

    model = TinyClassifier()
    first = _monitor(model, data, patience=3, as_dict=True)
    cb = PrivacyMonitorCallback(first)
    _hf_trainer(hf, model, data, [cb], tmp_path, max_steps=15, save_steps=10).train()
    assert _steps(first) == [5, 10, 15]
    folder = tmp_path / "checkpoint-10"
    assert (folder / STATE_FILE).is_file()

    model2 = TinyClassifier()
    second = _monitor(model2, data, patience=3, as_dict=True)
    trainer = _hf_trainer(hf, model2, data, [PrivacyMonitorCallback(second)], tmp_path)
    with pytest.warns(UserWarning, match=r"has 6 checks .* under planned_checks=3, which is kept"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert first.planned_checks == second.planned_checks == 3  # the run's plan goes on
    assert _steps(second) == [5, 10, 15, 20]  # restored, then continued; no step twice
    for a, b in zip(first.history[:2], second.history[:2], strict=True):
        assert a.scalars == b.scalars
    assert trainer.state.global_step == 20  # the restored wait trips patience=3 at step 20


# --------------------------------------------------------------------------------------------------
# PyTorch-Ignite
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ignite():
    return pytest.importorskip("ignite.engine")


def _engine(ignite, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def update(engine, batch):
        assert model.training  # the checks leave the model in train mode
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return ignite.Engine(update), opt


def test_ignite_checks_event_files_and_handle(ignite, data, tmp_path):
    from privmon.integrations.ignite import attach

    torch.manual_seed(0)
    model = _mlp().train()
    monitor = _monitor(model, data, logdir=tmp_path / "tb")
    engine, _ = _engine(ignite, model)
    handle = attach(engine, monitor)
    engine.run(_loader(data), max_epochs=MAX_STEPS * BATCH // N_TRAIN)
    monitor.close()
    assert engine.state.iteration == MAX_STEPS
    assert _steps(monitor) == _expected(MAX_STEPS)
    _assert_event_files(tmp_path / "tb", _expected(MAX_STEPS))
    _assert_planned(monitor, MAX_STEPS // EVERY)  # max_epochs × epoch_length
    fn = handle.handler()
    assert engine.has_event_handler(fn, ignite.Events.ITERATION_COMPLETED)
    handle.remove()
    assert not engine.has_event_handler(fn, ignite.Events.ITERATION_COMPLETED)

    # on a filtered event the handler sees some iterations only: the run's length would plan
    # more checks than it gets, so the checks are left unplanned
    sparse = _monitor(model, data)
    engine, _ = _engine(ignite, model)
    attach(engine, sparse, ignite.Events.ITERATION_COMPLETED(every=2 * EVERY))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first step seen is past every_n_steps
        engine.run(_loader(data), max_epochs=MAX_STEPS * BATCH // N_TRAIN)
    assert _steps(sparse) == _expected(MAX_STEPS)[1::2]
    assert sparse.planned_checks is None


def test_ignite_early_stopping_terminates(ignite, data):
    from privmon.integrations.ignite import attach

    torch.manual_seed(0)
    model = _mlp().train()
    monitor = _monitor(model, data, patience=1)
    engine, _ = _engine(ignite, model)
    attach(engine, monitor, event=ignite.Events.ITERATION_COMPLETED)
    engine.run(_loader(data), max_epochs=MAX_STEPS * BATCH // N_TRAIN)
    assert engine.state.iteration == 2 * EVERY < MAX_STEPS
    assert _steps(monitor) == [EVERY, 2 * EVERY]


def test_ignite_checkpoint_carries_the_monitor(ignite, data, tmp_path):
    from ignite.handlers import Checkpoint, DiskSaver

    from privmon.integrations.ignite import attach

    torch.manual_seed(0)
    model = _mlp().train()
    first = _monitor(model, data, patience=3)
    engine, opt = _engine(ignite, model)
    attach(engine, first)
    to_save = {"model": model, "optimizer": opt, "trainer": engine, "privmon": first}
    saver = Checkpoint(to_save, DiskSaver(tmp_path, require_empty=False), n_saved=None)
    engine.add_event_handler(ignite.Events.ITERATION_COMPLETED(every=10), saver)
    engine.run(_loader(data), max_epochs=1)  # 10 iterations: checks at 5, 10; one checkpoint
    assert _steps(first) == [5, 10]
    (path,) = sorted(tmp_path.glob("checkpoint_*.pt"))

    model2 = _mlp().train()
    second = _monitor(model2, data, patience=3)
    engine2, opt2 = _engine(ignite, model2)
    attach(engine2, second)
    to_load = {"model": model2, "optimizer": opt2, "trainer": engine2, "privmon": second}
    Checkpoint.load_objects(to_load, torch.load(path, weights_only=False))
    with pytest.warns(UserWarning, match=r"has 6 checks .* under planned_checks=2, which is kept"):
        engine2.run(_loader(data), max_epochs=MAX_STEPS * BATCH // N_TRAIN)
    assert first.planned_checks == second.planned_checks == 2  # the run's plan goes on
    assert _steps(second) == [5, 10, 15, 20]  # the restored wait trips patience=3 at 20
    assert engine2.state.iteration == 20


# --------------------------------------------------------------------------------------------------
# The figures reach the frameworks' own loggers (read back from the loggers' files)
# --------------------------------------------------------------------------------------------------
def _finite(report):
    return {k: v for k, v in report.scalars.items() if np.isfinite(v)}


def _event_scalars(logdir, prefix=""):
    """{tag: {step: value}} of every scalar in the event files under logdir."""
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        if tag.startswith(prefix):
            out[tag[len(prefix) :]] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def _assert_tb_matches(monitor, by_tag):
    """Every finite scalar of every report, at the report's step (float32 in event files)."""
    for report in monitor.history:
        for tag, value in _finite(report).items():
            assert by_tag[tag][report.step] == pytest.approx(value, rel=1e-6, abs=1e-7), tag


def test_lightning_writes_the_figures_to_every_trainer_logger(pl, data, tmp_path):
    import csv

    from privmon.integrations.lightning import PrivacyMonitorCallback

    pl.seed_everything(0, verbose=False)
    lit = _lit(pl)
    monitor = _monitor(lit, data)
    loggers = [
        pl.loggers.CSVLogger(tmp_path, name="csv", version=0),
        pl.loggers.TensorBoardLogger(tmp_path, name="tb", version=0),
    ]
    trainer = _trainer(pl, [PrivacyMonitorCallback(monitor)], logger=loggers, log_every_n_steps=1)
    trainer.fit(lit, _loader(data))
    assert _steps(monitor) == _expected(MAX_STEPS)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["privacy/loss/histogram/value"]]
    assert [int(r["step"]) for r in rows] == _expected(MAX_STEPS)  # the checks' global steps
    for row, report in zip(rows, _reports(monitor), strict=True):
        expected = _finite(report)
        assert len(expected) >= 10  # value, lower, plugin, upper, auc, tpr@fpr, risk/…
        assert {k: float(row[k]) for k in expected} == expected  # CSV keeps repr(): exact
    _assert_tb_matches(monitor, _event_scalars(tmp_path / "tb" / "version_0"))


def test_lightning_log_to_loggers_false_leaves_the_loggers_alone(pl, data, tmp_path):
    import csv

    from privmon.integrations.lightning import PrivacyMonitorCallback

    with pytest.raises(ValueError, match="log_to_loggers must be True or False"):
        PrivacyMonitorCallback(_monitor(_mlp(), data), log_to_loggers=1)
    pl.seed_everything(0, verbose=False)
    lit = _lit(pl)
    monitor = _monitor(lit, data)
    csv_logger = pl.loggers.CSVLogger(tmp_path, name="csv", version=0)
    callback = PrivacyMonitorCallback(monitor, log_to_loggers=False)
    trainer = _trainer(pl, [callback], logger=csv_logger, log_every_n_steps=1)
    trainer.fit(lit, _loader(data))
    assert _steps(monitor) == _expected(MAX_STEPS)
    path = tmp_path / "csv" / "version_0" / "metrics.csv"
    header = next(csv.reader(open(path, newline=""))) if path.exists() else []
    assert not [h for h in header if h.startswith("privacy/")]


def test_transformers_logs_through_the_trainer_to_log_history_and_report_to(hf, data, tmp_path):
    from privmon.integrations.transformers import attach

    model = TinyClassifier()
    monitor = _monitor(model, data, as_dict=True)
    trainer = _hf_trainer(hf, model, data, [], tmp_path, report_to=["tensorboard"])
    callback = attach(trainer, monitor)
    assert callback in trainer.callback_handler.callbacks
    trainer.train()
    assert _steps(monitor) == _expected(MAX_STEPS)
    logged = [e for e in trainer.state.log_history if "privacy/loss/histogram/value" in e]
    assert [e["step"] for e in logged] == _expected(MAX_STEPS)
    for entry, report in zip(logged, _reports(monitor), strict=True):
        expected = _finite(report)
        assert {k: entry[k] for k in expected} == expected
    (run_dir,) = (tmp_path / "runs").iterdir()  # TensorBoardCallback's default logging_dir
    # The HF TensorBoard integration prefixes training logs with "train/".
    _assert_tb_matches(monitor, _event_scalars(run_dir, "train/"))


def test_transformers_callback_without_trainer_warns_once_and_still_steps(
    hf, data, tmp_path, caplog
):
    from privmon.integrations.transformers import PrivacyMonitorCallback

    model = TinyClassifier()
    monitor = _monitor(model, data, as_dict=True)
    trainer = _hf_trainer(
        hf, model, data, [PrivacyMonitorCallback(monitor)], tmp_path, max_steps=10
    )
    with caplog.at_level("WARNING", logger="privmon"):
        trainer.train()
    assert _steps(monitor) == [5, 10]
    assert sum("does not know its Trainer" in r.message for r in caplog.records) == 1
    assert not [e for e in trainer.state.log_history if "privacy/loss/auc" in e]


def test_ignite_writes_the_figures_into_state_metrics_and_attached_loggers(ignite, data, tmp_path):
    from ignite.handlers.tensorboard_logger import OutputHandler, TensorboardLogger

    from privmon.integrations.ignite import attach

    torch.manual_seed(0)
    model = _mlp().train()
    monitor = _monitor(model, data)
    engine, _ = _engine(ignite, model)
    attach(engine, monitor)
    seen = {}  # what a handler attached after privmon's reads from state.metrics, per check
    engine.add_event_handler(
        ignite.Events.ITERATION_COMPLETED(every=EVERY),
        lambda e: seen.__setitem__(e.state.iteration, dict(e.state.metrics)),
    )
    tb = TensorboardLogger(log_dir=str(tmp_path / "tb"))
    tb.attach(
        engine,
        OutputHandler(tag="ignite", metric_names="all"),
        ignite.Events.ITERATION_COMPLETED(every=EVERY),
    )
    engine.run(_loader(data), max_epochs=MAX_STEPS * BATCH // N_TRAIN)
    tb.close()
    assert sorted(seen) == _expected(MAX_STEPS) == _steps(monitor)
    for report in _reports(monitor):
        expected = _finite(report)
        assert {k: seen[report.step][k] for k in expected} == expected
    assert {k: engine.state.metrics[k] for k in _finite(monitor.history[-1])} == _finite(
        monitor.history[-1]
    )
    _assert_tb_matches(monitor, _event_scalars(tmp_path / "tb", "ignite/"))


def test_logging_options_are_checked(hf, ignite, data):
    from privmon.integrations.ignite import attach as attach_ignite
    from privmon.integrations.transformers import PrivacyMonitorCallback, attach

    monitor = _monitor(TinyClassifier(), data, as_dict=True)
    with pytest.raises(ValueError, match=r"trainer must be a transformers\.Trainer"):
        attach(object(), monitor)
    with pytest.raises(ValueError, match=r"trainer must be a transformers\.Trainer"):
        PrivacyMonitorCallback(monitor, trainer="trainer")
    with pytest.raises(ValueError, match="log_to_trainer must be True or False"):
        PrivacyMonitorCallback(monitor, log_to_trainer="yes")
    engine, _ = _engine(ignite, _mlp())
    with pytest.raises(ValueError, match="metrics must be True or False"):
        attach_ignite(engine, monitor, metrics=None)


# Hugging Face console: a short line per check, everything in log_history
# --------------------------------------------------------------------------------------------------
def _console_run(hf, data, tmp_path, capsys, console, printer):
    """Train with the monitor attached; the printed lines that hold privmon figures, and the
    trainer. ``printer``: "tqdm" (ProgressCallback) or "print" (PrinterCallback)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from privmon.integrations.transformers import attach

    model = TinyClassifier()
    monitor = _monitor(model, data, as_dict=True)
    trainer = _hf_trainer(hf, model, data, [], tmp_path, max_steps=10)
    if printer == "tqdm":
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(ProgressCallback)
    attach(trainer, monitor, console=console)
    capsys.readouterr()
    trainer.train()
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if "privacy/" in ln]
    return lines, trainer, monitor


@pytest.mark.parametrize("printer", ["tqdm", "print"])
def test_transformers_console_shows_a_headline_line_and_log_history_keeps_everything(
    hf, data, tmp_path, capsys, printer
):
    from privmon.integrations.transformers import console_scalars

    lines, trainer, monitor = _console_run(hf, data, tmp_path, capsys, "headline", printer)
    assert len(lines) == 2  # one per check (steps 5 and 10)
    for line, report in zip(lines, _reports(monitor), strict=True):
        head = console_scalars(report)
        assert list(head) == ["privacy/loss/auc", "privacy/loss/adv", "privacy/loss/lower"]
        assert head["privacy/loss/adv"] == report.scalars["privacy/loss/histogram/value"]
        assert head["privacy/loss/lower"] == report.scalars["privacy/loss/histogram/lower"]
        assert all(k in line for k in head) and "'epoch'" in line
        assert "plugin_upper" not in line and len(line) < 200
    full = [e for e in trainer.state.log_history if "privacy/loss/histogram/value" in e]
    assert len(full) == 2
    for entry, report in zip(full, _reports(monitor), strict=True):
        expected = _finite(report)
        assert {k: entry[k] for k in expected} == expected  # every scalar, not the headline


def test_transformers_console_all_none_and_patterns(hf, data, tmp_path, capsys):
    lines, _, monitor = _console_run(hf, data, tmp_path / "all", capsys, "all", "print")
    assert len(lines) == 2 and all(k in lines[0] for k in _finite(_reports(monitor)[0]))
    lines, trainer, _ = _console_run(hf, data, tmp_path / "none", capsys, "none", "print")
    assert lines == []
    assert len([e for e in trainer.state.log_history if "privacy/loss/auc" in e]) == 2
    lines, _, _ = _console_run(hf, data, tmp_path / "pat", capsys, ["privacy/*/auc"], "print")
    assert len(lines) == 2 and all(ln.count("privacy/") == 1 for ln in lines)


def test_transformers_console_option_is_checked(hf, data):
    from privmon.integrations.transformers import PrivacyMonitorCallback

    monitor = _monitor(TinyClassifier(), data, as_dict=True)
    for bad in ("short", [], [""], 3):
        with pytest.raises(ValueError, match="console must be one of"):
            PrivacyMonitorCallback(monitor, console=bad)
