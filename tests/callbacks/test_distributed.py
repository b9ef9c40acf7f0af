"""Real 2-process gloo groups: each rank audits its shard and the figures equal one process's; a
failure or a disagreement on one rank skips the check (or the query) on every rank, so that no
rank is left waiting in a collective, and the group stays usable. A check is one exchange (the
ranks' headers, then their scores to rank 0), the analysis on rank 0 alone, and one broadcast of
its outcome: three collectives.

The ranks run every case in one spawn (starting processes is the slow part); each case is
followed by a healthy check on the same group. Collectives time out after 30 s instead of the
30-minute default, and the spawn fails the tests when it outlives ``ranks.DEADLINE_S``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import pickle
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import rank_results, spawned_results
from torch import nn

import privmon.callbacks.check_analysis as analysis_module
import privmon.callbacks.check_outcome as outcome_module
import privmon.callbacks.score_exchange as exchange_module
from privmon._failure import Failure
from privmon.callbacks import LossTracing, PrivacyEarlyStopping, PrivacyMonitor
from privmon.callbacks.distributed import Header, RankFailure, StageFailure, agree_on_headers
from privmon.callbacks.monitor import PrivacyViolationWarning
from privmon.queries import CallableQuery, LossQuery
from privmon.report import tags
from privmon.sinks import JsonlSink

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
MEETING_TIMEOUT = datetime.timedelta(seconds=120)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 2))


def _audit():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(360, 6, generator=g)
    y = torch.randint(0, 2, (360,), generator=g)  # random labels: only memorising fits them
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(60):  # overfit the member half so there is something to measure
        opt.zero_grad()
        F.cross_entropy(model(x[:180]), y[:180]).backward()
        opt.step()
    members = [(x[i : i + 30], y[i : i + 30]) for i in range(0, 180, 30)]
    nonmembers = [(x[i : i + 40], y[i : i + 40]) for i in range(180, 360, 40)]
    return model, members, nonmembers


def _shard(rank, members, nonmembers):
    """Contiguous shards, uneven on purpose: rank 0 gets 4 member batches, rank 1 gets 2."""
    return (members[:4], nonmembers[:2]) if rank == 0 else (members[4:], nonmembers[2:])


def _monitor(model, members, nonmembers, logdir=None):
    return PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        strict=True,
        writer=None if logdir is None else str(logdir),
        sinks=None if logdir is None else JsonlSink(f"{logdir}/checks.jsonl"),
        early_stopping=PrivacyEarlyStopping("privacy/loss/auc", 0.0),  # an AUC above 0 trips it
    )


class _Accountant:
    """An accountant that works, or raises as one that lost its history would."""

    def __init__(self, epsilon, *, broken=False):
        self.epsilon, self.broken = epsilon, broken

    def get_epsilon(self, delta):
        if self.broken:
            raise RuntimeError("accountant lost its history")
        return self.epsilon


class _Log(logging.Handler):
    """privmon's log lines (with the exception's message) on this rank."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        line = record.getMessage()
        if record.exc_info:
            line += " | " + "".join(traceback.format_exception_only(record.exc_info[1])).strip()
        self.lines.append(line)


def _outcome(run):
    """What ``run()`` gave on this rank: its report's scalars and failures, or its error."""
    try:
        report = run()
    except Exception as err:
        return {"raised": f"{type(err).__name__}: {err}"}
    if report is None:
        return {"report": None}
    return {"report": dict(report.scalars), "failures": dict(report.failures)}


