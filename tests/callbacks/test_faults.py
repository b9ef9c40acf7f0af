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
from privmon._digest import sealed
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
        ({"dp_alarm_delta": 1e-3}, "dp_alarm_delta"),
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
        renamed.load_state_dict(sealed({**state, "early_stopping": None}))


def _corrupt(state, path, value):
    """A copy of the state with the field at ``path`` (keys) set to ``value``, sealed again
    (a state edited without its digest is refused before its fields are read)."""
    state = {k: v for k, v in state.items()}
    node = state
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    node[path[-1]] = value
    return sealed(state)


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("last_step",), -3, "last_step"),
        (("last_step",), "10", "last_step"),
        (("stop",), "yes", "stop"),
        (("n_failed",), 1.5, "n_failed"),
        (("n_certified_checks",), 1, "n_certified_checks"),
        (("history", "fields", "steps"), torch.tensor([1]), "'epsilon' has 2 entries, .* 1 checks"),
        (
            ("history", "fields", "epsilon"),
            torch.zeros(2, dtype=torch.float32),
            r"history field 'epsilon' must be a 1-D torch\.float64 tensor",
        ),
        (("history", "fields", "epsilon"), torch.zeros(2, 1, dtype=torch.float64), "1-D"),
        (("history", "fields", "steps"), torch.tensor([1, -2]), "steps must be non-negative"),
        (("history", "fields", "tagset"), torch.tensor([0, 1], dtype=torch.int32), "index"),
        (("history", "fields"), {"steps": torch.tensor([1, 2])}, "history fields must be"),
        (("history", "fields"), [1, 2], "history fields must be"),
        (("history", "tagsets"), [["x"]], "scalars|tagset"),
        (("history", "tagsets"), "loss", "tagsets must be lists of tag names"),
        (("history", "tagsets"), [[1]], "tagsets must be lists of tag names"),
        (("history", "tagsets"), [1], "tagsets must be lists of tag names"),
        (("history", "scalars"), {}, "scalars"),
        (("history", "scalars"), [], "one column per reported tag"),
        (("history", "run_id"), 7, "history run_id must be a string"),
        (("history", "extra"), 1, "history must hold run_id, fields, scalars, tagsets and notes"),
        (("history", "notes"), {2: {"messages": [], "failures": {}}}, "notes must map"),
        (("history", "notes"), {-1: {"messages": [], "failures": {}}}, "notes must map"),
        (("history", "notes"), {"0": {"messages": [], "failures": {}}}, "notes must map"),
        (("history", "notes"), {0: {"messages": []}}, "notes must map"),
        (("history", "notes"), {0: []}, "notes must map"),
        (("history", "notes"), [], "notes must map"),
        (("history",), [{"step": 1}], "history must hold run_id, fields"),
        (("state_version",), 4, "state has state_version 4; this privmon reads state_version 3"),
        (("run_id",), "", "run_id must be a non-empty string"),
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


def test_a_history_state_with_step_zero_or_no_checks_loads():
    from privmon.callbacks.history import ReportHistory
    from privmon.report import Report

    history = ReportHistory()
    assert ReportHistory.from_state_dict(history.state_dict()) == []
    with pytest.raises(ValueError, match="notes must map"):  # no check: no note either
        ReportHistory.from_state_dict(
            {**history.state_dict(), "notes": {0: {"messages": [], "failures": {}}}}
        )
    history.append(Report(step=0, scalars={"a": 1.0}))
    history.append(Report(step=3, scalars={"a": 2.0}, failures={"q": "x"}))
    state = history.state_dict()
    assert set(state["notes"]) == {1}  # kept only for the checks that have them
    restored = ReportHistory.from_state_dict(state)
    assert restored.steps.tolist() == [0, 3] and restored[1].failures == {"q": "x"}
    restored.append(Report(step=4, scalars={"a": 3.0}))  # a tag set it knows: no new one
    assert len(restored.state_dict()["tagsets"]) == 1


