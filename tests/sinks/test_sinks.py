"""Tests for the sinks: JSON lines (one valid line per report, NaN/inf as null, only indices and
scores, never raw records; a cut-off last line repaired before appending; two runs appending at
once), the TensorBoard sink's writer handling, and one run per report: a resumed run stays one
run, another run in the same log directory is never merged with it (JSON lines and event
files). Real files, real monitor."""

from __future__ import annotations

import json
import logging
import math
import pathlib
import struct
import threading

import numpy as np
import pytest
import torch
from conftest import RecordingSink
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from privmon import PrivacyMonitor
from privmon.queries import LossQuery
from privmon.report import QueryResult, Report, SeveralRunsError, read_checks
from privmon.sinks import JsonlSink, TensorBoardSink

RAW = 12345.678  # a value no score can take: it must never reach a file


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _reject_constant(name):
    raise AssertionError(f"non-standard JSON constant {name} written")


def _read_jsonl(path):
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line, parse_constant=_reject_constant) for line in lines]


def _accumulator(logdir):
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    )
    acc.Reload()
    return acc


def _report(step, scalars, top=(3, 1, 2), epsilon=None, run_id="c3" * 16):
    q = QueryResult(name="loss", estimates={}, dim=1, n_dropped=0, top_records=tuple(top))
    return Report(
        step=step,
        scalars=scalars,
        queries={"loss": q},
        epsilon=epsilon,
        dp_violation=False,
        messages=("a message",),
        seconds=0.25,
        run_id=run_id,
    )


# --- JsonlSink -----------------------------------------------------------------------------------


def test_jsonl_one_valid_line_per_report_nonfinite_as_null(tmp_path):
    path = tmp_path / "nested" / "dir" / "checks.jsonl"  # parent directories are created
    sink = JsonlSink(path)
    sink.write(
        _report(
            5,
            {
                "privacy/a": 0.25,
                "privacy/nan": float("nan"),
                "privacy/inf": float("inf"),
                "privacy/ninf": float("-inf"),
                "privacy/np": np.float64("nan"),
            },
            epsilon=float("inf"),
        )
    )
    sink.write(_report(10, {"privacy/a": 0.5}, top=(), epsilon=1.5))
    sink.close()
    lines = _read_jsonl(path)
    assert len(lines) == 2
    first, second = lines
    assert first["step"] == 5 and second["step"] == 10
    assert first["scalars"] == {
        "privacy/a": 0.25,
        "privacy/nan": None,
        "privacy/inf": None,
        "privacy/ninf": None,
        "privacy/np": None,
    }
    assert first["epsilon"] is None and second["epsilon"] == 1.5
    assert first["dp_violation"] is False
    assert first["seconds"] == 0.25
    assert first["top_records"] == {"loss": [3, 1, 2]}
    assert second["top_records"] == {"loss": []}
    assert first["messages"] == ["a message"]
    assert second["scalars"] == {"privacy/a": 0.5}
    # Nothing but what Report.to_json holds (NaN / inf as null).
    assert set(first) == set(_report(5, {}).to_json())
    # A second sink on the same file appends.
    again = JsonlSink(str(path))
    again.write(_report(15, {"privacy/a": 0.75}))
    again.close()
    assert [line["step"] for line in _read_jsonl(path)] == [5, 10, 15]


def _two_lines(path):
    sink = JsonlSink(path)
    sink.write(_report(5, {"privacy/a": 0.25}))
    sink.write(_report(10, {"privacy/a": 0.5}))
    sink.close()
    return path.read_bytes()


def test_jsonl_sink_cuts_a_cut_off_last_line_before_appending(tmp_path, caplog):
    # A run killed mid-line, then resumed: appending after the cut-off line made one line of
    # two, and the report refused the whole file.
    path = tmp_path / "checks.jsonl"
    whole = _two_lines(path)
    path.write_bytes(whole + whole.splitlines(keepends=True)[-1][:30])
    with caplog.at_level(logging.WARNING, logger="privmon"):
        resumed = JsonlSink(path)
    assert f"the last line of {path} was cut off mid-write (30 bytes" in caplog.text
    resumed.write(_report(15, {"privacy/a": 0.75}))
    resumed.close()
    assert path.read_bytes().startswith(whole)
    assert [line["step"] for line in _read_jsonl(path)] == [5, 10, 15]
    checks = read_checks(path)
    assert checks.steps == [5, 10, 15]
    assert checks.skipped_line is None and checks.torn_lines == [] and checks.notes == []


