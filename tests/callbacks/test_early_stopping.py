"""Tests for privacy-aware early stopping: the pure decision function ``stopping_decision`` in its
documented order, ``PrivacyEarlyStopping`` (tag resolution, staying stopped, persistence through
``torch.save`` / ``torch.load(weights_only=True)``, argument validation) and its wiring into a real
``PrivacyMonitor``."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from privmon import PrivacyEarlyStopping, PrivacyMonitor
from privmon.callbacks import stopping_decision
from privmon.queries import LossQuery

NAN, INF = float("nan"), float("inf")


def _decide(value, *, threshold=0.5, checks_seen=5, min_checks=1, wait=0, patience=0):
    return stopping_decision(
        value,
        threshold=threshold,
        checks_seen=checks_seen,
        min_checks=min_checks,
        wait=wait,
        patience=patience,
    )


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _scalars(value=0.0, lower=0.0, upper=0.0, auc=0.5):
    return {
        "privacy/loss/histogram/value": value,
        "privacy/loss/histogram/lower": lower,
        "privacy/loss/histogram/plugin_upper": upper,
        "privacy/loss/auc": auc,
    }


# --- stopping_decision -------------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("wait", [0, 3])
def test_non_finite_never_stops_and_keeps_wait(value, wait):
    # Even with patience 0 and a wait already past it, a non-finite figure decides nothing.
    assert _decide(value, wait=wait, patience=0) == (False, wait, None)


@pytest.mark.parametrize("value", [0.5, 0.2, -3.0])
def test_at_or_below_threshold_resets_wait(value):
    assert _decide(value, threshold=0.5, wait=7, patience=10) == (False, 0, None)


def test_patience_zero_stops_at_first_exceedance():
    stop, wait, reason = _decide(0.75, threshold=0.5, wait=0, patience=0)
    assert (stop, wait) == (True, 1)
    assert reason == (
        "privacy figure 0.7500 above the budget 0.5000 for 1 consecutive check(s) (patience 0)"
    )


def test_patience_two_stops_at_third_consecutive_exceedance():
    wait, decisions = 0, []
    for _ in range(3):
        stop, wait, reason = _decide(0.9, threshold=0.5, wait=wait, patience=2)
        decisions.append((stop, wait, reason is not None))
    assert decisions == [(False, 1, False), (False, 2, False), (True, 3, True)]


def test_dip_below_threshold_restarts_the_count():
    wait, out = 0, []
    for v in (0.9, 0.9, 0.1, 0.9, 0.9, 0.9):
        stop, wait, _ = _decide(v, threshold=0.5, wait=wait, patience=2)
        out.append((stop, wait))
    assert out == [(False, 1), (False, 2), (False, 0), (False, 1), (False, 2), (True, 3)]


def test_non_finite_between_exceedances_does_not_break_the_streak():
    wait, out = 0, []
    for v in (0.9, NAN, 0.9):
        stop, wait, _ = _decide(v, threshold=0.5, wait=wait, patience=1)
        out.append((stop, wait))
    assert out == [(False, 1), (False, 1), (True, 2)]


def test_min_checks_delays_the_stop_but_wait_still_counts():
    # patience 0: without min_checks the first exceedance would stop.
    assert _decide(0.9, checks_seen=1, min_checks=3, wait=0, patience=0) == (False, 1, None)
    assert _decide(0.9, checks_seen=2, min_checks=3, wait=1, patience=0) == (False, 2, None)
    stop, wait, reason = _decide(0.9, checks_seen=3, min_checks=3, wait=2, patience=0)
    assert (stop, wait) == (True, 3)
    assert "for 3 consecutive check(s)" in reason


def test_threshold_comparison_is_strict():
    assert _decide(0.5, threshold=0.5, patience=0)[0] is False
    assert _decide(math.nextafter(0.5, 1.0), threshold=0.5, patience=0)[0] is True


# --- PrivacyEarlyStopping ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("use", "tag", "figure"),
    [("lower", "privacy/loss/histogram/lower", 0.2),
     ("value", "privacy/loss/histogram/value", 0.3)],
)  # fmt: skip
def test_short_metric_completed_with_use(use, tag, figure):
    es = PrivacyEarlyStopping("loss/histogram", 0.25, use=use)
    assert es.tag == tag
    assert es.figure(_scalars(value=0.3, lower=0.2, upper=0.6)) == figure
    assert es.update(7, _scalars(value=0.3, lower=0.2, upper=0.6)) is (figure > 0.25)


def test_full_tag_is_used_as_is():
    es = PrivacyEarlyStopping("privacy/loss/auc", 0.6)
    assert es.tag == "privacy/loss/auc"
    assert es.figure(_scalars(auc=0.65)) == 0.65
    assert es.update(3, _scalars(auc=0.65)) is True
    assert es.stopped_step == 3


def test_metric_without_estimate_fields_falls_back_to_privacy_prefix():
    # "loss/auc" has no /lower variant: the figure is privacy/loss/auc itself.
    es = PrivacyEarlyStopping("loss/auc", 0.6)
    assert es.figure(_scalars(auc=0.55)) == 0.55


def test_missing_tag_raises_keyerror_naming_it():
    es = PrivacyEarlyStopping("nn_dist/kde", 0.1)
    with pytest.raises(KeyError, match=re.escape("privacy/nn_dist/kde/lower")):
        es.update(1, _scalars())
    with pytest.raises(KeyError, match=re.escape("privacy/nope")):
        PrivacyEarlyStopping("privacy/nope", 0.1).figure(_scalars())


def test_stops_records_step_and_reason_and_stays_stopped():
    es = PrivacyEarlyStopping("loss/histogram", 0.1, use="value", patience=1)
    assert es.update(100, _scalars(value=0.3)) is False
    assert (es.wait, es.checks_seen, es.stopped_step, es.reason) == (1, 1, None, None)
    assert es.update(200, _scalars(value=0.4)) is True
    assert es.stopped_step == 200
    assert es.reason == (
        "step 200: privacy figure 0.4000 above the budget 0.1000 "
        "for 2 consecutive check(s) (patience 1)"
    )
    # Stays stopped; later checks (even harmless ones) change nothing.
    for step in (300, 400):
        assert es.update(step, _scalars(value=0.0)) is True
    assert (es.wait, es.checks_seen, es.stopped_step) == (2, 2, 200)
    assert es.reason.startswith("step 200:")


@pytest.mark.parametrize(
    ("metric", "use"),
    [("loss/histogram", "upper"), ("privacy/loss/kde/plugin_upper", "lower"),
     ("privacy/loss/kde/plugin", "lower"), ("loss/kde/upper", "value")],
)  # fmt: skip
def test_plugin_figures_are_refused(metric, use):
    # The plug-in + McDiarmid figure is biased up and bounds nothing: stopping on it would stop
    # training on noise (W_N ≈ 0.14 with nothing leaking at 1,000 + 1,000 records).
    with pytest.raises(ValueError, match="not an upper bound"):
        PrivacyEarlyStopping(metric, 0.3, use=use)


def test_state_dict_roundtrip_through_torch_save_weights_only():
    es = PrivacyEarlyStopping("loss/histogram", 0.1, use="value", patience=2, min_checks=2)
    es.update(10, _scalars(value=0.5))
    es.update(20, _scalars(value=0.5))
    state = _roundtrip(es.state_dict())
    assert state == {
        "metric": "loss/histogram",
        "threshold": 0.1,
        "use": "value",
        "patience": 2,
        "min_checks": 2,
        "wait": 2,
        "checks_seen": 2,
        "stopped_step": None,
        "reason": None,
        # what the run's outcome says (issue #38): no check within the budget, the highest figure
        "last_within": None,
        "highest_value": 0.5,
        "highest_step": 10,
        "stopped_value": None,
    }
    resumed = PrivacyEarlyStopping("loss/histogram", 0.1, use="value", patience=2, min_checks=2)
    resumed.load_state_dict(state)
    assert resumed.update(30, _scalars(value=0.5)) is True
    assert resumed.stopped_step == 30
    assert "for 3 consecutive check(s)" in resumed.reason
    # A stopped callback resumes stopped.
    again = PrivacyEarlyStopping("loss/histogram", 0.1, use="value", patience=2, min_checks=2)
    again.load_state_dict(_roundtrip(resumed.state_dict()))
    assert again.update(40, _scalars(value=0.0)) is True
    assert (again.stopped_step, again.reason) == (30, resumed.reason)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"metric": "loss/kde"}, "metric"),
        ({"threshold": 0.2}, "threshold"),
        ({"use": "value"}, "use"),
    ],
)
def test_load_state_dict_mismatch_raises(kwargs, key):
    saved = PrivacyEarlyStopping("loss/histogram", 0.1).state_dict()
    args = {"metric": "loss/histogram", "threshold": 0.1, "use": "lower", **kwargs}
    other = PrivacyEarlyStopping(args.pop("metric"), args.pop("threshold"), **args)
    with pytest.raises(ValueError, match=key):
        other.load_state_dict(saved)
    assert (other.wait, other.checks_seen, other.stopped_step) == (0, 0, None)


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        (("", 0.1), {}, "metric"),
        ((None, 0.1), {}, "metric"),
        ((3, 0.1), {}, "metric"),
        (("loss/histogram", NAN), {}, "threshold"),
        (("loss/histogram", INF), {}, "threshold"),
        (("loss/histogram", 0.1), {"use": "median"}, "use"),
        (("loss/histogram", 0.1), {"patience": -1}, "patience"),
        (("loss/histogram", 0.1), {"patience": 1.5}, "patience"),
        (("loss/histogram", 0.1), {"patience": True}, "patience"),
        (("loss/histogram", 0.1), {"min_checks": -2}, "min_checks"),
        (("loss/histogram", 0.1), {"min_checks": "3"}, "min_checks"),
    ],
)
def test_bad_constructor_arguments_raise_valueerror_naming_them(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        PrivacyEarlyStopping(*args, **kwargs)


@pytest.mark.parametrize("threshold", [-0.1, -1e-12, 1.5, math.nextafter(1.0, 2.0), -INF])
@pytest.mark.parametrize("metric", ["loss/histogram", "privacy/loss/auc", "privacy/loss/risk/max"])
def test_a_threshold_outside_0_1_is_refused_naming_it_and_the_range(metric, threshold):
    # -0.1 stopped a run whose every certified bound was 0.0; 1.5 could never fire
    with pytest.raises(ValueError, match=r"^threshold must be in the closed interval \[0, 1\]"):
        PrivacyEarlyStopping(metric, threshold)


def test_a_threshold_at_the_ends_of_0_1_is_kept_and_an_epsilon_takes_any_finite_one():
    assert PrivacyEarlyStopping("loss/histogram", 0.0).threshold == 0.0
    assert PrivacyEarlyStopping("loss/histogram", 1).threshold == 1.0
    assert PrivacyEarlyStopping("privacy/epsilon", 5.0).threshold == 5.0  # an ε: [0, inf)
    es = PrivacyEarlyStopping("privacy/canaries/fdp/epsilon_lower_bound", 2.5)
    assert es.update(1, {es.tag: 3.0}) is True
    for bad in (-0.1, INF, NAN):
        with pytest.raises(ValueError, match=r"^threshold must be (a number )?in \[0\.0, inf\)"):
            PrivacyEarlyStopping("privacy/epsilon", bad)


@pytest.mark.parametrize("threshold", [None, "abc"])
def test_non_numeric_threshold_raises_valueerror_naming_it(threshold):
    with pytest.raises(ValueError, match="threshold"):
        PrivacyEarlyStopping("loss/histogram", threshold)


# --- property: resuming from a state_dict changes no decision ------------------------------------


def _reference_decisions(values, threshold, patience, min_checks):
    """Independent restatement of the documented semantics: stop once the figure has been above
    the threshold on more than ``patience`` consecutive finite checks (non-finite checks are
    skipped without breaking the streak), never before ``min_checks`` checks."""
    out, streak, stopped = [], 0, False
    for i, v in enumerate(values, start=1):
        if not stopped and math.isfinite(v):
            streak = streak + 1 if v > threshold else 0
            stopped = streak > patience and i >= min_checks
        out.append(stopped)
    return out


figures = st.one_of(
    st.floats(-0.5, 1.5, allow_nan=False),
    st.sampled_from([NAN, INF, -INF, 0.5]),
)


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(figures, max_size=12),
    patience=st.integers(0, 3),
    min_checks=st.integers(0, 5),
    use=st.sampled_from(["lower", "value"]),
    data=st.data(),
)
def test_decisions_identical_when_resumed_midway(values, patience, min_checks, use, data):
    split = data.draw(st.integers(0, len(values)), label="split")
    tag = f"privacy/loss/histogram/{use}"

    def make():
        return PrivacyEarlyStopping(
            "loss/histogram", 0.5, use=use, patience=patience, min_checks=min_checks
        )

    straight = make()
    one_by_one = [straight.update(10 * (i + 1), {tag: v}) for i, v in enumerate(values)]

    first = make()
    decisions = [first.update(10 * (i + 1), {tag: v}) for i, v in enumerate(values[:split])]
    second = make()
    second.load_state_dict(_roundtrip(first.state_dict()))
    decisions += [
        second.update(10 * (i + 1), {tag: v}) for i, v in enumerate(values[split:], start=split)
    ]

    assert decisions == one_by_one == _reference_decisions(values, 0.5, patience, min_checks)
    assert (second.stopped_step, second.reason, second.wait, second.checks_seen) == (
        straight.stopped_step,
        straight.reason,
        straight.wait,
        straight.checks_seen,
    )
    if True in one_by_one:
        assert straight.stopped_step == 10 * (one_by_one.index(True) + 1)


# --- wired into a real monitor -------------------------------------------------------------------


def _tiny_monitor(early_stopping):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(80, 4), torch.randint(0, 2, (80,))
    members = [(x[:40], y[:40])]
    nonmembers = [(x[40:], y[40:])]
    return PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        methods=("histogram",),
        every_n_steps=2,
        early_stopping=early_stopping,
    )


def test_monitor_stops_and_its_state_dict_resumes_stopped():
    # the AUC is above 0 unless every member scores below every non-member: a budget of 0 on it
    # trips at every check; patience 1: the second check stops.
    monitor = _tiny_monitor(PrivacyEarlyStopping("privacy/loss/auc", 0.0, patience=1))
    flags = [monitor.step(s) for s in range(1, 7)]
    assert flags == [False, False, False, True, True, True]
    assert [r.step for r in monitor.history] == [2, 4, 6]
    es = monitor.early_stopping
    assert (es.stopped_step, es.checks_seen) == (4, 2)  # the check at 6 does not move it
    value = monitor.history[1].scalars["privacy/loss/auc"]
    assert value > 0 and es.reason == (
        f"step 4: privacy figure {value:.4f} above the budget 0.0000 "
        "for 2 consecutive check(s) (patience 1)"
    )

    state = _roundtrip(monitor.state_dict())
    fresh = _tiny_monitor(PrivacyEarlyStopping("privacy/loss/auc", 0.0, patience=1))
    fresh.load_state_dict(state)
    assert fresh.should_stop is True
    assert fresh.early_stopping.stopped_step == 4
    # kept figures are float32: equal for the earlier checks, to 7 digits for the latest
    assert [h.scalars for h in fresh.history[:-1]] == [h.scalars for h in monitor.history[:-1]]
    assert fresh.history[-1].scalars == pytest.approx(monitor.history[-1].scalars, rel=1e-7)
    with pytest.raises(ValueError, match="early stopping"):
        _tiny_monitor(None).load_state_dict(state)
