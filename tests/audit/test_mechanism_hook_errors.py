"""A mechanism check whose hook raises inside the training step stops there and never stops the
training: the step goes on, the weights are bit-identical to an unwatched run's, the failure is
logged once (its type and place, never its message), the check's tests are undecided from then
on (in its findings, across a checkpoint, and through the monitor: failures, a NaN fired flag,
no DP violation) while the other checks still decide theirs. Real Opacus runs."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
import torch
from dp_sgd import make_private, toy_data, toy_net, train
from torch import nn

from privmon import PrivacyMonitor
from privmon._digest import sealed
from privmon.audit import (
    MECHANISM_CHECKS,
    MechanismCheck,
    MechanismChecks,
    MechanismFinding,
    StepContext,
)
from privmon.audit.mechanism_ledger import LedgerCheck
from privmon.audit.mechanism_noise import NoiseCheck
from privmon.queries import LossQuery
from privmon.report import tags

pytest.importorskip("opacus")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS, SECRET = 20, "record value 0.8125"


class RaisesAtStep(MechanismCheck):
    """A check whose ``private_step`` raises from private step 5 on, with a message that must
    not reach the log."""

    name = "raises"
    tests = (("always", "deterministic"), ("level", "statistical"))
    seen: int

    def __init__(self) -> None:
        super().__init__()
        self.add_state("seen", 0)

    def private_step(self, context: StepContext) -> None:
        if context.steps >= 5:
            raise ValueError(SECRET)
        self.seen += 1

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        return [
            MechanismFinding("raises", "always", "deterministic", False, None, "raises: fine"),
            MechanismFinding("raises", "level", "statistical", False, 0.5, "raises: fine"),
        ]


def _run(checks: Any = None, *, steps: int = STEPS) -> tuple[list[torch.Tensor], Any, Any]:
    """A seeded DP-SGD run (watched by MechanismChecks(checks=) unless None): the weights, the
    checks, the optimizer."""
    torch.manual_seed(0)
    net = toy_net()
    model, optimizer, loader = make_private(
        net, net, toy_data(1), batch=20, noise_multiplier=1.0, max_grad_norm=1.0
    )
    watched = None if checks is None else MechanismChecks(optimizer, checks=checks)
    train(model, optimizer, loader, nn.functional.cross_entropy, steps=steps)
    return [p.detach().clone() for p in net.parameters()], watched, optimizer


def _stopped(found: tuple[MechanismFinding, ...], check: str) -> list[MechanismFinding]:
    return [f for f in found if f.check == check]


def test_a_check_whose_hook_raises_stops_alone_and_training_goes_on_bit_identical(caplog):
    plain, _, _ = _run()
    with caplog.at_level(logging.ERROR, logger="privmon"):
        weights, checks, _ = _run([*MECHANISM_CHECKS, RaisesAtStep()])
    assert all(torch.equal(a, b) for a, b in zip(weights, plain, strict=True))
    found = checks.mechanism()
    said = (
        "raises: the check stopped (its step hook raised ValueError after 5 private steps): "
        "undecided, not a DP violation"
    )
    assert [(f.test, f.kind, f.fired, f.p_value, f.evidence, f.undecided)
            for f in _stopped(found, "raises")] == [
        ("always", "deterministic", False, None, said, True),
        ("level", "statistical", False, None, said, True),
    ]  # fmt: skip
    others = [f for f in found if f.check != "raises"]
    assert {f.check for f in others} == set(MECHANISM_CHECKS)
    assert not any(f.undecided or f.fired for f in others)
    assert next(f for f in found if f.check == "steps").evidence.endswith(f"{STEPS} were taken")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "the raises mechanism check stopped" in errors[0].getMessage()
    assert SECRET not in caplog.text and "0.8125" not in caplog.text


@pytest.mark.parametrize(
    ("owner", "event", "check", "tests"),
    [
        (NoiseCheck, "noised", "noise", ["variance", "repeat"]),
        (LedgerCheck, "_after_step", "ledger", ["weights"]),  # an optimizer step hook of its own
    ],
)
def test_a_built_in_check_whose_hook_raises_stops_alone(monkeypatch, owner, event, check, tests):
    plain, _, _ = _run()
    calls = []

    def broken(self: Any, *args: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(SECRET)

    monkeypatch.setattr(owner, event, broken)
    weights, checks, _ = _run(list(MECHANISM_CHECKS))
    assert all(torch.equal(a, b) for a, b in zip(weights, plain, strict=True))
    assert len(calls) == 3  # stopped: not called again
    found = checks.mechanism()
    assert [f.test for f in _stopped(found, check) if f.undecided] == tests
    assert not any(f.undecided for f in found if f.check != check)


def test_a_stopped_check_stays_undecided_across_a_checkpoint():
    _, checks, _ = _run([*MECHANISM_CHECKS, RaisesAtStep()])
    state = copy.deepcopy(checks.state_dict())
    assert state["stopped"] == {"raises": "its step hook raised ValueError after 5 private steps"}
    _, fresh, _ = _run([*MECHANISM_CHECKS, RaisesAtStep()], steps=1)
    fresh.load_state_dict(state)
    assert _stopped(fresh.mechanism(), "raises") == _stopped(checks.mechanism(), "raises")
    del state["stopped"]  # saved before checks could stop: none stopped
    fresh.load_state_dict(sealed({k: v for k, v in state.items() if k != "digest"}))
    assert not any(f.undecided for f in fresh.mechanism())


def test_through_the_monitor_a_stopped_check_is_a_failure_not_a_violation():
    torch.manual_seed(0)
    net = toy_net()
    model, optimizer, loader = make_private(
        net, net, toy_data(1), batch=20, noise_multiplier=1.0, max_grad_norm=1.0
    )
    checks = MechanismChecks(optimizer, checks=[*MECHANISM_CHECKS, RaisesAtStep()])
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(100, 6, generator=g), torch.randint(0, 3, (100,), generator=g)
    monitor = PrivacyMonitor(
        LossQuery(model), [(x[:50], y[:50])], [(x[50:], y[50:])], every_n_steps=10,
        methods=("histogram",), canaries=checks,
    )  # fmt: skip
    train(model, optimizer, loader, nn.functional.cross_entropy, steps=STEPS)
    report = monitor.check(STEPS)
    assert report is not None and not report.dp_violation, report.dp_causes
    assert math.isnan(report.scalars[tags.dp_check_fired("raises")])
    assert math.isnan(report.scalars[tags.dp_check_p_value("raises", "level")])
    assert all(report.scalars[tags.dp_check_fired(c)] == 0.0 for c in MECHANISM_CHECKS)
    assert set(report.failures) >= {"dp_checks/raises/always", "dp_checks/raises/level"}
    assert report.failures["dp_checks/raises/always"].startswith(
        f"the always test of the raises check is undecided at step {STEPS}; its evidence: "
        "raises: the check stopped (its step hook raised ValueError"
    )


# -- the canaries' own hooks ----------------------------------------------------------------------
def _canary_run(*, fail_at: int | None) -> tuple[nn.Module, Any]:
    """20 steps with 1,000 GradientCanaries; from step ``fail_at`` on, drawing the canaries'
    samples raises (their generator's draws only: the loader's and the noise's are untouched)."""
    from privmon.audit import GradientCanaries

    torch.manual_seed(0)
    net = toy_net()
    model, optimizer, loader = make_private(
        net, net, toy_data(0), batch=20, noise_multiplier=1.0, max_grad_norm=1.0
    )
    canaries = GradientCanaries(optimizer, 1000, seed=0)
    rand = torch.rand

    def failing(*args: Any, generator: Any = None, **kwargs: Any) -> torch.Tensor:
        if generator is canaries._generator and canaries.steps >= fail_at:
            raise RuntimeError(SECRET)
        return rand(*args, generator=generator, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        if fail_at is not None:
            patch.setattr(torch, "rand", failing)
        train(model, optimizer, loader, nn.functional.cross_entropy, steps=STEPS)
    return net, canaries


def test_canaries_whose_hook_raises_stop_and_training_goes_on_bit_identical(caplog):
    clean, _ = _canary_run(fail_at=None)
    with caplog.at_level(logging.ERROR, logger="privmon"):
        net, canaries = _canary_run(fail_at=5)
    for (name, a), b in zip(clean.state_dict().items(), net.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the model's training is untouched
    said = "their add_noise hook raised RuntimeError after 5 steps"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"privmon: the GradientCanaries stopped: {said}; training goes on, and their scores "
        "are undecided from here"
    ]
    assert SECRET not in caplog.text
    stopped = rf"^the GradientCanaries stopped \({said}\): no scores$"
    with pytest.raises(RuntimeError, match=stopped):
        canaries.scores()
    assert canaries.steps == 5
    assert not any(f.fired for f in canaries.mechanism())  # the checks still run, silent
    state = canaries.state_dict()
    assert state["stopped"] == said
    _, fresh = _canary_run(fail_at=None)
    fresh.load_state_dict(state)  # a resume keeps them stopped
    with pytest.raises(RuntimeError, match="stopped"):
        fresh.scores()