def test_a_state_saved_before_states_carried_a_version_is_refused_naming_the_version():
    mon = _checked_monitor()
    mon.step(1)
    state = _saved(mon)
    assert state["state_version"] == 3
    # the state as privmon saved it before: its setup nested under "config", no version
    setup = ("queries", "methods", "prior", "interval_delta", "planned_checks", "canaries")
    newer = ("state_version", "dp_alarm_delta")  # fields of later versions
    before = {k: v for k, v in state.items() if k not in (*setup, *newer)}
    before["config"] = {k: state[k] for k in setup}
    fresh = _checked_monitor()
    with pytest.raises(ValueError, match=r"no state_version .* reads state_version 3 only"):
        fresh.load_state_dict(before)
    assert fresh.history == [] and fresh.n_certified_checks == 0


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


# --- a query's output is checked inside its own guard ---------------------------------------------


class ScalarQuery(privmon.queries.Query):
    """A Query subclass returning one number per batch (a 0-d tensor)."""

    def __call__(self, batch):
        return torch.as_tensor(batch, dtype=torch.float32).mean()


class ExtraRowQuery(privmon.queries.Query):
    """A Query subclass returning one row more than its batch has records."""

    def __call__(self, batch):
        t = torch.as_tensor(batch, dtype=torch.float32)
        return torch.cat([t, t[:1]])


def _sets():
    rng = np.random.default_rng(1)
    members = [rng.normal(0.5, 1, 40).astype(np.float32) for _ in range(3)]
    nonmembers = [rng.normal(0, 1, 40).astype(np.float32) for _ in range(3)]
    return members, nonmembers


def test_queries_returning_the_wrong_rows_or_shapes_are_left_out_alone():
    members, nonmembers = _sets()
    widths = iter([1, 1, 2, 2, 2, 2])

    def widening(batch):  # (n, 1) for the first two batches, then (n, 2)
        t = torch.as_tensor(batch)
        return t[:, None].expand(-1, next(widths))

    queries = [
        CallableQuery(lambda b: torch.as_tensor(b), name="good"),
        CallableQuery(lambda b: torch.as_tensor(b)[:-1], name="fewer"),  # one row short
        ExtraRowQuery(name="more"),
        ScalarQuery(name="scalar"),
        CallableQuery(widening, name="widening"),
    ]
    mon = privmon.PrivacyMonitor(queries, members, nonmembers, methods=("histogram",))
    report = mon.check(1)
    assert report is not None and mon.n_failed == 0
    assert set(report.failures) == {"fewer", "more", "scalar", "widening"}
    assert "returned 39 rows (shape (39,)) for a batch of 40 records" in report.failures["fewer"]
    assert "returned 41 rows" in report.failures["more"]
    assert "a 0-d tensor (one number for the whole batch)" in report.failures["scalar"]
    assert "(n, 1) at first, then (n, 2)" in report.failures["widening"]
    good = privmon.PrivacyMonitor(
        CallableQuery(lambda b: torch.as_tensor(b), name="good"),
        members,
        nonmembers,
        methods=("histogram",),
    ).check(1)
    # the query that returned the right rows is measured as if it were alone (δ aside)
    assert (
        report.scalars["privacy/good/histogram/value"]
        == good.scalars["privacy/good/histogram/value"]
    )
    np.testing.assert_array_equal(
        report.queries["good"].member_risk, good.queries["good"].member_risk
    )
    assert report.queries["good"].member_risk.shape == (120,)
    with pytest.raises(ValueError, match="query 'fewer' returned 39 rows"):
        privmon.PrivacyMonitor(queries[1], members, nonmembers, strict=True).check(1)