def _cases(rank, model, members, nonmembers, restored, tmp):
    """Every fault case: name -> a function that builds its monitor on this rank and returns it
    with the call to run."""
    mem, non = _shard(rank, members, nonmembers)

    def loss(b):
        return F.cross_entropy(model(b[0]), b[1], reduction="none")

    def make(queries, **kw):
        return PrivacyMonitor(queries, mem, non, methods=("histogram",), **kw)

    def check(mon):
        return mon, lambda: mon.check(10)

    def layouts(strict):
        queries = [
            LossQuery(model),
            # float64 on rank 1, float32 on rank 0
            CallableQuery(lambda b: loss(b).double() if rank else loss(b), name="dtype"),
            # (n, 4) on rank 1, (n, 3) on rank 0
            CallableQuery(lambda b: model[0](b[0])[:, : 3 + rank], name="width"),
            # (n, 1) on rank 1, (n,) on rank 0
            CallableQuery(lambda b: loss(b)[:, None] if rank else loss(b), name="ndim"),
            CallableQuery(lambda b: _broken_on(rank, 1, loss(b)), name="flaky"),
        ]
        return check(make(queries[:2] if strict else queries, strict=strict))

    def analysis(strict):
        mon = make([LossQuery(model), CallableQuery(loss, name="margin")], strict=strict)

        def run():
            original = analysis_module.analyse

            def out_of_memory(*args, name, **kw):  # rank 0, which analyses, runs out of memory
                if rank == 0 and name == "margin":
                    raise MemoryError("simulated: out of memory analysing 'margin'")
                return original(*args, name=name, **kw)

            analysis_module.analyse = out_of_memory
            try:
                return mon.check(10)
            finally:
                analysis_module.analyse = original

        return mon, run

    def patched(module, name, fake):
        """A check run with ``module.name`` replaced by ``fake(original)`` on rank 0 only."""
        mon = make([LossQuery(model), CallableQuery(loss, name="margin")])

        def run():
            original = getattr(module, name)
            if rank == 0:
                setattr(module, name, fake(original))
            try:
                return mon.check(10)
            finally:
                setattr(module, name, original)

        return mon, run

    def out_of_memory(_original):
        def rebuilt(*args, **kwargs):  # rank 0 runs out of memory rebuilding what it received
            raise MemoryError("simulated: out of memory rebuilding the scores")

        return rebuilt

    class Unpicklable:  # rank 0's outcome cannot be pickled for the broadcast
        @staticmethod
        def dumps(obj):
            raise TypeError("simulated: cannot pickle the outcome")

    def accountant(strict):
        return check(
            make(LossQuery(model), accountant=_Accountant(2.0, broken=rank == 0), strict=strict)
        )

    def building():
        # rank 0 turns warnings into errors: the DP-violation warning raises there while it
        # builds the report (ε = 0 leaves no room for the leak)
        mon = make(LossQuery(model), accountant=_Accountant(0.0))

        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore" if rank else "error", PrivacyViolationWarning)
                return mon.check(10)

        return mon, run

    def steps():
        # rank 1 restored the state of a run that already checked at step 100; rank 0 did not.
        # step(100): rank 1 has checked it, so both pass it by (the ranks decide together).
        # Explicit checks at different steps (100 on rank 0, 200 on rank 1) meet: both skip,
        # and rank 0, now behind, passes step 200 by, so both check at 300 together.
        mon = make(LossQuery(model), every_n_steps=100)
        if rank == 1:
            mon.load_state_dict(restored)

        def run():
            mon.step(100)
            assert mon.n_failed == 0 and len(mon.history) == rank  # nobody checked step 100
            mon.check(100 if rank == 0 else 200)
            for s in (200, 300):
                mon.step(s)
            last = mon.last_report
            return last if last is not None and last.step == 300 else None

        return mon, run

    def setup():  # rank 1 monitors one more query
        return check(make([LossQuery(model)] + [CallableQuery(loss, name="extra")] * rank))

    def settings():  # the same queries, another prior on rank 1
        return check(make(LossQuery(model), prior=0.5 + 0.1 * rank))

    def stopping(strict):  # a typo on every rank: deciding fails on rank 0, which decides
        stopper = PrivacyEarlyStopping("privacy/loss/acu", 0.0)
        return check(make(LossQuery(model), early_stopping=stopper, strict=strict))

    def stopping_differs():  # a typo on rank 1: the ranks' budgets differ
        metric = "privacy/loss/auc" if rank == 0 else "privacy/loss/acu"
        stopper = PrivacyEarlyStopping(metric, 0.0)  # an AUC above 0 trips it
        return check(make(LossQuery(model), early_stopping=stopper))

    def schedule(strict):  # rank 1 checks every 50 steps, rank 0 every 100
        mon = make(LossQuery(model), every_n_steps=100 if rank == 0 else 50, strict=strict)

        def run():
            for s in (50, 100, 150, 200):
                mon.step(s)
            return mon.last_report

        return mon, run

    def empty():  # rank 1's member shard is empty: it contributes its non-members only
        members_shard = mem if rank == 0 else []
        mon = PrivacyMonitor(LossQuery(model), members_shard, non, methods=("histogram",))
        return mon, lambda: mon.check(10)

    def sink():  # rank 0, the only one that writes, has a sink whose write raises
        sinks = [JsonlSink(f"{tmp}/sink{rank}.jsonl")] if rank == 0 else []
        for s in sinks:
            s.close()
        return check(make(LossQuery(model), sinks=sinks, strict=True))

    return {
        "layouts": lambda: layouts(False),
        "layouts_strict": lambda: layouts(True),
        "accountant": lambda: accountant(False),
        "accountant_strict": lambda: accountant(True),
        "analysis": lambda: analysis(False),
        "analysis_strict": lambda: analysis(True),
        "building": building,
        "steps": steps,
        "setup": setup,
        "settings": settings,
        "stopping": lambda: stopping(False),
        "stopping_strict": lambda: stopping(True),
        "stopping_differs": stopping_differs,
        "sink_strict": sink,
        "schedule": lambda: schedule(False),
        "schedule_strict": lambda: schedule(True),
        "empty": empty,
        "gathering": lambda: patched(exchange_module, "_rebuilt", out_of_memory),
        "sending": lambda: patched(outcome_module, "pickle", lambda _: Unpicklable),
    }


