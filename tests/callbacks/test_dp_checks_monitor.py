"""The DP mechanism checks through the monitor: a canaries object's findings decided at the check's
δ per certified figure (each statistical test one more certified figure), the alarm naming its
cause (report, warning, JSON lines, TensorBoard, MLflow, the HTML verdict of ``privmon report``),
several canaries objects with distinct tags, a failing ``mechanism()`` logged and counted, the
canaries' alarm surviving every query failing, and a real GradientCanaries run without checks
keeping today's figures. Fake canaries objects return chosen findings; the findings themselves
are the audit helpers' (tests/test_mechanism*.py)."""

from __future__ import annotations

import json
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import RecordingSink

from privmon import PrivacyMonitor, PrivacyViolationWarning
from privmon.audit.mechanism import MechanismFinding
from privmon.callbacks.mechanism_audit import decide_findings
from privmon.estimators.spending import check_delta
from privmon.queries import CallableQuery
from privmon.report import read_checks, verdict
from privmon.report import tags as T
from privmon.sinks import JsonlSink

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLIPPING = "clipping: a row of norm 100 contributed 100.0, above C = 1.0"
SAMPLING = "sampling: 600 rows in each of 400 steps, the accountant assumes Binomial(600, 0.1)"


class FakeChecks:
    """A canaries object with chosen findings: ``clipping`` fires from check ``fire_at`` on,
    the sampling tests give ``p`` (a number, or a function of the check's number); optional
    ``scores()``."""

    statistical_tests = (("sampling", "mean"), ("sampling", "dispersion"))

    def __init__(self, *, fire_at=None, p=0.5, scores=False, name=None, fail=False):
        self.calls, self.fire_at, self.p, self.fail = 0, fire_at, p, fail
        if name is not None:
            self.name = name
        if scores:
            self.scores = self._scores

    def _scores(self):
        rng = np.random.default_rng(0)
        return rng.normal(0.0, 1.0, 400), rng.normal(0.0, 1.0, 400)

    def mechanism(self, accountant=None):
        self.calls += 1
        if self.fail:
            raise RuntimeError("the probe could not run")
        fired = self.fire_at is not None and self.calls >= self.fire_at
        p = self.p(self.calls) if callable(self.p) else self.p
        return (
            MechanismFinding("clipping", "probe", "deterministic", fired, None, CLIPPING),
            MechanismFinding("sampling", "mean", "statistical", False, p, SAMPLING),
            MechanismFinding("sampling", "dispersion", "statistical", False, 0.9, SAMPLING),
        )


def _sets(seed=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, 1.0, 200)], [rng.normal(0.0, 1.0, 200)]


def _query(**kw):
    return CallableQuery(lambda b: b, name="q", higher_is_member=True, **kw)


def _monitor(canaries, **kwargs):
    members, nonmembers = _sets()
    kwargs.setdefault("methods", ("histogram",))
    return PrivacyMonitor(
        _query(), members, nonmembers, every_n_steps=1, canaries=canaries, **kwargs
    )


def _run(monitor, steps):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in steps:
            monitor.step(step)
    monitor.close()
    return [str(w.message) for w in caught if w.category is PrivacyViolationWarning]


