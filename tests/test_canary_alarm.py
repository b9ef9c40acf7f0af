"""The DP alarm from one-run canary audits: the figures a check reports, the verdict and the
charts that show them, and the monitor raising the alarm on a DP-SGD run whose optimizer adds no
noise (real Opacus) while a correct run stays quiet."""

from __future__ import annotations

import re

import numpy as np
import pytest

from privmon.audit import one_run_epsilon
from privmon.callbacks.canary_audit import (
    CANARY_METHODS,
    canary_figures,
    canary_tag,
    check_canaries,
)
from privmon.report import Report, verdict
from privmon.report.runs import checks_from_reports


def _scores(seed=0, n=4000, shift=3.0):
    rng = np.random.default_rng(seed)
    return rng.normal(shift, 1.0, n), rng.normal(0.0, 1.0, n)


def test_canary_figures_are_one_run_epsilon_at_the_checks_significance():
    ins, outs = _scores()
    fig = canary_figures(ins, outs, delta=1e-5, significance=0.01, epsilon=None, step=7)
    for method in CANARY_METHODS:
        audit = one_run_epsilon(ins, outs, delta=1e-5, significance=0.01, method=method)
        assert fig.scalars[canary_tag(method)] == audit.epsilon > 1.0
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
        scalars[canary_tag(method)] = eps
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
    expected = ["privacy/epsilon", *(canary_tag(m) for m in CANARY_METHODS)]
    assert charts["epsilon: accountant vs one-run canary audit"] == [
        re.escape(t) + "$" for t in expected
    ]
