"""WandbSink against real offline W&B runs (``WANDB_MODE=offline``, ``WANDB_DIR`` in tmp_path:
no server, no key), read back from what the run wrote to disk (tests/wandb_files.py)."""

from __future__ import annotations

import logging
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RecordingSink, traced_run
from opacus.accountants import RDPAccountant
from torch import nn
from wandb_files import OfflineRun

import privmon
from privmon.queries import LossQuery
from privmon.report import tags
from privmon.sinks import WandbSink, finite_scalars
from privmon.sinks.wandb import ROC_POINTS

wandb = pytest.importorskip("wandb")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    def start():
        return wandb.init(project="privmon-test", dir=str(tmp_path))

    def finished(run):
        run.finish()
        wandb.teardown()  # the service process writes the run's file: wait until it is done
        # (after finish() alone the last records can still be in flight: seen with wandb 0.31)
        (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{run.id}")
        return OfflineRun(run_dir)

    return start, finished


def _train(sinks, *, accountant=None, steps=6):
    """A small classifier, a check every 2 steps; the whole reports kept by a RecordingSink."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 2))
    x, y = torch.randn(160, 5), torch.randint(0, 2, (160,))
    members = [(x[:40], y[:40]), (x[40:80], y[40:80])]
    nonmembers = [(x[80:120], y[80:120]), (x[120:], y[120:])]
    keep = RecordingSink()
    monitor = privmon.PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        every_n_steps=2,
        methods=("histogram",),
        sinks=[*sinks, keep],
        accountant=accountant,
        delta=1e-5,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, steps + 1):
        for xb, yb in members:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        if accountant is not None:
            accountant.step(noise_multiplier=1.0, sample_rate=0.01)
        monitor.step(step)
    monitor.close()
    return monitor, keep.reports


def test_every_figure_roc_records_and_epsilon_round_trip_through_an_offline_run(offline):
    start, finished = offline
    run = start()
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    monitor, reports = _train([WandbSink()], accountant=accountant)  # run=None: wandb.run
    written = finished(run)
    assert [r.step for r in reports] == [2, 4, 6]

    # the privmon step axis, and every privacy/ figure drawn against it
    defined = {(m.name, m.glob_name, m.step_metric) for m in written.metrics}
    assert (tags.WANDB_STEP, "", "") in defined
    assert ("", tags.WANDB_FIGURES, tags.WANDB_STEP) in defined
    assert written.config[tags.WANDB_RUN_ID_KEY] == monitor.run_id

    checks = written.checks()
    assert sorted(checks) == [2, 4, 6]
    times = Counter()
    epsilon_tags = set()
    for report in reports:
        row = checks[report.step]
        scalars = finite_scalars(report)
        assert len(scalars) >= 15 and tags.EPSILON in scalars
        assert {t: row[t] for t in scalars} == scalars  # float64 through JSON: exact
        assert not [t for t in report.scalars if t not in scalars and t in row]  # inf left out

        # the ROC of the membership posterior, as privmon.roc_curve draws it
        q = report.queries["loss"]
        columns, data = written.table(row, tags.roc("loss") + "_table")
        assert columns == ["step", "lineKey", "lineVal"]
        fpr, tpr, _ = privmon.roc_curve(q.member_posterior, q.nonmember_posterior)
        assert len(fpr) <= ROC_POINTS
        assert [d[0] for d in data] == pytest.approx(fpr.tolist())
        assert [d[2] for d in data] == pytest.approx(tpr.tolist())

        # the most exposed records: rank, index, risk, times among the most exposed so far
        times.update(q.top_records)
        columns, data = written.table(row, tags.most_exposed("loss"))
        assert columns == [
            "rank",
            "member index",
            "membership posterior",
            "times among the most exposed",
        ]
        assert data == [
            [rank, i, pytest.approx(r), times[i]]
            for rank, (i, r) in enumerate(zip(q.top_records, q.top_risks, strict=True), 1)
        ]
        assert len(data) == 10

        # the ε chart: every ε figure of every check so far
        columns, data = written.table(row, tags.EPSILON_CHART + "_table")
        expected = sorted(
            (r.step, t, v)
            for r in reports[: reports.index(report) + 1]
            for t, v in finite_scalars(r).items()
            if t == tags.EPSILON or tags.is_epsilon_lower_bound(t)
        )
        epsilon_tags |= {t for _, t, _ in expected}
        got = sorted(map(tuple, data))
        assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in expected]
        assert [v for *_, v in got] == pytest.approx([v for *_, v in expected])
    assert tags.EPSILON in epsilon_tags and len(epsilon_tags) >= 2
    assert max(times.values()) > 1  # a record listed at several checks counts up


def test_prefix_an_explicit_run_and_no_records_table(offline):
    start, finished = offline
    run = start()
    _, reports = _train([WandbSink(run, prefix="audit/", log_records=False)], steps=2)
    written = finished(run)
    row = written.checks("audit/" + tags.WANDB_STEP)[2]
    assert ("", "audit/privacy/*", "audit/" + tags.WANDB_STEP) in {
        (m.name, m.glob_name, m.step_metric) for m in written.metrics
    }
    scalars = finite_scalars(reports[0])
    assert {t: row["audit/" + t] for t in scalars} == scalars
    assert not [k for k in row if k.startswith("privacy/")]
    assert not [k for k in row if "most_exposed" in k]


def test_a_long_roc_is_thinned_to_points_of_the_curve(offline):
    from privmon.estimators.analysis import QueryResult
    from privmon.report import Report

    start, finished = offline
    run = start()
    gen = torch.Generator().manual_seed(0)
    member, nonmember = torch.rand(1500, generator=gen).numpy(), torch.rand(1500, generator=gen)
    q = QueryResult(
        "loss", {}, 1, 0, member_posterior=member, nonmember_posterior=nonmember.numpy()
    )
    WandbSink(run).write(Report(step=5, scalars={}, queries={"loss": q}, run_id="r"))
    written = finished(run)
    _, data = written.table(written.checks()[5], tags.roc("loss") + "_table")
    fpr, tpr, _ = privmon.roc_curve(member, nonmember)
    assert len(fpr) == 3001 and len(data) == ROC_POINTS
    curve = set(zip(fpr.tolist(), tpr.tolist(), strict=True))
    assert all((d[0], d[2]) in curve for d in data)  # points of the curve, ends kept
    assert (data[0][0], data[0][2]) == (0.0, 0.0) and (data[-1][0], data[-1][2]) == (1.0, 1.0)


@pytest.mark.parametrize("side", ["member", "nonmember"])
def test_a_query_without_posteriors_on_one_side_logs_its_figures_and_no_roc(offline, side):
    # one side missing (None), or with no finite posterior (all NaN): no ROC can be drawn for
    # that query, and the rest of the check (its figures, the other queries' ROC) is logged
    from privmon.estimators.analysis import QueryResult
    from privmon.report import Report

    start, finished = offline
    run = start()
    finite = np.linspace(0.05, 0.95, 40)
    other = "nonmember" if side == "member" else "member"

    def result(name, missing):
        posteriors = {f"{side}_posterior": missing, f"{other}_posterior": finite}
        return QueryResult(name, {}, 1, 0, **posteriors)

    queries = {
        "whole": QueryResult(
            "whole", {}, 1, 0, member_posterior=finite, nonmember_posterior=finite
        ),
        "missing": result("missing", None),
        "nan": result("nan", np.full(40, np.nan)),
    }
    scalars = {f"privacy/{name}/auc": 0.5 for name in queries}
    WandbSink(run).write(Report(step=5, scalars=scalars, queries=queries, run_id="r"))
    written = finished(run)
    row = written.checks()[5]
    assert {t: row[t] for t in scalars} == scalars
    drawn = {name for name in queries if any(k.startswith(tags.roc(name)) for k in row)}
    assert drawn == {"whole"}


def test_no_run_or_a_finished_run_is_logged_and_training_goes_on(offline, caplog):
    start, _ = offline
    assert wandb.run is None
    with caplog.at_level(logging.ERROR, logger="privmon"):
        monitor, reports = _train([WandbSink()], steps=2)
    assert [r.step for r in monitor.history] == [2] and len(reports) == 1  # the others got it
    assert "start one with wandb.init() or pass WandbSink(run=...)" in caplog.text
    run = start()
    run.finish()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="privmon"):
        monitor, _ = _train([WandbSink(run)], steps=2)
    assert [r.step for r in monitor.history] == [2]
    assert "WandbSink" in caplog.text and "failed at step 2" in caplog.text


def test_a_second_privmon_run_in_one_wandb_run_is_said(offline, caplog):
    start, finished = offline
    run = start()
    with caplog.at_level(logging.WARNING, logger="privmon"):
        first, _ = _train([WandbSink(run)], steps=2)
        assert "already holds" not in caplog.text
        second, _ = _train([WandbSink(run)], steps=2)
    written = finished(run)
    assert f"already holds the figures of privmon run {first.run_id}" in caplog.text
    assert written.config[tags.WANDB_RUN_ID_KEY] == second.run_id


def test_the_guides_snippet_runs_as_written(offline, tmp_path):
    # the ```python block of the sinks guide that calls wandb.init(), its `...` (the user's
    # training loop) one check; names from the page's own loop defined here
    page = Path(__file__).resolve().parents[2] / "docs" / "guide" / "training-loop.md"
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if "wandb.init(" in b
    ]
    assert block.count("\n    ...\n") == 1
    torch.manual_seed(0)
    x, y = torch.randn(200, 8), torch.randint(0, 2, (200,))
    names = {
        "privmon": privmon,
        "query": LossQuery(nn.Linear(8, 2)),
        "members": [(x[:100], y[:100])],
        "heldout": [(x[100:], y[100:])],
    }
    exec(block.replace("\n    ...\n", "\n    monitor.check(1)\n"), names)
    wandb.teardown()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    row = OfflineRun(run_dir).checks()[1]
    scalars = finite_scalars(names["monitor"].last_report)
    assert {t: row[t] for t in scalars} == scalars


def test_a_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'privmon\[wandb\]'"):
        WandbSink()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"run": object()}, r"run must be a wandb Run"),
        ({"prefix": 3}, "prefix must be a string"),
        ({"log_records": "yes"}, "log_records must be True or False"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WandbSink(**kwargs)


def test_loss_tnr_and_the_most_vulnerable_records_reach_an_offline_run(offline):
    start, finished = offline
    run = start()
    _, reports = traced_run([WandbSink()])
    written = finished(run)
    checks = written.checks()
    for report in reports:
        row = checks[report.step]
        assert row[tags.loss_tnr("loss", 0.01)] == report.scalars[tags.loss_tnr("loss", 0.01)]
        for source, top in report.vulnerable.items():
            columns, data = written.table(row, tags.most_vulnerable(source))
            assert columns == ["rank", "record index", "LT-IQR"]
            assert [d[1] for d in data] == list(top.records)
            assert [d[2] for d in data] == pytest.approx(top.scores)