def test_jsonl_sink_ends_a_whole_last_line_that_lacks_its_newline(tmp_path, caplog):
    path = tmp_path / "checks.jsonl"
    whole = _two_lines(path)
    path.write_bytes(whole.rstrip(b"\n"))  # every byte of the line written but its newline
    with caplog.at_level(logging.WARNING, logger="privmon"):
        resumed = JsonlSink(path)
    resumed.write(_report(15, {"privacy/a": 0.75}))
    resumed.close()
    assert caplog.text == ""
    assert [line["step"] for line in _read_jsonl(path)] == [5, 10, 15]
    for tail in (b"", b"\n"):  # an empty file, a file that ends whole: left as they are
        path.write_bytes(tail)
        JsonlSink(path).close()
        assert path.read_bytes() == tail


def test_two_runs_appending_to_one_file_at_once(tmp_path):
    path = tmp_path / "checks.jsonl"
    ids = ["d4" * 16, "e5" * 16]
    n = 200

    def run(run_id):
        sink = JsonlSink(path)
        for step in range(n):
            sink.write(_report(step, {"privacy/a": step / n}, run_id=run_id))
        sink.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = _read_jsonl(path)  # every line whole
    assert sorted(line["run_id"] for line in lines) == [ids[0]] * n + [ids[1]] * n
    with pytest.raises(SeveralRunsError, match="holds 2 runs"):
        read_checks(path)
    for run_id in ids:
        checks = read_checks(path, run=run_id)
        assert checks.steps == list(range(n)) and checks.run_id == run_id
        assert [r["scalars"]["privacy/a"] for r in checks.records] == [s / n for s in range(n)]