def _broken_on(rank, bad, scores):
    if rank == bad:
        raise RuntimeError(f"scorer broke on rank {bad}")
    return scores


COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
)  # fmt: skip


def _counted(run):
    """``run()`` with every torch.distributed collective privmon calls and every query analysed
    on this rank listed, in order."""
    calls, analysed = [], []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    analyse = analysis_module.analyse

    def counting(name, fn):
        def counted(*args, **kw):
            calls.append(name)
            return fn(*args, **kw)

        return counted

    def analysing(*args, name, **kw):
        analysed.append(name)
        return analyse(*args, name=name, **kw)

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    analysis_module.analyse = analysing
    try:
        run()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        analysis_module.analyse = analyse
    return calls, analysed


def _loop_batches(rank, step):
    """The training loop's batches on ``rank`` at ``step``: (record indices, per-sample losses),
    rank 0 training records 0-179 and rank 1 records 180-359, each record's loss its own curve."""
    idx = torch.arange(180 * rank, 180 * rank + 180)
    loss = (idx % 7 + 1) * torch.exp(-step * (idx % 5 + 1).float() / 50)
    return list(zip(idx.split(60), loss.split(60), strict=True))


def _traced(rank, model, members, nonmembers, tmp=None, *, ranks=(0,)):
    """A monitor with two queries, early stopping, a sink and loss traces, the loop's losses of
    ``ranks`` recorded before each of its checks at steps 100, 200 (both by ``step()``) and
    300 (by ``check()``): the collectives of the last two, and its last report's traced
    figures."""

    def loss(b):
        return F.cross_entropy(model(b[0]), b[1], reduction="none")

    mon = PrivacyMonitor(
        [LossQuery(model), CallableQuery(loss, name="margin")],
        members,
        nonmembers,
        every_n_steps=100,
        sinks=None if tmp is None else JsonlSink(f"{tmp}/count{rank}.jsonl"),
        early_stopping=PrivacyEarlyStopping("loss/histogram", 0.99),
        loss_traces=LossTracing(360, top_k=12),
    )

    def trained(first, run):
        for step in range(first, first + 100, 10):
            for r in ranks:
                for idx, losses in _loop_batches(r, step):
                    mon.record_losses(idx, losses, step=step)
        return run()

    trained(1, lambda: mon.step(100))
    out = {
        "step": _counted(lambda: trained(101, lambda: mon.step(200))),
        "check": _counted(lambda: trained(201, lambda: mon.check(300))),
    }
    report = mon.last_report
    out["traced"] = (
        {k: v.to_json() for k, v in report.vulnerable.items()},
        {k: v for k, v in report.scalars.items() if tags.parse_loss_tnr(k)},
    )
    return out