def test_a_check_that_fires_sets_the_violation_and_names_its_cause_everywhere(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from privmon.cli import main

    monitor = _monitor(
        FakeChecks(fire_at=2), writer=str(tmp_path), sinks=JsonlSink(tmp_path / "checks.jsonl")
    )
    warned = _run(monitor, [100, 200, 300])
    first, last = monitor.history[0], monitor.last_report
    assert not first.dp_violation and first.dp_causes == ()
    assert first.scalars[T.dp_check_fired("clipping")] == 0.0
    assert first.scalars[T.DP_VIOLATION] == 0.0  # written although there is no accountant
    assert last.dp_violation and last.dp_causes == (CLIPPING,)
    assert last.scalars[T.dp_check_fired("clipping")] == 1.0
    assert last.scalars[T.dp_check_fired("sampling")] == 0.0
    assert last.scalars[T.dp_check_p_value("sampling", "mean")] == 0.5
    assert last.scalars[T.dp_check_p_value("sampling", "dispersion")] == 0.9
    assert [r.dp_causes for r in monitor.history] == [(), (CLIPPING,), (CLIPPING,)]
    assert len(warned) == 2 and warned[0].startswith(
        "privmon: DP violation at step 200: clipping — a row of norm 100 contributed 100.0, "
        "above C = 1.0. The mechanism that ran is not the one the accountant assumed (each "
        "record's gradient clipped to C)"
    )
    assert last.messages == (warned[1],)
    # the JSON lines: the scalars, and the causes only where there are some
    lines = [json.loads(x) for x in (tmp_path / "checks.jsonl").read_text().splitlines()]
    assert [line["scalars"][T.dp_check_fired("clipping")] for line in lines] == [0.0, 1.0, 1.0]
    assert "dp_causes" not in lines[0] and lines[2]["dp_causes"] == [CLIPPING]
    assert lines[2]["scalars"][T.dp_check_p_value("sampling", "mean")] == 0.5
    # TensorBoard: the scalars and the causes' text at their steps
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    fired = [(e.step, e.value) for e in acc.Scalars(T.dp_check_fired("clipping"))]
    assert fired == [(100, 0.0), (200, 1.0), (300, 1.0)]
    assert [e.value for e in acc.Scalars(T.dp_check_p_value("sampling", "mean"))] == [0.5] * 3
    texts = acc.Tensors(T.DP_CAUSES_EVENT_TAG)
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in texts] == [
        (200, CLIPPING),
        (300, CLIPPING),
    ]
    # the verdict of privmon report, from the JSON lines and from the event files alone
    headline = (
        "DP violation at step 200: clipping — a row of norm 100 contributed 100.0, above C = 1.0."
    )
    v = verdict(read_checks(tmp_path))
    assert v.level == "violation" and v.headline == headline
    assert "clipping at 2 of 3 checks (first at step 200" in v.details[0]
    pytest.importorskip("matplotlib")
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "privacy_report.html").read_text()
    assert headline in page and "DP mechanism checks" in page
    assert "at 2 of 3 checks (first at step 200)" in page
    (tmp_path / "checks.jsonl").unlink()
    assert verdict(read_checks(tmp_path)).headline == headline  # the event files' text


def test_statistical_findings_fire_below_the_checks_delta_per_certified_figure():
    # one query by one method, the canaries' 2 bounds and their 2 statistical tests: 5 figures
    share = check_delta(1, delta=0.05) / 5
    with pytest.warns(PrivacyViolationWarning, match="at step 1: sampling — 600 rows"):
        below = _monitor(FakeChecks(p=share * (1 - 1e-9), scores=True)).check(1)
    assert below.scalars[T.CERTIFY_DELTA] == share  # the δ split counts the tests
    assert below.dp_violation and below.scalars[T.dp_check_fired("sampling")] == 1.0
    assert below.dp_causes == (
        f"{SAMPLING} (mean test: p = {share * (1 - 1e-9):.3g}, below the δ of each certified "
        f"figure, {share:.3g})",
    )
    above = _monitor(FakeChecks(p=share * (1 + 1e-9), scores=True)).check(1)
    assert not above.dp_violation and above.scalars[T.dp_check_fired("sampling")] == 0.0
    assert above.dp_causes == () and above.messages == ()
    nan = _monitor(FakeChecks(p=None, scores=True)).check(1)  # no p-value yet: nothing fires
    assert math.isnan(nan.scalars[T.dp_check_p_value("sampling", "mean")])
    assert not nan.dp_violation


def test_the_budget_counts_one_figure_per_statistical_test_of_every_object():
    plain = _monitor(None).check(1).scalars[T.CERTIFY_DELTA]
    assert plain == check_delta(1, delta=0.05) / 1
    # two objects: 2 bounds of the one with scores, 2 + 2 statistical tests
    both = _monitor([FakeChecks(scores=True, name="a"), FakeChecks(name="b")]).check(1)
    assert both.scalars[T.CERTIFY_DELTA] == check_delta(1, delta=0.05) / 7
    # a deterministic check spends nothing
    FakeChecks.statistical_tests, saved = (), FakeChecks.statistical_tests
    try:
        none = _monitor(FakeChecks()).check(1)
    finally:
        FakeChecks.statistical_tests = saved
    assert none.scalars[T.CERTIFY_DELTA] == plain
    assert T.dp_check_p_value("sampling", "mean") not in none.scalars  # undeclared: left out