def _classifier_with_raw_marker():
    """Records whose first feature is the marker RAW; the model ignores that feature."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 5, generator=g)
    x[:, 0] = RAW
    y = (x[:, 1] > 0).long()
    model = nn.Linear(5, 2)
    with torch.no_grad():
        model.weight[:, 0] = 0.0
    return model, x, y


def test_monitor_sinks_write_scores_and_indices_never_raw_records(tmp_path):
    torch.manual_seed(0)
    model, x, y = _classifier_with_raw_marker()
    members = [(x[i : i + 20], y[i : i + 20]) for i in range(0, 60, 20)]
    nonmembers = [(x[i : i + 20], y[i : i + 20]) for i in range(60, 120, 20)]
    jsonl = tmp_path / "checks.jsonl"
    monitor = PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        methods=("histogram", "kde"),
        every_n_steps=1,
        writer=tmp_path / "tb",
        sinks=[JsonlSink(jsonl)],
        top_k=5,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    top, reports = [], []
    for step in (1, 2):
        for xb, yb in members:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        monitor.step(step)
        reports.append(monitor.last_report)  # whole: the history keeps float32 figures
        top.append(monitor.last_report.queries["loss"].top_records)
    monitor.close()

    lines = _read_jsonl(jsonl)
    assert [line["step"] for line in lines] == [1, 2]
    for line, report, t in zip(lines, reports, top, strict=True):
        expected = {k: (v if math.isfinite(v) else None) for k, v in report.scalars.items()}
        assert line["scalars"] == expected
        assert line["top_records"] == {"loss": list(t)}
        assert len(t) == 5 and all(0 <= i < 60 for i in t)
        assert line["step"] == report.step and line["epsilon"] is None
        assert line["dp_violation"] is False
        assert set(line) == set(report.to_json())

    # The marker appears nowhere: neither as text nor as float32 / float64 bytes.
    # (the first charts' named series are runs of their own: sub-folders of the log directory)
    files = [jsonl, *sorted(p for p in (tmp_path / "tb").rglob("*") if p.is_file())]
    assert len(files) >= 2
    needles = [b"12345.678", b"12345.67", struct.pack("<f", RAW), struct.pack("<d", RAW)]
    for f in files:
        blob = f.read_bytes()
        for needle in needles:
            assert needle not in blob, f"{needle!r} found in {f.name}"


# --- TensorBoardSink -----------------------------------------------------------------------------


def test_tensorboard_sink_accepts_a_summarywriter_and_leaves_it_open(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    sink = TensorBoardSink(writer)
    assert sink.writer is writer
    sink.write(_report(3, {"privacy/x/histogram/value": 0.125}))
    sink.close()  # the sink does not own the writer: flushes, does not close
    writer.add_scalar("user/tag", 2.5, 4)  # still usable by its owner
    writer.close()
    acc = _accumulator(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("privacy/x/histogram/value")] == [(3, 0.125)]
    assert [(e.step, e.value) for e in acc.Scalars("user/tag")] == [(4, 2.5)]


@pytest.mark.parametrize("as_path", [str, pathlib.Path])
def test_tensorboard_sink_accepts_a_path_and_owns_its_writer(tmp_path, as_path):
    logdir = tmp_path / "logs"
    sink = TensorBoardSink(as_path(logdir))
    assert isinstance(sink.writer, SummaryWriter)
    sink.write(_report(7, {"privacy/a": 0.5, "privacy/b": float("nan")}))
    sink.write(_report(8, {"privacy/a": 0.75, "privacy/b": 1.0}))
    sink.close()
    acc = _accumulator(logdir)
    assert [(e.step, e.value) for e in acc.Scalars("privacy/a")] == [(7, 0.5), (8, 0.75)]
    b = acc.Scalars("privacy/b")
    assert [e.step for e in b] == [7, 8]
    assert math.isnan(b[0].value) and b[1].value == 1.0


@pytest.mark.parametrize("bad", [None, 42, object(), ["runs"], {"log_dir": "runs"}])
def test_tensorboard_sink_rejects_other_objects(bad):
    with pytest.raises(ValueError, match="writer"):
        TensorBoardSink(bad)


# --- one run per report ---------------------------------------------------------------------------
TAG = "privacy/loss/histogram/value"


def _monitor_run(model, x, y, logdir, steps, lr, state=None):
    """A monitor writing JSON lines to ``logdir`` and event files to ``logdir/tb``, training
    ``model`` for ``steps`` (a check each); ``state``: resume from a saved monitor state."""
    members = [(x[i : i + 20], y[i : i + 20]) for i in range(0, 60, 20)]
    nonmembers = [(x[i : i + 20], y[i : i + 20]) for i in range(60, 120, 20)]
    keep = RecordingSink()
    monitor = PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        methods=("histogram",),
        every_n_steps=1,
        writer=logdir / "tb",
        sinks=[JsonlSink(logdir / "checks.jsonl"), keep],
    )
    if state is not None:
        monitor.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    saved = None
    for step in steps:
        for xb, yb in members:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        monitor.step(step)
        if step == steps[0]:
            saved = (monitor.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
    monitor.close()
    return monitor, keep.reports, saved


def test_resumed_run_is_one_run_another_run_is_never_merged(tmp_path):
    torch.manual_seed(0)
    model, x, y = _classifier_with_raw_marker()
    logdir = tmp_path / "run"
    first, _, (state, weights) = _monitor_run(model, x, y, logdir, [1, 2, 3], lr=0.5)
    # Resumed from the step-1 checkpoint, trained otherwise: steps 2 and 3 are written again.
    model.load_state_dict(weights)
    resumed, reports, _ = _monitor_run(model, x, y, logdir, [2, 3], lr=2.0, state=state)
    assert resumed.run_id == first.run_id
    from_lines, from_events = read_checks(logdir), read_checks(logdir / "tb")
    assert (from_lines.kind, from_events.kind) == ("jsonl", "tensorboard")
    events = [p for p in (logdir / "tb").iterdir() if p.is_file()]  # (folders: named series)
    assert len(events) == 2  # one event file per writer
    for checks in (from_lines, from_events):
        assert checks.steps == [1, 2, 3] and checks.run_id == first.run_id
        assert checks.other_runs == [] and not any("Left out" in n for n in checks.notes)
        later = [np.float32(r.scalars[TAG]) for r in reports]
        assert [np.float32(r["scalars"][TAG]) for r in checks.records[1:]] == later
    assert from_lines.roc["loss"][0] == 3  # the ROC of the JSON lines' own run

    # Another run written into the same log directory: never merged with the first.
    torch.manual_seed(1)
    other_model, x2, y2 = _classifier_with_raw_marker()
    other, other_reports, _ = _monitor_run(other_model, x2, y2, logdir, [1, 2], lr=0.1)
    for source in (logdir, logdir / "tb"):
        with pytest.raises(SeveralRunsError) as info:
            read_checks(source)
        runs = info.value.runs
        assert [(r.run_id, r.first_step, r.last_step) for r in runs] == [
            (first.run_id, 1, 3),
            (other.run_id, 1, 2),
        ]
        unit = "lines" if source == logdir else "checks"
        assert [r.n_written for r in runs] == [5, 2] and runs[0].unit == unit
        mine = read_checks(source, run=first.run_id[:8])
        assert mine.steps == [1, 2, 3]
        assert [np.float32(r["scalars"][TAG]) for r in mine.records[1:]] == later
        assert [r.run_id for r in mine.other_runs] == [other.run_id]
        assert any("Left out, never merged" in n for n in mine.notes)
        latest = read_checks(source, run="latest")
        assert latest.run_id == other.run_id and latest.steps == [1, 2]
        got = [np.float32(r["scalars"][TAG]) for r in latest.records]
        assert got == [np.float32(r.scalars[TAG]) for r in other_reports]
    assert read_checks(logdir, run="latest").roc["loss"][0] == 2