def _counts(rank, model, members, nonmembers, tmp):
    """The collectives and analyses of one check by ``step()`` (after the first, which agrees
    on the schedule once per run) and by ``check()``, with two queries, early stopping, a sink
    and loss traces (the loop's losses of this rank's batches, merged on rank 0)."""
    return _traced(rank, model, *_shard(rank, members, nonmembers), tmp, ranks=(rank,))


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    model, members, nonmembers = _audit()
    restored = None
    if rank == 1:  # a check before the group exists: a state as a restored checkpoint holds
        early = PrivacyMonitor(
            LossQuery(model), *_shard(1, members, nonmembers), methods=("histogram",)
        )
        early.check(100)
        restored = early.state_dict()
    # meeting may take long on loaded cores; collectives give up after GROUP_TIMEOUT
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=MEETING_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    log = _Log()
    logging.getLogger("privmon").addHandler(log)
    with rank_results(rank, tmp) as out:
        mon = _monitor(model, *_shard(rank, members, nonmembers), f"{tmp}/ddp")
        stop = mon.step(100)
        rep = mon.last_report
        out["equal"] = {
            "scalars": rep.scalars,
            "top": list(rep.queries["loss"].top_records),
            "stop": stop,
        }
        mon.close()
        out["count"] = _counts(rank, model, members, nonmembers, tmp)
        cases = _cases(rank, model, members, nonmembers, restored, tmp)
        for name, case in cases.items():
            log.lines.clear()
            started = time.monotonic()
            mon, run = case()
            result = _outcome(run)
            result.update(
                n_failed=mon.n_failed,
                should_stop=mon.should_stop,
                log=list(log.lines),
                seconds=time.monotonic() - started,
            )
            # the group is still alive: a healthy check right after
            healthy = PrivacyMonitor(
                LossQuery(model), *_shard(rank, members, nonmembers), methods=("histogram",)
            )
            result["after"] = _outcome(functools.partial(healthy.check, 1))
            out[name] = result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo")
    out = spawned_results(_worker, tmp)  # fails, never hangs
    return tmp, out


@pytest.fixture(scope="module")
def expected():
    """One process holding every audit record: the figures both ranks must reach."""
    model, members, nonmembers = _audit()
    report = _monitor(model, members, nonmembers).check(100)
    healthy = PrivacyMonitor(LossQuery(model), members, nonmembers, methods=("histogram",))
    return report, healthy.check(1)


def test_two_gloo_ranks_equal_one_process(ranks, expected):
    tmp, (r0, r1) = ranks
    report = expected[0]
    assert r0["equal"]["scalars"] == report.scalars  # bit-for-bit: same records, same order
    assert r1["equal"]["scalars"] == r0["equal"]["scalars"]
    assert r0["equal"]["top"] == list(report.queries["loss"].top_records) == r1["equal"]["top"]
    assert r0["equal"]["stop"] is True and r1["equal"]["stop"] is True  # they stop together
    assert report.scalars["privacy/loss/histogram/value"] > 0.1  # there is a leak to agree on
    lines = [json.loads(line) for line in (tmp / "ddp" / "checks.jsonl").read_text().splitlines()]
    # rank 0 alone writes: the check, then (at close) the budget's outcome, once (#38)
    assert [line.get("step") for line in lines] == [100, None]
    assert lines[1]["stopping_outcome"]["stopped_step"] == 100
    assert len(list((tmp / "ddp").glob("events.out.tfevents.*"))) == 1


CASES = [
    "layouts",
    "layouts_strict",
    "accountant",
    "accountant_strict",
    "analysis",
    "analysis_strict",
    "building",
    "steps",
    "setup",
    "settings",
    "stopping",
    "stopping_strict",
    "stopping_differs",
    "sink_strict",
    "schedule",
    "schedule_strict",
    "empty",
    "gathering",
    "sending",
]