def test_false_alarms_of_the_statistical_tests_stay_under_the_runs_budget():
    """Seeded null: uniform p-values for 3 tests at each of 20 checks of 4,000 runs, decided at
    each check's share (3 tests + 1 query figure): runs with any alarm ≤ 3/4 · interval_delta
    (the tests' part of the union bound), within the binomial noise."""
    rng = np.random.default_rng(0)
    runs, checks, tests, budget = 4000, 20, 3, 0.05
    alarms = np.zeros(runs, dtype=bool)
    for k in range(1, checks + 1):
        delta = check_delta(k, delta=budget) / (tests + 1)
        p = rng.uniform(size=(runs, tests))
        for r in np.flatnonzero(p.min(axis=1) < delta * 10):  # the few that could fire
            found = [
                MechanismFinding("noise", f"t{i}", "statistical", False, float(p[r, i]), "noise: x")
                for i in range(tests)
            ]
            alarms[r] |= decide_findings(found, delta=delta, step=k).violation
    bound = budget * tests / (tests + 1)
    assert alarms.mean() <= bound + 3 * math.sqrt(bound * (1 - bound) / runs)


def test_several_canaries_objects_have_tags_of_their_own():
    objects = [FakeChecks(scores=True, name="gradient"), FakeChecks(scores=True, name="records")]
    report = _monitor(objects).check(1)
    for source in ("gradient", "records"):
        for method in ("fdp", "steinke"):
            assert T.canary_epsilon(method, source) in report.scalars
        assert T.canary_count(source) in report.scalars
    assert T.canary_epsilon("fdp") not in report.scalars
    assert T.parse_canary(T.canary_epsilon("fdp", "records")) == "records/fdp"
    with pytest.raises(ValueError, match=r"distinct names .* \['fake', 'fake'\]"):
        _monitor([FakeChecks(name="fake"), FakeChecks(name="fake")])
    with pytest.raises(ValueError, match="canaries must have a scores"):
        _monitor([FakeChecks(), object()])
    with pytest.raises(ValueError, match="statistical_tests must be distinct"):
        bad = FakeChecks()
        bad.statistical_tests = (("sampling", "mean"), ("sampling", "mean"))
        _monitor(bad)


def test_a_failing_mechanism_is_logged_and_counted_and_training_goes_on(caplog):
    monitor = _monitor([FakeChecks(fail=True, name="broken"), FakeChecks(fire_at=1, name="ok")])
    with caplog.at_level(logging.ERROR, logger="privmon"):
        warned = _run(monitor, [1])
    report = monitor.last_report
    assert report.failures == {"dp_checks/broken": "RuntimeError: the probe could not run"}
    assert report.dp_violation and report.dp_causes == (CLIPPING,)  # the other object's
    assert len(warned) == 1 and monitor.n_failed == 0
    assert "the DP mechanism checks of the canaries 'broken' failed at step 1" in caplog.text
    alone = _monitor(FakeChecks(fail=True)).check(1)  # its only mechanism object failed
    assert alone.failures == {"dp_checks/fakechecks": "RuntimeError: the probe could not run"}
    assert not any(T.parse_dp_check(t) for t in alone.scalars)
    with pytest.raises(RuntimeError, match="the probe could not run"):
        _monitor(FakeChecks(fail=True), strict=True).check(1)


def _failing(batch):
    raise RuntimeError("query broke")


