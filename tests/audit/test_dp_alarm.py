"""The DP alarm end to end (issue #29): a real tiny Opacus run (a 2-layer MLP on random data,
200 records, Poisson batches of 20, 40 steps) watched by the real monitor, ``PrivacyMonitor(...,
accountant=engine, canaries=GradientCanaries(optimizer, 1000))`` with the mechanism checks on by
default, checking every 10 steps and once after training. Each fault class of
``benchmarks/dp_fault_cases.py`` (noise, clipping, sampling, steps, ledger, repeated noise),
injected as that file injects it, sets ``report.dp_violation``, names its check with the
evidence in ``report.dp_causes`` and in a ``PrivacyViolationWarning``, and sets that check's
``privacy/dp_checks/<check>/fired`` to 1 (and no other check's); the correct run and the two
non-faults (``max_grad_norm`` changed mid-run, per-sample gradients scaled before clipping)
raise nothing. Also record canaries and ``MechanismChecks`` given together as ``canaries=``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from dp_sgd import with_noise_factor
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon import PrivacyMonitor, PrivacyViolationWarning
from privmon.audit import MECHANISM_CHECKS, GradientCanaries, MechanismChecks, RecordCanaries
from privmon.queries import LossQuery
from privmon.report import tags as T

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"),
]

N, BATCH, SIGMA, CLIP, LR, STEPS, EVERY = 200, 20, 1.0, 1.0, 0.2, 40, 10  # q = 0.1
N_CANARIES, N_AUDIT = 1000, 50
Hook = Callable[["Run"], None]


def _nothing(run: Run) -> None:
    return None


@dataclass
class Fault:
    """A fault as hooks into the correct run (the same injections as the benchmark's)."""

    private_options: dict[str, Any] = field(default_factory=dict)
    loader_options: dict[str, Any] = field(default_factory=dict)
    after_private: Hook = _nothing
    before_step: Hook = _nothing
    after_training: Hook = _nothing
    resume_at: int | None = None  # checkpoint here and resume with a fresh PrivacyEngine


@dataclass
class Run:
    """The tiny DP-SGD run, its canaries and the monitor; ``warned``: every
    PrivacyViolationWarning's message."""

    fault: Fault = field(default_factory=Fault)
    seed: int = 0
    torch_seed: int | None = None
    step: int = 0
    warned: list[str] = field(default_factory=list)
    report: Any = None  # the last check's

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed if self.torch_seed is None else self.torch_seed)
        g = torch.Generator().manual_seed(self.seed)
        x, y = (
            torch.randn(N + N_AUDIT, 6, generator=g),
            torch.randint(0, 3, (N + N_AUDIT,), generator=g),
        )
        self.data = TensorDataset(x[:N], y[:N])
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.engine = PrivacyEngine()
        self.model, self.optimizer, self.loader = self.engine.make_private(
            module=self.net,
            optimizer=torch.optim.SGD(self.net.parameters(), lr=LR),
            data_loader=DataLoader(self.data, batch_size=BATCH, **self.fault.loader_options),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            **self.fault.private_options,
        )
        self.fault.after_private(self)  # before the canaries, so that they pass through it
        self.canaries = GradientCanaries(self.optimizer, N_CANARIES, seed=self.seed)
        self.monitor = PrivacyMonitor(
            LossQuery(self.model), [(x[:N_AUDIT], y[:N_AUDIT])], [(x[N:], y[N:])],
            every_n_steps=EVERY, methods=("histogram",), accountant=self.engine,
            canaries=self.canaries, planned_checks=STEPS // EVERY, strict=True,
        )  # fmt: skip

    def train(self, until: int) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrivacyViolationWarning)
            while self.step < until:
                for inputs, y in self.loader:
                    self.fault.before_step(self)
                    self.optimizer.zero_grad()
                    nn.functional.cross_entropy(self.model(inputs), y).backward()
                    self.optimizer.step()
                    self.step += 1
                    if self.step < STEPS:  # the last check comes after the fault's work
                        self.monitor.step(self.step)
                    if self.step >= until:
                        break
        self.warned += _violations(caught)

    def finish(self) -> Any:
        """The last check, after what the fault does after training; its report."""
        self.fault.after_training(self)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrivacyViolationWarning)
            report = self.monitor.check(self.step)
        self.warned += _violations(caught)
        self.monitor.close()
        return report


def _violations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PrivacyViolationWarning)]