@pytest.mark.parametrize("case", CASES)
def test_the_group_survives_and_stays_consistent(ranks, expected, case):
    _, (r0, r1) = ranks
    a, b = r0[case], r1[case]
    assert a["n_failed"] == b["n_failed"]
    assert a["should_stop"] == b["should_stop"]
    # both return the same report, or both skip the check, or both raise
    assert a.get("report") == b.get("report") and a.get("failures") == b.get("failures")
    assert ("raised" in a) == ("raised" in b)
    # the same group then checks as one process would
    healthy = expected[1].scalars
    assert a["after"]["report"] == b["after"]["report"] == healthy


def _logged(result, text):
    return any(text in line for line in result["log"])


def test_queries_whose_scores_differ_between_ranks_are_left_out_everywhere(ranks, expected):
    _, (r0, r1) = ranks
    a, b = r0["layouts"], r1["layouts"]
    assert a["n_failed"] == b["n_failed"] == 0
    assert a["failures"] == b["failures"]
    reasons = a["failures"]
    assert set(reasons) == {"dtype", "width", "ndim", "flaky"}
    assert "rank 0: members float32 (n,)" in reasons["dtype"]
    assert "rank 1: members float64 (n,)" in reasons["dtype"]
    assert "float32 (n, 3)" in reasons["width"] and "float32 (n, 4)" in reasons["width"]
    assert "float32 (n,)" in reasons["ndim"] and "float32 (n, 1)" in reasons["ndim"]
    assert reasons["flaky"] == "failed on rank 1: RuntimeError: scorer broke on rank 1"
    # the query every rank agrees on is still measured on all 360 records
    full = expected[0].scalars["privacy/loss/histogram/value"]
    assert a["report"]["privacy/loss/histogram/value"] == full
    assert _logged(a, "'dtype' is left out on every rank") and _logged(b, "'width' is left out")
    # a query that failed on one rank is logged there as it failed, and as left out elsewhere
    assert _logged(a, "'flaky' is left out on every rank: failed on rank 1")
    assert not _logged(b, "'flaky' is left out") and _logged(b, "scorer broke on rank 1")
    # strict: every rank raises
    a, b = r0["layouts_strict"], r1["layouts_strict"]
    assert "differ in dtype or shape" in a["raised"] and a["raised"] == b["raised"]
    assert a["n_failed"] == b["n_failed"] == 1


def test_accountant_failing_on_rank_0_skips_the_check_on_every_rank(ranks):
    """Rank 0 alone reads ε (it alone analyses): its accountant failing fails the check."""
    _, (r0, r1) = ranks
    a, b = r0["accountant"], r1["accountant"]
    assert a["report"] is None and b["report"] is None
    assert a["n_failed"] == b["n_failed"] == 1
    assert _logged(b, "failed on rank 0: RuntimeError: accountant lost its history")
    assert _logged(a, "RuntimeError: accountant lost its history")
    a, b = r0["accountant_strict"], r1["accountant_strict"]
    assert a["raised"] == "RuntimeError: accountant lost its history"  # its own error
    assert b["raised"].startswith("RankFailure: privmon: reading ε or the analysis failed on ")
    assert "failed on rank 0" in b["raised"]
    assert a["n_failed"] == b["n_failed"] == 1


def test_analysis_failing_on_rank_0_leaves_the_query_out_everywhere(ranks):
    _, (r0, r1) = ranks
    a, b = r0["analysis"], r1["analysis"]
    assert a["report"] == b["report"] and a["n_failed"] == b["n_failed"] == 0
    assert "privacy/loss/histogram/value" in a["report"]
    assert not any("margin" in tag for tag in a["report"])
    # as one process says it: the analysis ran once, on rank 0
    assert a["failures"] == b["failures"]
    assert a["failures"]["margin"] == "MemoryError: simulated: out of memory analysing 'margin'"
    assert _logged(a, "the analysis of query 'margin' failed")
    a, b = r0["analysis_strict"], r1["analysis_strict"]
    assert a["raised"].startswith("MemoryError: simulated")
    assert "failed on rank 0: MemoryError: simulated" in b["raised"]
    assert a["n_failed"] == b["n_failed"] == 1