def test_rows_are_counted_by_the_batch_convention_and_the_query_transform():
    from privmon.queries.batches import count_records

    x, y = torch.zeros(5, 3), torch.zeros(5)
    assert count_records((x, y)) == 5
    assert count_records({"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4, 7)}) == 4
    assert count_records({"features": torch.zeros(6, 2)}) == 6  # no input key: first tensor
    assert count_records(["a text", "another"]) == 2
    assert count_records(np.zeros(8)) == 8
    assert count_records(({"a": torch.zeros(3, 2)}, y)) == 3  # keyword inputs
    assert count_records((x, y), lambda b: (b[0][:2], None)) == 2
    assert count_records(3.0) is None  # nothing that holds rows: not checked
    # a classifier query reads its batch through its transform: the rows are counted there
    model = nn.Linear(3, 2)
    q = privmon.queries.LossQuery(model, transform=lambda b: (b["pixels"], b["target"]))
    # the raw batch's first tensor ("ids") has 5 rows, the records the model reads 10
    batch = {"ids": x, "pixels": torch.randn(10, 3), "target": torch.randint(0, 2, (10,))}
    mon = privmon.PrivacyMonitor(q, [batch], [batch | {"pixels": torch.randn(10, 3)}])
    assert mon.check(1) is not None and mon.last_report.failures == {}


# --- silent traps said out loud -------------------------------------------------------------------


def _memorised(n=200):
    """A small MLP that memorised random labels of its first n // 2 records."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[: n // 2]), y[: n // 2]).backward()
        opt.step()
    return model, [(x[: n // 2], y[: n // 2])], [(x[n // 2 :], y[n // 2 :])]


def _user_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)]


def test_the_same_or_identical_audit_sets_are_refused_and_overlapping_ones_warned():
    model, members, nonmembers = _memorised()
    query = privmon.queries.LossQuery(model)
    with pytest.raises(ValueError, match="members and nonmembers are the same object"):
        privmon.PrivacyMonitor(query, members, members)
    # the same records in another container: every check fails, loudly
    mon = privmon.PrivacyMonitor(query, members, [tuple(t.clone() for t in members[0])])
    with pytest.warns(UserWarning, match="failed and was skipped.*hold the same 100 records"):
        assert mon.check(1) is None
    assert mon.check(2) is None and mon.n_failed == 2
    with pytest.raises(ValueError, match="hold the same 100 records"):
        privmon.PrivacyMonitor(query, members, list(members), strict=True).check(1)
    # 30 records shared: warned once, and the check still runs
    (xm, ym), (xn, yn) = members[0], nonmembers[0]
    shared = [(torch.cat([xn[:70], xm[:30]]), torch.cat([yn[:70], ym[:30]]))]
    mon = privmon.PrivacyMonitor(query, members, shared, methods=("histogram",))
    with pytest.warns(UserWarning, match="30 of the 100 non-member records also appear"):
        assert mon.check(1) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mon.check(2) is not None  # said once
    # disjoint sets: nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        privmon.PrivacyMonitor(query, members, nonmembers, methods=("histogram",)).check(1)


def test_a_run_that_closes_with_no_check_says_so():
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")
    mon = _monitor(query, every_n_steps=100)
    for epoch in range(3):  # step(epoch) instead of the global step
        mon.step(epoch + 1)
    with pytest.warns(UserWarning, match=r"no privacy check: step\(\) was called 3 times, with "
                      r"steps 1 to 3, and none was a multiple of every_n_steps=100"):  # fmt: skip
        mon.close()
    with pytest.warns(UserWarning, match=r"neither step\(\) nor check\(\) was called"):
        _monitor(query).close()
    checked = _monitor(query, every_n_steps=2)
    checked.step(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checked.close()


def test_the_first_failed_check_warns_with_strict_guidance_once():
    model = nn.Linear(1, 1).double()  # a float64 model given float32 batches fails every check
    query = CallableQuery(lambda b: model(torch.as_tensor(b, dtype=torch.float32)[:, None])[:, 0],
                          name="s", modules=model)  # fmt: skip
    mon = _monitor(query, every_n_steps=1)
    with pytest.warns(UserWarning, match=r"check at step 1 failed.*pass strict=True") as record:
        mon.step(1)
    assert "dtype" in str(record[0].message)  # the error itself, not only that there was one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.step(2)  # said once
    assert mon.n_failed == 2 and mon.last_report is None
    fine = _monitor(CallableQuery(lambda b: torch.as_tensor(b), name="s"), every_n_steps=1)
    fine.step(1)
    fine.queries[0].fn = lambda b: 1 / 0  # fails after a success: the log says it, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fine.step(2)
    assert fine.n_failed == 1


def test_swapped_sets_are_suspected_on_a_query_that_knows_its_direction():
    model, members, nonmembers = _memorised()
    query = privmon.queries.LossQuery(model)
    right = privmon.PrivacyMonitor(query, members, nonmembers, methods=("histogram",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auc = right.check(1).scalars["privacy/loss/auc"]
    assert auc > 0.7
    swapped = privmon.PrivacyMonitor(query, nonmembers, members, methods=("histogram",))
    with pytest.warns(UserWarning, match="'loss' ranks members below non-members: AUC "):
        assert swapped.check(1).scalars["privacy/loss/auc"] == pytest.approx(1 - auc)
    # without a known direction the AUC is oriented either way: nothing to suspect
    undirected = CallableQuery(lambda b: nn.functional.cross_entropy(model(b[0]), b[1],
                               reduction="none"), name="loss")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        privmon.PrivacyMonitor(undirected, nonmembers, members, methods=("histogram",)).check(1)


def test_a_model_passed_as_the_query_points_at_loss_query():
    model, members, nonmembers = _memorised()
    with pytest.raises(ValueError, match=r"query is a model \(Sequential\).*LossQuery\(model\)"):
        privmon.PrivacyMonitor(model, members, nonmembers)


def test_a_new_monitor_first_called_past_its_first_check_suggests_loading_its_state():
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s")
    saved = _monitor(query, every_n_steps=10)
    for step in range(1, 31):
        saved.step(step)
    resumed = _monitor(query, every_n_steps=10)
    with pytest.warns(UserWarning, match=r"first step this monitor sees is 31.*load_state_dict"):
        resumed.step(31)
    loaded = _monitor(query, every_n_steps=10)
    loaded.load_state_dict(saved.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.step(31)
        _monitor(query, every_n_steps=10).step(1)  # a run from its start
        _monitor(query, every_n_steps=10).step(0)
    with pytest.warns(UserWarning, match="step 20 comes before the last checked step 30"):
        loaded.step(20)  # a restart behind the loaded state: no check until step 30 is passed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.step(20)  # said once
    assert [r.step for r in loaded.history] == [10, 20, 30]


def test_a_state_must_be_consistent_with_its_checks():
    mon = _checked_monitor()
    for step in (1, 2):
        mon.step(step)
    state = _saved(mon)
    # a last step far ahead would switch monitoring off until the steps pass it
    for last_step, match in [
        (10**12, r"last_step \(1000000000000\) differs from its last check's step \(2\)"),
        (None, "last_step is None, but the state holds 2 checks"),
    ]:
        fresh = _checked_monitor()
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(_corrupt(state, ("last_step",), last_step))
        assert fresh.history == []
    fresh = _checked_monitor()
    fresh.load_state_dict(sealed(_corrupt(state, ("n_failed",), 1) | {"last_step": 7}))  # failed
    assert fresh.state_dict()["last_step"] == 7
    empty = _saved(_checked_monitor())
    with pytest.raises(ValueError, match="last_step is 5, but the state ran no check"):
        _checked_monitor().load_state_dict(_corrupt(empty, ("last_step",), 5))
    # more certified checks than it ran: every later bound would be looser, without a word
    crafted = _corrupt(state, ("n_certified_checks",), 10**6)
    with pytest.warns(UserWarning, match=r"n_certified_checks \(1000000\) exceeds the 2 checks"):
        fresh.load_state_dict(crafted)
    assert fresh.n_certified_checks == 10**6


def test_a_state_from_a_newer_setup_names_the_fields_this_version_does_not_know():
    mon = _checked_monitor()
    mon.step(1)
    state = _saved(mon)
    newer = _corrupt(state, ("sealed",), 8)  # a field no privmon has
    with pytest.raises(ValueError, match=r"newer privmon, with fields .*\(sealed\)"):
        _checked_monitor().load_state_dict(newer)
    lacking = sealed({k: v for k, v in state.items() if k != "planned_checks"})
    with pytest.raises(ValueError, match=r"state lacks \['planned_checks'\]"):
        _checked_monitor().load_state_dict(lacking)


def test_a_shuffling_batch_sampler_is_warned_as_a_shuffling_loader():
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    data = torch.utils.data.TensorDataset(torch.randn(20))
    query = CallableQuery(lambda b: b[0], name="s")
    shuffled = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 5, False))
    with pytest.warns(UserWarning, match="members is a shuffling DataLoader"):
        privmon.PrivacyMonitor(query, shuffled, [np.zeros(5)])
    ordered = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 5, False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        privmon.PrivacyMonitor(query, ordered, [np.zeros(5)])


def test_a_merge_of_different_grids_and_a_singular_kde_say_how_to_fix_them():
    from privmon.estimators import StreamingAdvantage

    rng = np.random.default_rng(0)
    here, there = StreamingAdvantage(), StreamingAdvantage()
    here.update(rng.normal(size=50), rng.normal(size=50))
    there.update(rng.normal(size=50) + 5, rng.normal(size=50))  # its own first batch: its grid
    with pytest.raises(ValueError, match=r"this state: 100 bins over \[.*\], 4 folds; the other"
                       r".*same low, high, bins and folds"):  # fmt: skip
        here.merge_(there)
    fixed = [StreamingAdvantage(low=-6.0, high=10.0) for _ in range(2)]
    fixed[0].update(rng.normal(size=50), rng.normal(size=50))
    fixed[1].update(rng.normal(size=50) + 5, rng.normal(size=50))
    fixed[0].merge_(fixed[1])  # the fix the message names
    synthetic = rng.normal(size=(60, 3))
    synthetic[:, 2] = synthetic[:, 0] + synthetic[:, 1]  # collinear: a singular covariance
    with pytest.raises(ValueError, match=r"singular.*embed='pca'.*density='flow'"):
        privmon.domias_scores(rng.normal(size=(10, 3)), synthetic, rng.normal(size=(60, 3)))


def test_an_early_stopping_threshold_below_the_priors_floor_is_refused():
    # every advantage figure is at least |2p - 1|: a budget below it stopped at the first check
    query = CallableQuery(lambda b: b[:, 0], name="loss")
    members, heldout = [torch.randn(100, 1)], [torch.randn(1000, 1)]

    def monitor(threshold, metric="loss/histogram", prior=100 / 1100):
        stopping = privmon.PrivacyEarlyStopping(metric, threshold)
        return privmon.PrivacyMonitor(
            query, members, heldout, every_n_steps=1, prior=prior, early_stopping=stopping
        )

    with pytest.raises(ValueError, match=r"threshold 0.15 .* below \|2·prior − 1\| = 0.8182"):
        monitor(0.15)
    with pytest.raises(ValueError, match=r"privacy/loss/kde/value is below"):
        monitor(0.3, metric="privacy/loss/kde/value", prior=0.3)
    assert monitor(0.9).step(1) is False  # above the floor: nothing leaks, no stop
    monitor(0.15, prior=0.5)  # at p = 1/2 the floor is 0
    monitor(0.15, metric="privacy/epsilon")  # not an advantage figure
    with pytest.raises(ValueError, match=r"threshold must be in the closed interval \[0, 1\]"):
        monitor(-1.0)  # below 0: it would stop at the first check whatever leaks