def run(fault: Fault | None = None, seed: int = 0) -> Run:
    """The run with ``fault`` injected, trained and checked; a resume rebuilds every object
    (a new process: a new PrivacyEngine, the global RNG seeded afresh) from a checkpoint of the
    model, the optimizer, the canaries and the monitor, but not of the accountant."""
    fault = fault or Fault()
    r = Run(fault, seed)
    if fault.resume_at is not None:
        r.train(fault.resume_at)
        saved = copy.deepcopy(
            {
                "model": r.model.state_dict(),
                "optimizer": r.optimizer.state_dict(),
                "canaries": r.canaries.state_dict(),
                "monitor": r.monitor.state_dict(),
            }
        )
        fresh = Run(fault, seed, torch_seed=seed + 1, step=r.step, warned=r.warned)
        fresh.model.load_state_dict(saved["model"])
        fresh.canaries.load_state_dict(saved["canaries"])
        fresh.optimizer.load_state_dict(saved["optimizer"])
        fresh.monitor.load_state_dict(saved["monitor"])
        r = fresh
    r.train(STEPS)
    r.report = r.finish()
    return r


def fired_checks(report: Any) -> set[str]:
    return {
        check
        for tag, value in report.scalars.items()
        if (parsed := T.parse_dp_check(tag)) and parsed[1] is None and value == 1.0
        for check in (parsed[0],)
    }


# -- the faults, injected as benchmarks/dp_fault_cases.py injects them --------------------------
def noise_half(run: Run) -> None:
    """``add_noise`` runs with σ / 2; σ is restored before the accountant's hook reads it."""
    optimizer = run.optimizer
    original = optimizer.add_noise

    def add_noise() -> None:
        sigma = optimizer.noise_multiplier
        optimizer.noise_multiplier = sigma * 0.5
        try:
            original()
        finally:
            optimizer.noise_multiplier = sigma

    optimizer.add_noise = add_noise


def around_clipping(body: Callable[[Any, Callable[[], None]], None]) -> Hook:
    def patch(run: Run) -> None:
        optimizer = run.optimizer
        original = optimizer.clip_and_accumulate
        optimizer.clip_and_accumulate = lambda: body(optimizer, original)

    return patch


def clip_at_ten(optimizer: Any, original: Callable[[], None]) -> None:
    bound = optimizer.max_grad_norm
    optimizer.max_grad_norm = 10.0
    try:
        original()
    finally:
        optimizer.max_grad_norm = bound


def scale_then_clip(optimizer: Any, original: Callable[[], None]) -> None:
    for p in optimizer.params:
        p.grad_sample = p.grad_sample * 0.5
    original()


def own_loader(run: Run) -> None:
    run.loader = DataLoader(run.data, batch_size=len(run.data))


def fine_tune_head(run: Run) -> None:
    head = torch.optim.SGD(run.net[2].parameters(), lr=LR)
    for x, y in DataLoader(run.data, batch_size=BATCH, shuffle=True):
        run.model.zero_grad()
        nn.functional.cross_entropy(run.model(x), y).backward()
        head.step()
        run.step += 1


def generator_options() -> dict[str, Any]:
    return {"noise_generator": torch.Generator().manual_seed(0)}


def reseed_generator(run: Run) -> None:
    run.fault.private_options["noise_generator"].manual_seed(0)


def change_clip(run: Run) -> None:
    if run.step == STEPS // 2:
        run.optimizer.max_grad_norm = 0.5