def test_building_the_report_failing_on_rank_0_skips_the_check(ranks):
    _, (r0, r1) = ranks
    a, b = r0["building"], r1["building"]
    assert a["report"] is None and b["report"] is None
    assert a["n_failed"] == b["n_failed"] == 1
    assert _logged(b, "building the report failed on rank 0: PrivacyViolationWarning")


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("gathering", "gathering the scores failed on rank 0: MemoryError: simulated"),
        ("sending", "sending the outcome failed on rank 0: TypeError: simulated"),
    ],
)
def test_rank_0_failing_after_the_exchange_still_sends_its_outcome(ranks, case, said):
    """After the headers the others wait for rank 0's outcome: a failure there (rebuilding the
    gathered scores, pickling the outcome) is the outcome, so every rank leaves the check."""
    _, (r0, r1) = ranks
    a, b = r0[case], r1[case]
    assert a["report"] is None and b["report"] is None
    assert a["n_failed"] == b["n_failed"] == 1
    assert _logged(b, said)


def test_ranks_at_different_steps_skip_then_realign(ranks):
    _, (r0, r1) = ranks
    a, b = r0["steps"], r1["steps"]
    assert a["n_failed"] == b["n_failed"] == 1  # the check at 100 / 200, on both ranks
    assert _logged(a, "rank 0 at step 100, rank 1 at step 200")
    assert _logged(b, "rank 0 at step 100, rank 1 at step 200")
    # both then check at step 300, with the same share of the run's δ: the same report
    assert a["report"] is not None and a["report"] == b["report"]
    assert _logged(a, "rank 0: 0, rank 1: 1")  # the spent checks, aligned on the most
    # check 3 of the run (rank 1's restored check, the failed one, this), not check 2
    assert a["report"]["privacy/certify_delta"] == pytest.approx(0.0065453116615, rel=1e-10)


def test_monitors_set_up_differently_skip_the_check(ranks):
    _, (r0, r1) = ranks
    a, b = r0["setup"], r1["setup"]
    assert a["report"] is None and b["report"] is None
    assert a["n_failed"] == b["n_failed"] == 1
    assert _logged(a, "set up differently") and _logged(b, "['loss', 'extra']")
    a, b = r0["settings"], r1["settings"]  # the same queries under another prior
    assert a["report"] is None and b["report"] is None
    assert a["n_failed"] == b["n_failed"] == 1
    assert _logged(a, "set up differently") and _logged(b, "'prior': 0.6")


def test_stopping_or_a_sink_failing_on_rank_0_raises_on_every_rank_when_strict(ranks):
    """Rank 0 decides on early stopping and writes: a failure there is every rank's."""
    _, (r0, r1) = ranks
    a, b = r0["stopping"], r1["stopping"]  # not strict: logged on rank 0, no decision taken
    assert a["report"] == b["report"] and a["report"] is not None
    assert not a["should_stop"] and not b["should_stop"]
    assert _logged(a, "early stopping can never fire")
    a, b = r0["stopping_strict"], r1["stopping_strict"]
    assert a["raised"].startswith("ValueError: privmon: early stopping can never fire")
    assert "early stopping failed on rank 0: ValueError" in b["raised"]
    assert a["n_failed"] == b["n_failed"] == 0  # as one process: the check itself succeeded
    a, b = r0["stopping_differs"], r1["stopping_differs"]  # budgets differ: set up differently
    assert a["report"] is None and b["report"] is None
    assert a["n_failed"] == b["n_failed"] == 1
    assert _logged(a, "set up differently") and _logged(b, "privacy/loss/acu")
    a, b = r0["sink_strict"], r1["sink_strict"]
    assert a["raised"].startswith("ValueError: I/O operation on closed file")
    assert "writing the report failed on rank 0: ValueError: I/O operation on closed" in b["raised"]


def test_ranks_on_different_schedules_take_rank_0s(ranks, expected):
    _, (r0, r1) = ranks
    a, b = r0["schedule"], r1["schedule"]
    assert a["n_failed"] == b["n_failed"] == 0
    assert a["report"] is not None and a["report"] == b["report"]  # both checked 100 and 200
    assert _logged(a, "different schedules (every_n_steps: rank 0: 100, rank 1: 50)")
    assert _logged(b, "every rank checks every 100 steps, as rank 0 does")
    a, b = r0["schedule_strict"], r1["schedule_strict"]
    assert "different schedules" in a["raised"] and a["raised"] == b["raised"]