@pytest.mark.parametrize("how", ["analysis", "collection"])
def test_the_canaries_alarm_survives_every_query_failing(how):
    members, nonmembers = _sets()
    if how == "analysis":  # every query's scores come, its analysis fails
        query = CallableQuery(lambda b: np.full(len(b), np.nan), name="q")
    else:  # the collection fails as a whole: the sets hold the same records
        query, nonmembers = _query(), [members[0].copy()]
    sink = RecordingSink()
    monitor = PrivacyMonitor(
        query, members, nonmembers, every_n_steps=1, canaries=FakeChecks(fire_at=1),
        sinks=sink, methods=("histogram",),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = monitor.check(7)
    assert report is not None and report.queries == {} and "q" in report.failures
    assert report.dp_violation and report.dp_causes == (CLIPPING,)
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("privmon: DP violation at step 7: clipping —") for m in messages)
    assert any(m.startswith("privmon: every query failed at step 7") for m in messages)
    assert sink.reports == [report] and monitor.n_failed == 0
    # without canaries such a check fails, as before
    plain = PrivacyMonitor(query, members, nonmembers, every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert plain.check(7) is None
    assert plain.n_failed == 1


def test_a_report_of_the_canaries_alone_leaves_early_stopping_alone():
    from privmon import PrivacyEarlyStopping

    members, nonmembers = _sets()
    stopping = PrivacyEarlyStopping("q/histogram", 0.9)
    monitor = PrivacyMonitor(
        CallableQuery(lambda b: np.full(len(b), np.nan), name="q"), members, nonmembers,
        every_n_steps=1, canaries=FakeChecks(), early_stopping=stopping, methods=("histogram",),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert monitor.step(1) is False
    assert not any("can never fire" in str(w.message) for w in caught)
    assert stopping.checks_seen == 0


def test_an_undeclared_p_value_is_left_out_and_said_once(caplog):
    fake = FakeChecks()
    fake.statistical_tests = (("sampling", "mean"),)  # dispersion undeclared
    monitor = _monitor(fake)
    with caplog.at_level(logging.ERROR, logger="privmon"):
        monitor.check(1)
        report = monitor.check(2)
    assert T.dp_check_p_value("sampling", "dispersion") not in report.scalars
    assert T.dp_check_p_value("sampling", "mean") in report.scalars
    assert caplog.text.count("which their statistical_tests") == 1


def test_the_monitor_state_records_the_canaries_setup():
    one = _monitor(FakeChecks(scores=True))
    state = one.state_dict()
    assert state["canaries"] == [
        "fakechecks: fdp, steinke, sampling/mean, sampling/dispersion (mechanism)"
    ]
    one.check(1)
    resumed = _monitor(FakeChecks(scores=True))
    resumed.load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="canaries"):
        _monitor(None).load_state_dict(one.state_dict())


def test_mlflow_gets_the_checks_flags_and_p_values(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from privmon.sinks import MlflowSink

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("dp-checks")).info.run_id
    monitor = _monitor(FakeChecks(fire_at=1), sinks=MlflowSink(run_id=run, tracking_uri=uri))
    _run(monitor, [5])
    metrics = client.get_run(run).data.metrics
    assert metrics[T.dp_check_fired("clipping")] == 1.0
    assert metrics[T.dp_check_p_value("sampling", "mean")] == 0.5
    assert metrics[T.DP_VIOLATION] == 1.0


# -- a real Opacus run with GradientCanaries (no mechanism checks yet) keeps today's figures ----


@pytest.mark.filterwarnings("ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward")
def test_one_gradient_canaries_object_keeps_todays_tags_and_values():
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privmon.audit import GradientCanaries, one_run_epsilon
    from privmon.queries import LossQuery

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 6, generator=g), torch.randint(0, 2, (200,), generator=g)
    engine, model = PrivacyEngine(), nn.Linear(6, 2)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x[:100], y[:100]), batch_size=10),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    canaries = GradientCanaries(optimizer, 500, seed=1, checks=())  # the canaries alone
    monitor = PrivacyMonitor(
        LossQuery(model), [(x[:50], y[:50])], [(x[100:150], y[100:150])], every_n_steps=10,
        methods=("histogram",), accountant=engine, canaries=canaries, strict=True,
    )  # fmt: skip
    step = 0
    for xb, yb in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        step += 1
        monitor.step(step)
    report = monitor.last_report
    assert [r.step for r in monitor.history] == [10]
    assert not any(T.parse_dp_check(t) for t in report.scalars) and report.dp_causes == ()
    canary_tags = [t for t in report.scalars if t.startswith("privacy/canaries/")]
    assert canary_tags == [
        T.canary_epsilon("fdp"),
        T.CANARY_COUNT,
        T.canary_epsilon("steinke"),
    ]
    delta = check_delta(1, delta=0.05) / 3  # one figure of the query, two canary bounds
    assert report.scalars[T.CERTIFY_DELTA] == delta
    ins, outs = canaries.scores()
    for method in ("fdp", "steinke"):
        audit = one_run_epsilon(ins, outs, delta=1e-5, significance=delta, method=method)
        assert report.scalars[T.canary_epsilon(method)] == audit.epsilon
    assert monitor.state_dict()["canaries"] is True


