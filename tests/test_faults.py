"""Fault injection: a failure stays inside the check, bad configuration fails at construction.

(A first part of the reliability work; queries and methods that fail inside a check are in
test_certificates.py.)"""

import io
import json
import logging
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import privmon
from privmon.queries import CallableQuery

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ReleaseRaises(CallableQuery):
    """A query whose release() (run after every check) raises."""

    def release(self) -> None:
        raise RuntimeError("release exploded")


def _monitor(query, **kwargs):
    return privmon.PrivacyMonitor(query, [np.ones(50)], [np.zeros(50)], **kwargs)


def _scores(model):
    def fn(batch):
        torch.rand(1)  # draws from the global RNG, as dropout would
        return model(torch.as_tensor(batch, dtype=torch.float32)[:, None])[:, 0]

    return fn


@pytest.mark.parametrize("strict", [False, True])
def test_a_raising_release_leaves_training_untouched(strict, caplog):
    model = nn.Sequential(nn.Linear(1, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    model.train()
    mon = _monitor(ReleaseRaises(_scores(model), name="q", modules=model), strict=strict)
    torch.manual_seed(3)
    random.seed(3)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(3)
    random.seed(3)
    with caplog.at_level(logging.ERROR, logger="privmon"):
        if strict:
            with pytest.raises(RuntimeError, match="release exploded"):
                mon.check(1)
        else:
            assert mon.check(1) is not None  # the check itself succeeded
            assert "release exploded" in caplog.text
    assert all(m.training for m in model.modules())
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


class Recording:
    def __init__(self, fail_close: bool = False):
        self.reports, self.closed, self.fail_close = [], False, fail_close

    def write(self, report):
        self.reports.append(report.step)

    def close(self):
        self.closed = True
        if self.fail_close:
            raise OSError("disk gone")


def test_sinks_are_checked_at_construction_and_all_closed(caplog):
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")

    class NoWrite:
        def close(self):
            pass

    with pytest.raises(ValueError, match=r"sinks must be sinks with write\(\) and close\(\)"):
        _monitor(query, sinks=[NoWrite()])
    assert _monitor(query, sinks=None).sinks == []
    single = Recording()
    mon = _monitor(query, sinks=single)  # one sink, not in a list
    assert mon.sinks == [single]
    first, second = Recording(fail_close=True), Recording()
    mon = _monitor(query, sinks=[first, second])
    mon.check(1)
    assert first.reports == second.reports == [1]
    with caplog.at_level(logging.ERROR, logger="privmon"):
        mon.close()  # the first sink's close raises: the second is still closed
    assert first.closed and second.closed and "disk gone" in caplog.text


def test_numpy_integer_steps_keep_the_checkpoint_loadable():
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")
    mon = _monitor(query, every_n_steps=np.int64(10))
    assert mon.every_n_steps == 10 and type(mon.every_n_steps) is int
    mon.step(np.int64(10))
    assert type(mon.last_report.step) is int and type(mon.state_dict()["last_step"]) is int
    buf = io.BytesIO()
    torch.save(mon.state_dict(), buf)
    buf.seek(0)
    fresh = _monitor(query)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.history[0].step == 10 and fresh.n_certified_checks == 1
    with pytest.raises(ValueError, match="global_step must be an integer"):
        mon.check(2.5)


def test_an_early_stopping_metric_no_report_has_is_loud():
    # "loss/histgram" (a typo) names no reported figure: the privacy budget could never fire
    query = CallableQuery(lambda b: torch.as_tensor(b), name="loss")
    typo = privmon.PrivacyEarlyStopping("loss/histgram", 0.1)
    mon = _monitor(query, early_stopping=typo)
    with pytest.warns(UserWarning, match="early stopping can never fire.*loss/histgram"):
        mon.check(1)
    strict = _monitor(query, early_stopping=privmon.PrivacyEarlyStopping("loss/histgram", 0.1),
                      strict=True)  # fmt: skip
    with pytest.raises(ValueError, match="early stopping can never fire"):
        strict.check(1)
    fine = _monitor(query, early_stopping=privmon.PrivacyEarlyStopping("loss/histogram", 0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fine.check(1)


def _gen():
    yield np.ones(50)


ITERABLE = "must be an iterable of batches that can be iterated again at every check"


@pytest.mark.parametrize(
    ("members", "message"),
    [
        (_gen(), f"{ITERABLE}.*got a one-shot iterator"),
        (map(np.asarray, [[1.0, 2.0]]), f"{ITERABLE}.*got a one-shot iterator"),
        ([], "is empty: it must yield at least one batch"),
        ("data.csv", f"{ITERABLE}.*got a str"),
        ({"x": np.ones(5)}, rf"{ITERABLE}.*got a dict; one batch: pass \[batch\]"),
        (torch.ones(50), f"{ITERABLE}.*got a Tensor: iterating it yields single rows"),
        (np.ones(50), f"{ITERABLE}.*got a ndarray: iterating it yields single rows"),
        (42, f"{ITERABLE}.*got int"),
    ],
)
def test_audit_sets_that_cannot_be_audited_every_check_fail_at_construction(members, message):
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")
    with pytest.raises(ValueError, match=f"^members {message}"):
        privmon.PrivacyMonitor(query, members, [np.zeros(50)])
    with pytest.raises(ValueError, match=f"^nonmembers {message}"):
        privmon.PrivacyMonitor(query, [np.ones(50)], members)


def test_modules_and_log_directories_are_checked_at_construction(tmp_path):
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")
    with pytest.raises(ValueError, match=r"modules must be torch\.nn\.Module objects, got a str"):
        _monitor(query, modules=["model"])
    with pytest.raises(ValueError, match=r"modules must be torch\.nn\.Module objects"):
        _monitor(query, modules=[nn.Linear(1, 1), nn.Linear(1, 1).weight])
    single = nn.Linear(1, 1)
    assert _monitor(query, modules=single).modules == (single,)  # one module, not in a list
    afile = tmp_path / "afile"
    afile.write_text("x")
    # a log directory under a regular file cannot be created, even by root
    with pytest.raises(
        ValueError, match=r"writer .*afile.* cannot be created: .*afile.* is a file"
    ):
        _monitor(query, writer=str(afile / "runs"))
    with pytest.raises(ValueError, match=r"writer must be a directory path, but .* is a file"):
        _monitor(query, writer=afile)
    _monitor(query, writer=tmp_path / "new" / "runs")  # creatable: fine, and nothing written yet
    assert not (tmp_path / "new").exists()


DISK_FULL_RUN = """
import os, resource, signal, sys
import numpy as np, torch
import privmon
from privmon.queries import CallableQuery
from privmon.sinks import JsonlSink

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
torch.set_num_threads(1)
logdir = sys.argv[1]
rng = np.random.default_rng(0)
monitor = privmon.PrivacyMonitor(
    CallableQuery(lambda b: torch.as_tensor(b, dtype=torch.float32), name="s"),
    [rng.normal(0.3, 1, 200)], [rng.normal(0, 1, 200)], every_n_steps=1, methods=("histogram",),
    writer=logdir, sinks=[JsonlSink(os.path.join(logdir, "checks.jsonl"))],
)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
for step in range(1, 16):
    if step == 4:  # the disk is full for five checks: no file can grow
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))
    if step == 9:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    monitor.step(step)
monitor.close()
print(monitor.n_failed, len(monitor.history))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE fault injection is Linux-only")
def test_sinks_recover_from_a_full_disk_and_lose_no_check(tmp_path):
    # a real fault: the kernel refuses every write for five checks (RLIMIT_FSIZE), in a child
    # process so that the limit cannot touch the test run
    done = subprocess.run(
        [sys.executable, "-c", DISK_FULL_RUN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "15"]  # no check failed: only the sinks' writes did
    assert "File too large" in done.stderr  # the faults were real and logged
    lines = (tmp_path / "checks.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 16))  # whole lines only
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    steps = [e.step for e in events.Scalars("privacy/s/histogram/value")]
    assert sorted(set(steps)) == list(range(1, 16))


def _checked_monitor(**kwargs):
    rng = np.random.default_rng(0)
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")
    es = privmon.PrivacyEarlyStopping("s/histogram", 0.9, use="value", patience=2)
    mon = privmon.PrivacyMonitor(
        query,
        [rng.normal(0.5, 1, 300)],
        [rng.normal(0, 1, 300)],
        every_n_steps=1,
        early_stopping=es,
        **kwargs,
    )
    return mon


def _saved(mon):
    buf = io.BytesIO()
    torch.save(mon.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"methods": ("histogram",)}, "methods"),
        ({"prior": 0.3}, "prior"),
        ({"interval_delta": 0.01}, "interval_delta"),
        ({"planned_checks": 10}, "planned_checks"),
    ],
)
def test_a_state_loads_only_into_the_same_setup(kwargs, field):
    mon = _checked_monitor()
    for step in (1, 2):
        mon.step(step)
    state = _saved(mon)
    other = _checked_monitor(**kwargs)
    with pytest.raises(ValueError, match=rf"another setup .*{field}"):
        other.load_state_dict(state)
    renamed = privmon.PrivacyMonitor(
        CallableQuery(lambda b: torch.as_tensor(b), name="t"), [np.ones(5)], [np.zeros(5)]
    )
    with pytest.raises(ValueError, match="queries"):
        renamed.load_state_dict({**state, "early_stopping": None})


def _corrupt(state, path, value):
    """A copy of the state with the field at ``path`` (keys) set to ``value``."""
    state = {k: v for k, v in state.items()}
    node = state
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    node[path[-1]] = value
    return state


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("last_step",), -3, "last_step"),
        (("last_step",), "10", "last_step"),
        (("stop",), "yes", "stop"),
        (("n_failed",), 1.5, "n_failed"),
        (("n_certified_checks",), 1, "n_certified_checks"),
        (("history", "fields", "steps"), torch.tensor([1]), "'epsilon' has 2 entries, .* 1 checks"),
        (("history", "fields", "epsilon"), torch.zeros(2, dtype=torch.float32), "epsilon"),
        (("history", "tagsets"), [["x"]], "scalars|tagset"),
        (("history", "scalars"), {}, "scalars"),
        (("early_stopping", "wait"), -1, "wait"),
        (("early_stopping", "threshold"), 0.5, "threshold"),
        (("records",), {"s": {"last": torch.zeros(3)}}, "record track"),
        (("records", "s", "max"), torch.zeros(7, dtype=torch.float64), "differ in length"),
    ],
)
def test_a_bad_state_raises_naming_the_field_and_changes_nothing(path, value, match):
    mon = _checked_monitor()
    for step in (1, 2):
        mon.step(step)
    state = _saved(mon)
    fresh = _checked_monitor()
    fresh.step(1)  # some progress of its own, which a failed load must keep
    before = _saved(fresh)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(_corrupt(state, path, value))
    after = _saved(fresh)
    assert after["history"]["fields"]["steps"].tolist() == [1]
    assert after["early_stopping"] == before["early_stopping"]
    assert after["last_step"] == 1 and after["n_certified_checks"] == 1
    assert torch.equal(after["records"]["s"]["max"], before["records"]["s"]["max"])
    fresh.load_state_dict(state)  # the intact state still loads
    assert [r.step for r in fresh.history] == [1, 2]


def test_a_state_from_before_the_columns_still_loads():
    mon = _checked_monitor()
    mon.step(1)
    state = _saved(mon)
    report = mon.history[-1]
    legacy = {k: v for k, v in state.items() if k != "config"}
    legacy["history"] = [
        {"step": 1, "scalars": dict(report.scalars), "epsilon": None, "dp_violation": False}
    ]
    fresh = _checked_monitor()
    fresh.load_state_dict(legacy)
    assert fresh.history[0].scalars == pytest.approx(report.scalars, rel=1e-7)


def test_top_records_across_checks_say_when_ties_decided_the_list():
    # four members measured at one risk, one above it: a top 3 holds the first and two of
    # the four tied ones, chosen by index — the result must say two more share that risk
    tracker = privmon.callbacks.records.RecordTracker()
    tracker.update("q", 1, np.array([0.2, 0.5, 0.5, 0.9, 0.5, 0.5, np.nan]))
    top = tracker.top(3)
    assert top == [(3, 0.9), (1, 0.5), (2, 0.5)] and top.tied_beyond == 2
    assert tracker.top(2).tied_beyond == 3
    assert tracker.top(6).tied_beyond == 0 and tracker.top(0).tied_beyond == 0
    tracker.update("q", 2, np.array([0.1, 0.6, 0.5, 0.2, 0.4, 0.3, 0.1]))
    by_last = tracker.top(2, by="last")
    assert by_last == [(1, 0.6), (2, 0.5)] and by_last.tied_beyond == 0


def test_an_accountant_whose_epsilon_is_not_a_number_fails_at_construction():
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")

    class Accountant:
        def __init__(self, answer):
            self.answer = answer

        def get_epsilon(self, delta):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    for answer in ("3.2 nats", None, float("nan"), -1.0, torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="accountant: accountant returned"):
            _monitor(query, accountant=Accountant(answer))
    # no answer before training (as Opacus' PRV accountant on an empty history): the checks read it
    late = _monitor(query, accountant=Accountant(RuntimeError("no steps yet")))
    late.accountant.answer = 2.0
    assert late.check(1).epsilon == 2.0
    opacus = pytest.importorskip("opacus")
    assert _monitor(query, accountant=opacus.accountants.RDPAccountant()).check(1).epsilon == 0.0