def test_an_empty_shard_contributes_nothing_instead_of_vetoing(ranks):
    _, (r0, r1) = ranks
    a, b = r0["empty"], r1["empty"]
    assert a["n_failed"] == b["n_failed"] == 0 and a["report"] == b["report"]
    # one process auditing rank 0's members and every non-member
    model, members, nonmembers = _audit()
    alone = PrivacyMonitor(LossQuery(model), members[:4], nonmembers, methods=("histogram",))
    assert a["report"] == dict(alone.check(10).scalars)


def test_the_rank_whose_collection_failed_raises_its_own_error():
    """The headers as every rank reads them: the rank whose collection failed raises the error
    itself, the others a RankFailure naming it (as the spawned cases show)."""
    own = MemoryError("simulated: out of memory collecting the scores")
    failed = Header(
        step=1, setup=(["loss"], ""), spent=0, checked=False,
        error=StageFailure("collecting the scores", 0, Failure.of(own)), failed={}, layouts={},
        rows={}, findings={}, forward=0.0, sent={},
    )  # fmt: skip
    other = dataclasses.replace(failed, error=None)
    with pytest.raises(MemoryError) as raised:
        agree_on_headers([failed, other], mine=failed, error=own, strict=False)
    assert raised.value is own
    with pytest.raises(RankFailure, match="collecting the scores failed on rank 0: MemoryError"):
        agree_on_headers([failed, other], mine=other, error=None, strict=False)
    # a rank that had checked the step: every rank skips it, failures and all
    checked = dataclasses.replace(other, checked=True)
    assert agree_on_headers([failed, checked], mine=failed, error=own, strict=False) is None


def test_one_check_is_three_collectives_and_one_analysis_on_rank_0(ranks):
    _, outs = ranks
    for rank, out in enumerate(outs):
        for how in ("step", "check"):
            calls, analysed = out["count"][how]
            # the headers, the scores to rank 0, rank 0's outcome
            expected = ["all_gather_object", "all_to_all_single", "broadcast_object_list"]
            assert calls == expected, (rank, how)
            assert analysed == (["loss", "margin"] if rank == 0 else []), (rank, how)


def test_the_loss_traces_of_the_ranks_merge_in_the_exchange_as_one_process_keeps_them(ranks):
    """Each rank records its own batches' losses; at the check they travel with the scores to
    rank 0, whose most vulnerable records by LT-IQR (the loop's, and the members' losses over
    the checks) and LOSS TNR equal one process's that recorded every batch."""
    _, outs = ranks
    model, members, nonmembers = _audit()
    vulnerable, tnr = _traced(0, model, members, nonmembers, ranks=(0, 1))["traced"]
    assert set(vulnerable) == {tags.TRAINING_LOOP, "loss"} and len(tnr) == 2
    assert vulnerable[tags.TRAINING_LOOP]["n_scored"] == 360
    got_vulnerable, got_tnr = outs[0]["count"]["traced"]
    assert got_vulnerable[tags.TRAINING_LOOP] == vulnerable[tags.TRAINING_LOOP]
    assert got_vulnerable["loss"]["records"] == vulnerable["loss"]["records"]
    assert got_vulnerable["loss"]["scores"] == pytest.approx(vulnerable["loss"]["scores"], abs=1e-6)
    assert got_tnr == pytest.approx(tnr, abs=1e-12)
    assert outs[1]["count"]["traced"] == outs[0]["count"]["traced"]  # every rank's report


def test_one_process_runs_no_collective(monkeypatch):
    """Outside a process group a check exchanges nothing (nor builds a header to pickle)."""
    calls = []
    for name in COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
    monkeypatch.setattr(
        "privmon.callbacks.check_exchange.Header", lambda **kw: calls.append("header")
    )
    model, members, nonmembers = _audit()
    mon = _monitor(model, members, nonmembers)
    assert mon.step(100) is True and mon.check(200) is not None
    assert calls == []


