"""The DP mechanism checks through the monitor: a canaries object's findings decided at the check's
alarm level (its share of dp_alarm_delta, split over the statistical tests; interval_delta is the
certificates' alone), a test without a p-value said and never a violation, the alarm naming its
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
from privmon._failure import Failure
from privmon.audit.mechanism import MechanismFinding
from privmon.callbacks.mechanism_audit import decide_findings
from privmon.estimators.spending import check_delta
from privmon.queries import CallableQuery
from privmon.report import read_checks, verdict
from privmon.report import tags as T
from privmon.report.formatting import fmt
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
    smallest = fmt(_alarm_level(3, tests=2), 3)  # the level of the last of the 3 checks
    assert (
        f"false alarms over the whole run stay below dp_alarm_delta; the smallest level of "
        f"the run: {smallest}." in page
    )
    (tmp_path / "checks.jsonl").unlink()
    assert verdict(read_checks(tmp_path)).headline == headline  # the event files' text


def _alarm_level(k, *, tests, dp_alarm_delta=1e-4, planned_checks=None):
    """The level of each statistical test at check ``k``, from the formula: the check's share
    of ``dp_alarm_delta`` over its ``tests``."""
    return check_delta(k, delta=dp_alarm_delta, planned_checks=planned_checks) / tests


def test_statistical_findings_fire_below_their_share_of_dp_alarm_delta(caplog):
    level = _alarm_level(1, tests=2)  # the fake's 2 statistical tests
    with pytest.warns(PrivacyViolationWarning, match="at step 1: sampling — 600 rows"):
        below = _monitor(FakeChecks(p=level * (1 - 1e-9), scores=True)).check(1)
    assert below.scalars[T.DP_ALARM_DELTA] == level
    # interval_delta is the certificates' alone: one query by one method, the 2 canary bounds
    assert below.scalars[T.CERTIFY_DELTA] == check_delta(1, delta=0.05) / 3
    assert below.dp_violation and below.scalars[T.dp_check_fired("sampling")] == 1.0
    assert below.dp_causes == (
        f"{SAMPLING} (mean test: p = {level * (1 - 1e-9):.3g}, below the alarm level of each "
        f"statistical test, {level:.3g}: this check's share of dp_alarm_delta)",
    )
    above = _monitor(FakeChecks(p=level * (1 + 1e-9), scores=True)).check(1)
    assert not above.dp_violation and above.scalars[T.dp_check_fired("sampling")] == 0.0
    assert above.dp_causes == () and above.messages == () and above.failures == {}
    # the monitor's level: the same formula at another dp_alarm_delta
    wide = 0.9 * _alarm_level(1, tests=2, dp_alarm_delta=0.01)
    with pytest.warns(PrivacyViolationWarning, match="mean test: p = "):
        wider = _monitor(FakeChecks(p=wide), dp_alarm_delta=0.01).check(1)
    assert wider.dp_violation and wider.scalars[T.DP_ALARM_DELTA] == _alarm_level(
        1, tests=2, dp_alarm_delta=0.01
    )


@pytest.mark.parametrize("p", [None, math.nan])
def test_a_statistical_test_without_a_p_value_is_said_never_silent_never_a_violation(p, caplog):
    with caplog.at_level(logging.WARNING, logger="privmon"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", PrivacyViolationWarning)  # none may come
            report = _monitor(FakeChecks(p=p, scores=True)).check(3)
    assert math.isnan(report.scalars[T.dp_check_p_value("sampling", "mean")])
    assert not report.dp_violation and report.dp_causes == () and report.messages == ()
    assert report.scalars[T.dp_check_fired("sampling")] == 0.0
    said = (
        "the mean test of the sampling check gave no p-value (NaN or none) at step 3: "
        f"undecided, not a DP violation; its evidence: {SAMPLING}"
    )
    assert report.failures == {"dp_checks/sampling/mean": said}
    assert f"privmon: {said}" in caplog.text
    # decided alone, the same: a failure value beside the figures
    found = [MechanismFinding("noise", "variance", "statistical", False, p, "")]
    figures, undecided = decide_findings(found, alarm_delta=1e-6, step=9)
    assert not figures.violation and figures.causes == ()
    assert undecided["dp_checks/noise/variance"].reason == (
        "the variance test of the noise check gave no p-value (NaN or none) at step 9: "
        "undecided, not a DP violation"
    )


def test_a_test_undecided_on_one_place_is_decided_on_the_others_and_said():
    from privmon.callbacks.mechanism_audit import agreed_findings

    def rank(p):
        return {"checks": (MechanismFinding("noise", "variance", "statistical", False, p, "x"),)}

    findings, failures = agreed_findings([rank(0.3), rank(math.nan), rank(0.1)])
    assert [f.p_value for f in findings] == [pytest.approx(0.2)]  # min 0.1 × the 2 that gave one
    assert failures == {
        "dp_checks/noise/variance": Failure(
            "the variance test of the noise check gave no p-value on rank 1: decided on the "
            "others' alone"
        )
    }
    findings, failures = agreed_findings([rank(None), rank(math.nan)])  # nowhere: decide's
    assert findings[0].p_value is None and failures == {}


def test_the_alarm_level_is_spent_over_the_planned_checks():
    monitor = _monitor(FakeChecks(), planned_checks=4)
    with pytest.warns(UserWarning, match="check 5 is past planned_checks=4"):
        levels = [monitor.check(k).scalars[T.DP_ALARM_DELTA] for k in range(1, 7)]
    assert levels == [_alarm_level(k, tests=2, planned_checks=4) for k in range(1, 7)]
    assert levels[0] == 1e-4 * 0.9 / 4 / 2  # (1 - η) of it evenly over the plan
    assert sum(levels) * 2 < 1e-4  # its checks' tests together: within dp_alarm_delta
    assert all(T.CERTIFY_DELTA in monitor.history[k].scalars for k in range(6))


def test_the_budget_counts_the_certified_figures_and_the_alarms_tests_apart():
    plain = _monitor(None).check(1)
    assert plain.scalars[T.CERTIFY_DELTA] == check_delta(1, delta=0.05) / 1
    assert T.DP_ALARM_DELTA not in plain.scalars
    # two objects: 2 bounds of the one with scores (the query's figure: 3); 2 + 2 tests
    both = _monitor([FakeChecks(scores=True, name="a"), FakeChecks(name="b")]).check(1)
    assert both.scalars[T.CERTIFY_DELTA] == check_delta(1, delta=0.05) / 3
    assert both.scalars[T.DP_ALARM_DELTA] == _alarm_level(1, tests=4)
    # the mechanism checks take nothing of interval_delta
    assert (
        _monitor(FakeChecks()).check(1).scalars[T.CERTIFY_DELTA] == plain.scalars[T.CERTIFY_DELTA]
    )
    FakeChecks.statistical_tests, saved = (), FakeChecks.statistical_tests
    try:
        none = _monitor(FakeChecks()).check(1)
    finally:
        FakeChecks.statistical_tests = saved
    assert none.scalars[T.CERTIFY_DELTA] == plain.scalars[T.CERTIFY_DELTA]
    assert T.dp_check_p_value("sampling", "mean") not in none.scalars  # undeclared: left out
    assert T.DP_ALARM_DELTA not in none.scalars  # no statistical test, no level


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -1e-4, math.nan, math.inf, "1e-4", True, None])
def test_dp_alarm_delta_is_checked_naming_it_and_its_range(bad):
    with pytest.raises(ValueError, match=r"dp_alarm_delta .*\(0, 1\)"):
        _monitor(FakeChecks(), dp_alarm_delta=bad)


def test_false_alarms_of_the_statistical_tests_stay_under_dp_alarm_delta():
    """Seeded null: uniform p-values for 3 tests at each of 20 checks of 4,000 runs, decided at
    each check's level (a run-level dp_alarm_delta of 0.05, for the count to resolve it):
    runs with any alarm ≤ 0.05, within the binomial noise."""
    rng = np.random.default_rng(0)
    runs, checks, tests, budget = 4000, 20, 3, 0.05
    alarms = np.zeros(runs, dtype=bool)
    for k in range(1, checks + 1):
        level = _alarm_level(k, tests=tests, dp_alarm_delta=budget)
        p = rng.uniform(size=(runs, tests))
        for r in np.flatnonzero(p.min(axis=1) < level * 10):  # the few that could fire
            found = [
                MechanismFinding("noise", f"t{i}", "statistical", False, float(p[r, i]), "noise: x")
                for i in range(tests)
            ]
            alarms[r] |= decide_findings(found, alarm_delta=level, step=k)[0].violation
    assert 0.01 < alarms.mean() <= budget + 3 * math.sqrt(budget * (1 - budget) / runs)


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


# -- a real Opacus run with GradientCanaries: the canaries alone keep today's figures, and the
# mechanism checks and their level leave every certified figure as it is ----------------------


def _opacus_run(**options):
    """A seeded DP-SGD run of 10 steps, one check at step 10: (its report, the canaries)."""
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privmon.audit import GradientCanaries
    from privmon.queries import LossQuery

    checks = options.pop("checks", None)
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
    kinds = {} if checks is None else {"checks": checks}
    canaries = GradientCanaries(optimizer, 500, seed=1, **kinds)
    monitor = PrivacyMonitor(
        LossQuery(model), [(x[:50], y[:50])], [(x[100:150], y[100:150])], every_n_steps=10,
        methods=("histogram",), accountant=engine, canaries=canaries, strict=True, **options,
    )  # fmt: skip
    step = 0
    for xb, yb in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        step += 1
        monitor.step(step)
    assert [r.step for r in monitor.history] == [10]
    return monitor, canaries


opacus_warnings = pytest.mark.filterwarnings(
    "ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"
)


@opacus_warnings
def test_one_gradient_canaries_object_keeps_todays_tags_and_values():
    pytest.importorskip("opacus")
    from privmon.audit import one_run_epsilon

    monitor, canaries = _opacus_run(checks=())  # the canaries alone
    report = monitor.last_report
    assert not any(T.parse_dp_check(t) for t in report.scalars) and report.dp_causes == ()
    assert T.DP_ALARM_DELTA not in report.scalars
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


@opacus_warnings
def test_the_mechanism_checks_and_their_level_leave_the_certified_figures_bit_identical():
    pytest.importorskip("opacus")

    def certified(report):  # every figure but the mechanism checks' own and the verdict
        mechanism = (T.DP_ALARM_DELTA, T.DP_VIOLATION)
        kept = report.scalars.items()
        return {t: v for t, v in kept if not T.parse_dp_check(t) and t not in mechanism}

    alone = _opacus_run(checks=())[0].last_report
    checked = _opacus_run()[0].last_report
    wider = _opacus_run(dp_alarm_delta=0.01)[0].last_report
    assert T.lower("loss", "histogram") in certified(alone)
    assert certified(checked) == certified(alone) == certified(wider)  # bit for bit
    # the checks ran, and decided at their own level: 3 statistical tests at check 1
    assert checked.scalars[T.DP_ALARM_DELTA] == _alarm_level(1, tests=3)
    assert wider.scalars[T.DP_ALARM_DELTA] == _alarm_level(1, tests=3, dp_alarm_delta=0.01)
    assert T.dp_check_p_value("noise", "variance") in checked.scalars
    assert not checked.dp_violation


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
