"""Adding a DP mechanism check touches one module, the check's own: a toy check defined here (the
clipping bound C is the same at every private step) joins the built-in ones through
``MechanismChecks(optimizer, checks=[..., check])``, runs inside a real Opacus run through the
monitor, fires (the alarm names it) when C changes and stays silent when it does not, and its
state survives ``state_dict`` / ``load_state_dict`` with no state code of its own."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon import PrivacyMonitor, PrivacyViolationWarning
from privmon.audit import (
    MECHANISM_CHECKS,
    MechanismCheck,
    MechanismChecks,
    MechanismFinding,
    StepContext,
)
from privmon.queries import LossQuery
from privmon.report import tags as T

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"),
]


class SameBound(MechanismCheck):
    """The toy check: every private step clipped to the C of the first one."""

    name = "bound"
    tests = (("constant", "deterministic"),)
    first: float
    changed: int
    first_change: int

    def __init__(self) -> None:
        super().__init__()
        self.add_state("first", math.nan)
        self.add_state("changed", 0)  # private steps at another C
        self.add_state("first_change", 0)

    def private_step(self, context: StepContext) -> None:
        bound = float(context.optimizer.max_grad_norm)
        if math.isnan(self.first):
            self.first = bound
        elif bound != self.first:
            self.first_change = self.first_change or context.steps
            self.changed += 1

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        said = f"bound: C = {self.first} at every one of {context.steps} steps"
        if self.changed:
            said = f"bound: C changed at step {self.first_change} ({self.changed} steps)"
        return [
            MechanismFinding("bound", "constant", "deterministic", bool(self.changed), None, said)
        ]


def private(seed: int = 0) -> tuple[nn.Module, Any, DataLoader, PrivacyEngine]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g))
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
        data_loader=DataLoader(data, batch_size=20),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    return model, optimizer, loader, engine


def run(*, change_at: int | None) -> tuple[Any, MechanismChecks, Any]:
    """20 private steps, the monitor checking every 10th; C halved at step ``change_at``."""
    model, optimizer, loader, engine = private()
    checks = MechanismChecks(optimizer, checks=[*MECHANISM_CHECKS, SameBound()])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(100, 6, generator=g), torch.randint(0, 3, (100,), generator=g)
    monitor = PrivacyMonitor(
        LossQuery(model), [(x[:50], y[:50])], [(x[50:], y[50:])], every_n_steps=10,
        methods=("histogram",), accountant=engine, canaries=checks, strict=True,
    )  # fmt: skip
    step = 0
    while step < 20:
        for xb, yb in loader:
            if step == change_at:
                optimizer.max_grad_norm = 0.5
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            step += 1
            monitor.step(step)
            if step == 20:
                break
    return monitor, checks, optimizer


def test_the_toy_check_is_composed_after_the_built_in_ones():
    _, optimizer, *_ = private()
    with MechanismChecks(optimizer, checks=["steps", SameBound()]) as checks:
        assert checks.checks == ("steps", "bound")
        assert checks.statistical_tests == ()
        assert [(f.check, f.test) for f in checks.mechanism()] == [
            ("steps", "count"),
            ("bound", "constant"),
        ]
    with pytest.raises(ValueError, match="name must be unique"):
        MechanismChecks(optimizer, checks=[SameBound(), SameBound()])


class Float32Bound(SameBound):
    """The toy check, refusing parameters in another dtype than float32 (its own rule)."""

    name = "bound32"

    def refusal(self, context: StepContext, *, family: Any) -> str | None:
        if any(p.dtype != torch.float32 for p in context.optimizer.params):
            return "it reads float32 parameters only"
        return super().refusal(context, family=family)


def test_the_toy_check_says_when_it_cannot_run():
    torch.manual_seed(0)
    net = nn.Linear(6, 3).to(torch.bfloat16)
    data = TensorDataset(torch.randn(40, 6).to(torch.bfloat16), torch.randint(0, 3, (40,)))
    _, optimizer, _ = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(
        ValueError,
        match=r"^on this optimizer, the mechanism checks bound32 cannot run \(bound32: it reads "
        r"float32 parameters only\)\. Pass checks=\('steps',\) to run the others\.$",
    ):
        MechanismChecks(optimizer, checks=["steps", Float32Bound()])
    assert not {"add_noise", "pre_step", "clip_and_accumulate"} & set(optimizer.__dict__)
    MechanismChecks(optimizer, checks=["steps", SameBound()]).detach()
    _, flat, *_ = private()
    MechanismChecks(flat, checks=[Float32Bound()]).detach()


def test_the_toy_check_stays_silent_on_a_correct_run():
    monitor, checks, _ = run(change_at=None)
    assert [r.step for r in monitor.history] == [10, 20]
    report = monitor.last_report
    assert not report.dp_violation, report.dp_causes
    assert report.scalars[T.dp_check_fired("bound")] == 0.0
    (toy,) = [f for f in checks.mechanism() if f.check == "bound"]
    assert (toy.fired, toy.evidence) == (False, "bound: C = 1.0 at every one of 20 steps")


def test_the_toy_check_fires_through_the_monitor_and_survives_a_checkpoint():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyViolationWarning)
        monitor, checks, _ = run(change_at=5)
    report = monitor.last_report
    assert report.dp_violation
    assert report.scalars[T.dp_check_fired("bound")] == 1.0
    assert "bound: C changed at step 6 (15 steps)" in report.dp_causes
    state = copy.deepcopy(checks.state_dict())
    assert state["checks"]["bound"]["changed"] == 15
    _, fresh_optimizer, *_ = private(seed=3)
    with MechanismChecks(fresh_optimizer, checks=[*MECHANISM_CHECKS, SameBound()]) as fresh:
        fresh.load_state_dict(state)
        assert fresh.mechanism()[-1] == checks.mechanism()[-1]
        assert fresh.steps == 20
    with pytest.raises(ValueError, match=r"saved by checks=\(.*'bound'\)"):
        MechanismChecks(private()[1]).load_state_dict(state)