def test_the_verdict_names_the_mechanism_check_first_and_reads_scalars_alone():
    from privmon.report import Report, checks_from_reports

    def report(step, *, causes=(), fired=0.0, canary=1.0):
        scalars = {
            "privacy/q/histogram/value": 0.05,
            "privacy/q/histogram/lower": 0.0,
            "privacy/q/histogram/epsilon_lower_bound": 0.0,
            T.EPSILON: 3.67,
            T.canary_epsilon("fdp"): canary,
            T.dp_check_fired("sampling"): fired,
            T.dp_check_p_value("sampling", "mean"): 1e-9 if fired else 0.4,
        }
        return Report(
            step=step, scalars=scalars, epsilon=3.67, dp_violation=bool(fired) or canary > 3.67,
            dp_causes=causes, run_id="r",
        )  # fmt: skip

    both = verdict(checks_from_reports([report(10), report(20, causes=(SAMPLING,), fired=1.0,
                                                         canary=7.3)]))  # fmt: skip
    assert both.level == "violation"
    assert both.headline == (
        "DP violation at step 20: sampling — 600 rows in each of 400 steps, the accountant "
        "assumes Binomial(600, 0.1)."
    )
    assert both.details[1].startswith(
        "Besides, the one-run canary audit (fdp) certifies ε ≥ 7.3, above the accountant's "
        "ε = 3.67: flagged at 1 of 2 checks (steps 20)."
    )
    scalars_only = verdict(checks_from_reports([report(10, fired=1.0)]))
    assert scalars_only.headline == (
        "DP violation at step 10: sampling — the check fired (mean test p = 1.00e-09)."
    )
    quiet = verdict(checks_from_reports([report(10)]))
    assert quiet.level == "none"
    assert "DP mechanism checks (sampling): none fired at any of the 1 checks." in quiet.details


def test_a_nan_in_one_record_alarms_with_its_own_cause_through_the_monitor():
    """One NaN input value in one training record, Opacus unmodified: the monitor's alarm names
    the clipping check's finding (the row and the step it entered), not repeated noise, and no
    p-value it reports is NaN."""
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privmon.audit import GradientCanaries
    from privmon.queries import LossQuery

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 6, generator=g), torch.randint(0, 2, (300,), generator=g)
    train = x[:200].clone()
    train[17, 2] = float("nan")
    engine, model = PrivacyEngine(), nn.Linear(6, 2)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(train, y[:200]), batch_size=20),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    canaries = GradientCanaries(optimizer, 500, seed=1)
    monitor = PrivacyMonitor(
        LossQuery(model), [(x[:50], y[:50])], [(x[200:250], y[200:250])], every_n_steps=40,
        methods=("histogram",), accountant=engine, canaries=canaries,
    )  # fmt: skip
    step = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            for xb, yb in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
                step += 1
                monitor.step(step)
    report = monitor.last_report
    assert report.dp_violation
    assert len(report.dp_causes) == 1 and report.dp_causes[0].startswith(
        "clipping: a per-sample gradient of record slot "
    )
    assert "passed clipping unbounded" in report.dp_causes[0]
    assert not any("repeats the noise" in cause for cause in report.dp_causes)
    p_values = [v for t, v in report.scalars.items() if (T.parse_dp_check(t) or (0, None))[1]]
    assert p_values and not any(math.isnan(v) for v in p_values)
    assert any(issubclass(w.category, PrivacyViolationWarning) for w in caught)