# fault class -> (the fault, the first check that fires, the evidence at the last check)
FAULTS = {
    "noise": (
        lambda: Fault(after_private=noise_half),
        10,
        "noise: the noise added has 0.5",
    ),
    "clipping": (
        lambda: Fault(after_private=around_clipping(clip_at_ten)),
        10,
        "clipping: a row of norm 100 contributed 10.0, above C = 1.0 (step 1; 13 of 13 probes)",
    ),
    "sampling": (
        lambda: Fault(after_private=own_loader),
        10,
        "sampling: 200 rows in each of 40 steps, the accountant assumes Binomial(200, 0.1) "
        "(mean test: p = 0, below the alarm level of each statistical test,",
    ),
    "steps": (  # checkpointed at step 20; the resumed run's first check is at step 30
        lambda: Fault(resume_at=STEPS // 2),
        30,
        "steps: the accountant counted 20 noised steps, 40 were taken",
    ),
    "ledger": (  # 10 head steps after the 40 private ones: the last check is at step 50
        lambda: Fault(after_training=fine_tune_head),
        50,
        "ledger: the weights changed after the last private step (step 40): a non-private update",
    ),
    "repeated noise": (
        lambda: Fault(private_options=generator_options(), before_step=reseed_generator),
        10,
        "noise: step 2 repeats the noise of step 1 (39 of 40 steps repeat an earlier step's noise)",
    ),
}


@pytest.mark.parametrize("fault_class", list(FAULTS))
def test_each_fault_class_raises_the_alarm_naming_its_check(fault_class):
    make, first, evidence = FAULTS[fault_class]
    check = fault_class.split()[-1]
    r = run(make())
    report = r.report
    assert report.dp_violation
    assert next(c.step for c in r.monitor.history if c.dp_violation) == first
    named = [c for c in report.dp_causes if c.startswith(f"{check}: ")]
    assert named and named[0].startswith(evidence), report.dp_causes
    # the mechanism causes are this check's (the canaries' audit may fire too)
    assert {c.split(":")[0] for c in report.dp_causes} <= {
        check,
        "canaries/fdp",
        "canaries/steinke",
    }
    assert fired_checks(report) == {check}
    assert report.scalars[T.dp_check_fired(check)] == 1.0
    assert report.scalars[T.DP_VIOLATION] == 1.0
    shown = named[0].split(": ", 1)[1]
    assert any(f": {check} — {shown}" in w for w in r.warned), r.warned
    assert set(MECHANISM_CHECKS) <= {
        T.parse_dp_check(t)[0] for t in report.scalars if T.parse_dp_check(t)
    }


@pytest.mark.parametrize(
    "fault",
    [
        Fault(),
        Fault(before_step=change_clip),
        Fault(after_private=around_clipping(scale_then_clip)),
    ],
    ids=["correct", "clip-changed", "scaled-grads"],
)
def test_the_correct_run_and_the_non_faults_raise_nothing(fault):
    r = run(fault)
    assert [c.step for c in r.monitor.history] == [10, 20, 30, 40]
    for report in r.monitor.history:
        assert not report.dp_violation and report.dp_causes == ()
        assert fired_checks(report) == set()
        assert report.scalars[T.DP_VIOLATION] == 0.0
    assert r.warned == []
    last = r.report
    for check in MECHANISM_CHECKS:
        assert last.scalars[T.dp_check_fired(check)] == 0.0
    for test in ("mean", "dispersion"):
        assert last.scalars[T.dp_check_p_value("sampling", test)] > last.scalars[T.DP_ALARM_DELTA]
    assert last.scalars[T.canary_epsilon("fdp")] <= last.epsilon


# -- record canaries and MechanismChecks together -----------------------------------------------
def record_run(noise_factor: float) -> tuple[Any, list[str]]:
    """Record canaries (the loader samples N + m slots at q = 0.1: batch 0.1 (N + m), lr ×
    (N + m) / N) and MechanismChecks, given together as ``canaries=``; ``noise_factor`` scales
    the noise the optimizer adds (the accountant is told σ)."""
    m = 1000
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(N + N_AUDIT, 6, generator=g),
        torch.randint(0, 3, (N + N_AUDIT,), generator=g),
    )
    records = RecordCanaries(m, seed=0)
    train = records.dataset(TensorDataset(x[:N], y[:N]))
    model = records.model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR * (N + m) / N),
        data_loader=DataLoader(train, batch_size=round(0.1 * (N + m))),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    assert engine.accountant.history == [] and optimizer.expected_batch_size == 120
    if noise_factor != 1.0:
        with_noise_factor(optimizer, noise_factor)
    checks = MechanismChecks(optimizer)
    monitor = PrivacyMonitor(
        LossQuery(model), [(x[:N_AUDIT], y[:N_AUDIT])], [(x[N:], y[N:])], every_n_steps=EVERY,
        methods=("histogram",), accountant=engine, canaries=[records, checks],
        planned_checks=STEPS // EVERY, strict=True,
    )  # fmt: skip
    step = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PrivacyViolationWarning)
        while step < STEPS:
            for inputs, yb in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs), yb).backward()
                optimizer.step()
                step += 1
                monitor.step(step)
                if step == STEPS:
                    break
    monitor.close()
    assert engine.accountant.history[0][1] == pytest.approx(0.1)  # q kept
    return monitor, _violations(caught)


def test_record_canaries_and_mechanism_checks_given_together():
    monitor, warned = record_run(1.0)
    report = monitor.last_report
    assert [r.step for r in monitor.history] == [10, 20, 30, 40]
    assert not report.dp_violation and report.dp_causes == () and warned == []
    # the record canaries' one-run bounds and the checks' figures, side by side
    assert report.scalars[T.canary_epsilon("fdp")] <= report.epsilon
    assert fired_checks(report) == set()
    assert {T.parse_dp_check(t)[0] for t in report.scalars if T.parse_dp_check(t)} == set(
        MECHANISM_CHECKS
    )

    monitor, warned = record_run(0.0)  # no noise: both parts see it
    report = monitor.last_report
    assert report.dp_violation and fired_checks(report) == {"noise"}
    kinds = {c.split(":")[0] for c in report.dp_causes}
    assert "noise" in kinds and kinds & {"canaries/fdp", "canaries/steinke"}
    assert any(": noise — the noise added has 0.0 ×" in w for w in warned)
    assert any("the one-run canary audit" in w for w in warned)