def test_the_scores_travel_as_their_bytes_in_any_dtype():
    """Packed and rebuilt through the collective on a one-rank gloo group: bit exact, odd
    sizes and mixed dtypes packed back to back (each rebuilt aligned), NaN payloads included."""
    from privmon.callbacks.distributed import Agreement, layout_of
    from privmon.callbacks.score_exchange import gather_scores, packed

    g = torch.Generator().manual_seed(0)
    nan = torch.tensor([float("nan")], dtype=torch.float64).view(torch.int64) | 12345
    scores = {
        "half": (torch.randn(7, generator=g).half(), torch.randn(3, generator=g).half()),
        "wide": (torch.randn(5, 3, generator=g).double(), nan.view(torch.float64).repeat(2, 3)),
        "bf16": (torch.randn(1, 2, generator=g).bfloat16(), torch.randn(4, 2).bfloat16()),
        "flags": (torch.rand(3, generator=g) > 0.5, torch.zeros(0, dtype=torch.bool)),
        "ints": (torch.arange(9).reshape(9, 1), torch.arange(2).reshape(2, 1)),
    }
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mine, sent = packed(scores)
        layouts = {
            n: tuple(x or layout_of((s[0], s[0]))[0] for x in layout_of(s))
            for n, s in scores.items()
        }
        agreed = Agreement(
            rows={n: ([s[0].shape[0]], [s[1].shape[0]]) for n, s in scores.items()},
            layouts=layouts, left_out={}, spent=0, forward=0.0, findings=[{}], sent=[sent],
        )  # fmt: skip
        back, traces, failed = gather_scores(mine, agreed, like=scores)
        assert failed is None and [t.numel() for t in traces] == [0]
        # loss-trace bytes after the scores: they come back, exactly, apart from the scores
        extra = torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8)
        with_traces = dataclasses.replace(agreed, traces=[(1, 5, 0, extra.numel())])
        again, traces, failed = gather_scores(packed(scores, extra)[0], with_traces, like=scores)
        assert failed is None and traces[0].tolist() == extra.tolist()
        assert all(torch.equal(again[n][0].view(torch.uint8), back[n][0].view(torch.uint8))
                   for n in scores)  # fmt: skip
    finally:
        dist.destroy_process_group()
    for name, sides in scores.items():
        for a, b in zip(sides, back[name], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.view(torch.uint8).tolist() == b.view(torch.uint8).tolist(), name


def _thirds(rank, batches):
    """Contiguous shards over 3 ranks, uneven when the batches do not split evenly."""
    return batches[rank * len(batches) // 3 : (rank + 1) * len(batches) // 3]


def _three_ranks_run(model, members, nonmembers):
    """A monitor of two queries (one 2-D, float64) with early stopping, checked three times."""
    mon = PrivacyMonitor(
        [LossQuery(model), CallableQuery(lambda b: model(b[0]).double(), name="logits")],
        members,
        nonmembers,
        every_n_steps=100,
        early_stopping=PrivacyEarlyStopping("loss/histogram", 0.2, patience=1),
    )
    for step in (100, 200, 300):
        mon.step(step)
    reports = [(r.step, r.scalars, r.failures, r.stopping) for r in mon.history]
    last = mon.last_report.queries
    posteriors = {n: r.member_posterior.tobytes() for n, r in last.items()}
    return {"reports": reports, "posteriors": posteriors, "state": mon.state_dict()}


def _three_worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    model, members, nonmembers = _audit()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=MEETING_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        out = _three_ranks_run(model, _thirds(rank, members), _thirds(rank, nonmembers))
    finally:
        dist.destroy_process_group()
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


def test_three_gloo_ranks_equal_one_process_and_keep_one_state(tmp_path):
    outs = spawned_results(_three_worker, tmp_path, world=3)
    alone = _three_ranks_run(*_audit())
    for out in outs:  # the same figures, bit for bit, and the same state on every rank
        assert out["reports"] == alone["reports"] and out["posteriors"] == alone["posteriors"]
        assert _same(out["state"], outs[0]["state"])  # run id, timings and digest too


def _same(a, b):
    """Equal, tensors byte for byte (NaN and all), through dicts and lists."""
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
