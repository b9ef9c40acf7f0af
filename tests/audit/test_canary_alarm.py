"""The DP alarm from one-run canary audits: the figures a check reports, the verdict and the
charts that show them, and the monitor raising the alarm on a DP-SGD run whose optimizer adds no
noise (real Opacus) while a correct run stays quiet."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from dp_sgd import with_noise_factor

from privmon.audit import one_run_epsilon
from privmon.callbacks.canary_audit import (
    CANARY_METHODS,
    canary_figures,
    check_canaries,
)
from privmon.estimators.spending import check_delta
from privmon.report import Report, verdict
from privmon.report.runs import checks_from_reports
from privmon.report.tags import canary_epsilon


def _scores(seed=0, n=4000, shift=3.0):
    rng = np.random.default_rng(seed)
    return rng.normal(shift, 1.0, n), rng.normal(0.0, 1.0, n)


def test_canary_figures_are_one_run_epsilon_at_the_checks_significance():
    ins, outs = _scores()
    fig = canary_figures(ins, outs, delta=1e-5, significance=0.01, epsilon=None, step=7)
    for method in CANARY_METHODS:
        audit = one_run_epsilon(ins, outs, delta=1e-5, significance=0.01, method=method)
        assert fig.scalars[canary_epsilon(method)] == audit.epsilon > 1.0
    assert fig.scalars["privacy/canaries/n_canaries"] == 8000
    assert not fig.violation and fig.messages == ()  # no accountant: nothing to compare with


def test_an_audited_epsilon_above_the_accountants_is_a_violation():
    ins, outs = _scores()
    low = canary_figures(ins, outs, delta=1e-5, significance=0.01, epsilon=0.5, step=7)
    assert low.violation and len(low.messages) == 2
    assert "step 7" in low.messages[0] and "accountant's ε = 0.5" in low.messages[0]
    high = canary_figures(ins, outs, delta=1e-5, significance=0.01, epsilon=50.0, step=7)
    assert not high.violation
    nan = canary_figures(ins, outs, delta=1e-5, significance=0.01, epsilon=float("nan"), step=7)
    assert not nan.violation


def test_canaries_without_scores_are_refused():
    with pytest.raises(ValueError, match="canaries must have a scores"):
        check_canaries(object())


def _report(step, canary_eps, epsilon, run_id="r"):
    scalars = {
        "privacy/q/histogram/value": 0.05,
        "privacy/q/histogram/lower": 0.0,
        "privacy/q/histogram/epsilon_lower_bound": 0.0,
    }
    if epsilon is not None:
        scalars["privacy/epsilon"] = epsilon
    for method, eps in zip(CANARY_METHODS, canary_eps, strict=True):
        scalars[canary_epsilon(method)] = eps
    return Report(step=step, scalars=scalars, epsilon=epsilon, run_id=run_id)


def test_the_verdict_names_a_canary_violation_without_the_exchangeability_caveat():
    checks = checks_from_reports([_report(10, (1.0, 0.8), 3.67), _report(20, (7.3, 5.1), 3.67)])
    v = verdict(checks)
    assert v.level == "violation"
    assert "step 20" in v.headline and "canary audit (fdp) certifies ε ≥ 7.3" in v.headline
    assert "whatever the audit sets" in v.details[0]
    assert not any("exchangeable (the audited" in d for d in v.details)


def test_the_verdict_reports_the_canaries_when_they_stay_under_the_accountant():
    checks = checks_from_reports([_report(10, (1.0, 0.8), 3.67), _report(20, (2.1, 1.5), 3.67)])
    v = verdict(checks)
    assert v.level == "none"
    assert any("largest audited ε lower bound was 2.1 (step 20, fdp)" in d for d in v.details)


def test_the_page_and_tensorboard_draw_accountant_and_audited_epsilon(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from privmon.report import render_html
    from privmon.sinks import TensorBoardSink

    reports = [_report(10, (1.0, 0.8), 3.67), _report(20, (2.1, 1.5), 3.67)]
    pytest.importorskip("matplotlib")
    page = render_html(checks_from_reports(reports))
    assert "epsilon: accountant vs audited lower bounds" in page and "canary audit" in page
    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer)
    for r in reports:
        sink.write(r)
    sink.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    # first, the ε chart of named series (#38): the accountant's, the canaries' largest bound
    first = {c.title for c in layout.category[0].chart}
    named = ["ε (accountant)", "ε lower bound (one-run canary audit)"]
    assert f"ε: {named[0]}, {named[1]} and ε lower bound (black-box attacks)" in first
    expected = ["privacy/epsilon", *(canary_epsilon(m) for m in CANARY_METHODS)]
    assert charts["epsilon: accountant vs one-run canary audit"] == [
        re.escape(t) + "$" for t in expected
    ]


# -- the monitor on real DP-SGD ------------------------------------------------------------------

N, BATCH, SIGMA, CLIP, LR = 300, 30, 2.0, 1.0, 0.3  # q = 0.1


def _dp_run(noise_factor: float, *, canaries: int = 20_000, steps: int = 120, seed: int = 0):
    """A linear model trained by Opacus DP-SGD under a monitor with gradient canaries; with
    ``noise_factor`` < 1 the optimizer silently adds that fraction of the noise it reports (the
    accountant still reads σ). Returns the monitor and the accountant's final ε."""
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privmon import PrivacyMonitor
    from privmon.audit import GradientCanaries
    from privmon.queries import LossQuery

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2 * N, 8, generator=g), torch.randint(0, 3, (2 * N,), generator=g)
    model = nn.Linear(8, 3)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(TensorDataset(x[:N], y[:N]), batch_size=BATCH),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    if noise_factor != 1.0:  # the silent bug: σ · factor in add_noise, σ again for the hook
        with_noise_factor(optimizer, noise_factor)
    monitor = PrivacyMonitor(
        LossQuery(model),
        [(x[:100], y[:100])],
        [(x[N : N + 100], y[N : N + 100])],
        every_n_steps=60,
        methods=("histogram",),
        accountant=engine,
        canaries=GradientCanaries(optimizer, canaries, seed=seed),
        strict=True,
    )
    step = 0
    while step < steps:
        for xb, yb in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            step += 1
            monitor.step(step)
            if step == steps:
                break
    return monitor, float(engine.get_epsilon(1e-5))


ignore_opacus_warnings = pytest.mark.filterwarnings(
    "ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"
)


@ignore_opacus_warnings
def test_a_correct_dp_sgd_run_stays_under_the_accountant():
    pytest.importorskip("opacus")
    monitor, eps = _dp_run(1.0)
    report = monitor.last_report
    assert [r.step for r in monitor.history] == [60, 120]
    for method in CANARY_METHODS:
        audited = report.scalars[canary_epsilon(method)]
        assert 0.0 < audited < eps
    assert report.scalars["privacy/dp_violation"] == 0.0 and not report.dp_violation
    assert report.dp_causes == ()
    # the check's δ is split over one query's figure and the canaries' two bounds; the three
    # statistical tests of their mechanism checks (noise variance, sampling mean and dispersion)
    # split the check's share of the alarm's own level, dp_alarm_delta (1e-4)
    assert len(monitor.canaries.statistical_tests) == 3
    assert report.scalars["privacy/certify_delta"] == check_delta(2, delta=0.05) / 3
    assert report.scalars["privacy/dp_alarm_delta"] == check_delta(2, delta=1e-4) / 3


@ignore_opacus_warnings
def test_a_dp_sgd_run_whose_optimizer_adds_no_noise_raises_the_alarm():
    pytest.importorskip("opacus")
    from privmon import PrivacyViolationWarning

    with pytest.warns(PrivacyViolationWarning, match="one-run canary audit"):
        monitor, eps = _dp_run(0.0)
    report = monitor.last_report
    for method in CANARY_METHODS:
        assert report.scalars[canary_epsilon(method)] > eps
    assert report.dp_violation and report.scalars["privacy/dp_violation"] == 1.0
    assert any("canary audit" in m for m in report.messages)
    assert verdict(checks_from_reports(monitor.history)).level == "violation"


def test_input_canaries_bound_to_a_query_feed_the_monitor():
    from torch import nn

    from privmon import PrivacyMonitor
    from privmon.audit import InputCanaries
    from privmon.queries import LossQuery

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    g = torch.Generator().manual_seed(1)
    records = torch.utils.data.TensorDataset(
        torch.randn(40, 4, generator=g), torch.randint(0, 2, (40,), generator=g)
    )
    canaries = InputCanaries(records, query=LossQuery(model), seed=3)
    x, y = torch.randn(60, 4, generator=g), torch.randint(0, 2, (60,), generator=g)
    monitor = PrivacyMonitor(
        LossQuery(model),
        [(x[:30], y[:30])],
        [(x[30:], y[30:])],
        every_n_steps=1,
        methods=("histogram",),
        canaries=canaries,
        strict=True,
    )
    report = monitor.check(1)
    ins, outs = canaries.scores()
    audit = one_run_epsilon(
        ins, outs, delta=1e-5, significance=report.scalars["privacy/certify_delta"], method="fdp"
    )
    assert report.scalars[canary_epsilon("fdp")] == audit.epsilon
    assert "privacy/dp_violation" not in report.scalars  # no accountant: nothing to compare
    with pytest.raises(ValueError, match="canaries must have a scores"):
        PrivacyMonitor(LossQuery(model), [(x[:30], y[:30])], [(x[30:], y[30:])], canaries=records)
