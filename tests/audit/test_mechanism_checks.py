"""The DP mechanism checks on real Opacus runs: each fault class of ``benchmarks/dp_faults.py``,
injected as a user causes it into a tiny run (a 2-layer MLP on random data, 200 records, Poisson
batches of 20, a few dozen steps), makes its check fire with its named cause and evidence; the
correct run and the two consistent changes (``max_grad_norm`` changed mid-run, per-sample
gradients scaled before clipping) fire nothing (deterministic tests silent, p-values above 1e-3
on these seeds). Also: the steps check across a resume, ``checks=()`` and the checks leaving the
training bit-identical, refusals, detach.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from dp_sgd import with_noise_factor
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon._digest import sealed
from privmon.audit import MECHANISM_CHECKS, GradientCanaries, MechanismChecks

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from opacus.data_loader import DPDataLoader  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"),
]

N, BATCH, SIGMA, CLIP, LR, STEPS = 200, 20, 1.0, 1.0, 0.2, 40  # q = 0.1
LEVEL = 1e-3  # a correct run's p-values stay above; a fault's fall far below
FAULT_LEVEL = 1e-6


# -- one run ---------------------------------------------------------------------------------
@dataclass
class Run:
    """A tiny DP-SGD run and its checks; the hooks inject a fault as dp_faults.py does."""

    seed: int = 0
    canaries: int = 0  # > 0: GradientCanaries (with the checks); 0: MechanismChecks alone
    checks: tuple[str, ...] = MECHANISM_CHECKS
    private_options: dict[str, Any] = field(default_factory=dict)
    loader_options: dict[str, Any] = field(default_factory=dict)
    torch_seed: int | None = None  # the global RNG's seed (default: seed)

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed if self.torch_seed is None else self.torch_seed)
        g = torch.Generator().manual_seed(self.seed)
        self.data = TensorDataset(
            torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
        )
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.engine = PrivacyEngine()
        self.model, self.optimizer, self.loader = self.engine.make_private(
            module=self.net,
            optimizer=torch.optim.SGD(self.net.parameters(), lr=LR),
            data_loader=DataLoader(self.data, batch_size=BATCH, **self.loader_options),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            **self.private_options,
        )
        self.step = 0

    def attach(self) -> Run:
        """The checks, after the fault's patches (so that they pass through them)."""
        if self.canaries:
            self.audit: Any = GradientCanaries(self.optimizer, self.canaries, checks=self.checks)
        else:
            self.audit = MechanismChecks(self.optimizer, checks=self.checks)
        return self

    def train(self, steps: int = STEPS, *, epoch_start=None, before_step=None, rows=None) -> Run:
        until = self.step + steps
        while self.step < until:
            if epoch_start:
                epoch_start(self)
            for x, y in self.loader:
                if before_step:
                    before_step(self)
                if rows:
                    x, y = rows(x, y)
                self.optimizer.zero_grad()
                nn.functional.cross_entropy(self.model(x), y).backward()
                self.optimizer.step()
                self.step += 1
                if self.step >= until:
                    break
        return self

    def findings(self) -> dict[str, Any]:
        return {f"{f.check}/{f.test}": f for f in self.audit.mechanism()}


def fired(run: Run) -> dict[str, str]:
    """The tests that fire, with their evidence: deterministic ones that fired, statistical
    ones below FAULT_LEVEL."""
    out = {}
    for name, f in run.findings().items():
        if f.fired or (f.p_value is not None and f.p_value < FAULT_LEVEL):
            out[name] = f.evidence
    return out


def assert_silent(run: Run) -> None:
    for name, f in run.findings().items():
        assert not f.fired, f.evidence
        if f.kind == "statistical":
            assert f.p_value > LEVEL, (name, f.p_value, f.evidence)


# -- the faults, injected as dp_faults.py injects them ------------------------------------------
def _summed(optimizer: Any, factors: torch.Tensor | None) -> None:
    for p in optimizer.params:
        samples = optimizer._get_flat_grad_sample(p).to(p.dtype)
        grad = samples.sum(0) if factors is None else torch.einsum("i,i...", factors, samples)
        p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad


class Unclipped(DPOptimizer):
    def clip_and_accumulate(self) -> None:
        _summed(self, None)


class Undercounting(DPOptimizer):
    """The first layer's per-sample norm counted 10× too small."""

    def clip_and_accumulate(self) -> None:
        norms = [g.reshape(len(g), -1).norm(2, dim=-1) for g in self.grad_samples]
        norms[0] = norms[0] / 10
        total = torch.stack(norms, dim=1).norm(2, dim=1)
        _summed(self, (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0))


def around_clipping(run: Run, body) -> None:
    optimizer = run.optimizer
    original = optimizer.clip_and_accumulate
    optimizer.clip_and_accumulate = lambda: body(optimizer, original)


def clip_at(bound: float):
    def body(optimizer: Any, original) -> None:
        saved = optimizer.max_grad_norm
        optimizer.max_grad_norm = bound
        try:
            original()
        finally:
            optimizer.max_grad_norm = saved

    return body


def scale_then_clip(optimizer: Any, original) -> None:
    for p in optimizer.params:
        p.grad_sample = p.grad_sample * 0.5
    original()


def four_views(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x, x.roll(1, 1), x.roll(2, 1), x.roll(3, 1)]), torch.cat([y] * 4)


# -- every fault class fires its check ---------------------------------------------------------
@pytest.mark.parametrize("canaries", [0, 1000])
def test_the_correct_run_fires_nothing(canaries):
    for seed in (0, 1):
        assert_silent(Run(seed, canaries).attach().train())


def test_the_correct_run_says_every_per_sample_gradient_was_finite():
    found = Run().attach().train().findings()["clipping/finite"]
    assert (found.kind, found.fired, found.p_value) == ("deterministic", False, None)
    assert found.evidence == (
        f"clipping: every per-sample gradient that reached the noise was finite ({STEPS} steps)"
    )


@pytest.mark.parametrize("canaries", [0, 1000])
def test_a_nan_in_one_record_is_its_own_cause_never_repeated_noise(canaries):
    """One NaN input value in one record (Opacus unmodified): its per-sample gradient is NaN,
    Opacus' clip factor C / NaN is NaN, the update and every weight after it NaN. The clipping
    check names the step and the row where it entered; the noise tests leave the non-finite
    values out, saying so, and stay silent (no NaN p-value, no repeat of NaN digests)."""
    run = Run(canaries=canaries)
    run.data.tensors[0][17, 2] = float("nan")  # the DP loader reads this dataset
    entered: list[tuple[int, int]] = []  # (step, row) of the batches holding the record

    def rows(x, y):
        if not entered:
            bad = torch.isnan(x).any(dim=1).nonzero().flatten()
            if len(bad):
                entered.append((run.step + 1, int(bad[0])))
        return x, y

    found = run.attach().train(rows=rows).findings()
    (step, row), nan_steps = entered[0], STEPS - entered[0][0] + 1  # NaN weights from then on
    assert torch.isnan(run.net[0].weight).all()
    assert found["clipping/finite"].fired
    assert found["clipping/finite"].evidence == (
        f"clipping: a per-sample gradient of record slot {row} was NaN at step {step}: it "
        f"passed clipping unbounded ({nan_steps} of {STEPS} steps noised a non-finite clipped "
        "sum)"
    )
    assert "17" not in found["clipping/finite"].evidence.replace(f"slot {row}", "")
    noise = found["noise/variance"]
    assert noise.p_value is not None and LEVEL < noise.p_value <= 1, noise.evidence
    assert re.search(
        rf"values of {nan_steps} steps left out: the noised gradient was not finite\)$",
        noise.evidence,
    ), noise.evidence
    assert not found["noise/repeat"].fired, found["noise/repeat"].evidence
    assert [n for n, f in found.items() if f.fired] == ["clipping/finite"]


def test_an_infinite_row_is_named_by_its_slot_and_a_nan_p_value_is_refused():
    from privmon.audit import mechanism_evidence as evidence
    from privmon.audit.mechanism_math import noise_p_value
    from privmon.audit.opacus_adapter import nonfinite_row

    weight, bias = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(3))
    weight.grad_sample, bias.grad_sample = torch.ones(5, 3, 2), torch.ones(5, 3)
    weight.summed_grad, bias.summed_grad = torch.ones(3, 2), torch.ones(3)
    assert nonfinite_row([weight, bias]) is None  # a finite sum: no row is read
    bias.grad_sample[3, 1] = float("inf")
    bias.summed_grad[1] = float("nan")  # Opacus: C / inf = 0, and 0 · inf = NaN
    assert nonfinite_row([weight, bias]) == (3, "inf")
    weight.grad_sample[2, 0, 0] = float("nan")
    assert nonfinite_row([weight, bias]) == (2, "NaN")
    bias.grad_sample = [torch.ones(2, 3), torch.ones(3, 3)]  # two accumulated batches
    bias.grad_sample[1][0, 0] = float("-inf")
    weight.grad_sample = [torch.ones(2, 3, 2), torch.ones(3, 3, 2)]
    assert nonfinite_row([weight, bias]) == (2, "inf")  # rows counted across the batches
    bias.grad_sample = [torch.ones(2, 3), torch.ones(3, 3)]
    assert nonfinite_row([weight, bias]) == (None, "not finite")
    assert evidence.finite_gradients((4, None, "not finite"), 2, 9).evidence == (
        "clipping: the clipped sum was not finite at step 4, though every per-sample gradient "
        "of the call was: the clipping made it so (2 of 9 steps noised a non-finite clipped sum)"
    )
    with pytest.raises(ValueError, match="scaled_squares must be a number, got NaN"):
        noise_p_value(float("nan"), 10)


@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_noise_removed_or_halved_fires_the_noise_test(factor):
    run = Run()
    with_noise_factor(run.optimizer, factor)
    found = fired(run.attach().train())
    assert set(found) == ({"noise/variance", "noise/repeat"} if factor == 0 else {"noise/variance"})
    ratio = float(
        re.search(
            r"the noise added has ([0-9.]+) × the standard deviation the "
            r"accountant assumes",
            found["noise/variance"],
        ).group(1)
    )
    assert ratio == pytest.approx(factor, abs=0.03)
    assert "(σ·C = 1.0;" in found["noise/variance"]


def test_noise_test_reads_the_canary_block_too():
    run = Run(canaries=1000)
    with_noise_factor(run.optimizer, 0.5)
    f = run.attach().train(10).findings()["noise/variance"]
    assert f.p_value < 1e-100
    assert "values over 10 steps" in f.evidence


@pytest.mark.parametrize(
    ("inject", "contributed"),
    [
        (lambda run: setattr(run.optimizer, "__class__", Unclipped), "100.0"),
        (lambda run: around_clipping(run, clip_at(10.0)), "10.0"),
        (lambda run: setattr(run.optimizer, "__class__", Undercounting), None),
    ],
    ids=["clip-skipped", "clip-10", "norm-undercount"],
)
@pytest.mark.parametrize("canaries", [0, 1000])
def test_clipping_faults_fire_the_clipping_probe(inject, contributed, canaries):
    run = Run(canaries=canaries)
    inject(run)
    found = fired(run.attach().train(10))
    assert set(found) == {"clipping/probe"}
    evidence = found["clipping/probe"]
    assert evidence.startswith("clipping: a row of norm 100 contributed ")
    assert "above C = 1.0 (step 1; 10 of 10 probes)" in evidence
    if contributed:
        assert f"contributed {contributed}, above C = 1.0" in evidence


@pytest.mark.parametrize(
    ("name", "options", "test", "evidence"),
    [
        ("four-views", {"rows": four_views}, "sampling/mean", "rows per step"),
        (
            "own-loader",
            {},
            "sampling/mean",
            "200 rows in each of 40 steps, the accountant assumes Binomial(200, 0.1)",
        ),
        ("double-rate", {}, "sampling/mean", "the accountant assumes Binomial(200, 0.1)"),
    ],
)
def test_sampling_faults_fire_the_mean_test(name, options, test, evidence):
    run = Run()
    if name == "own-loader":
        run.loader = DataLoader(run.data, batch_size=N)
    if name == "double-rate":
        run.loader = DPDataLoader.from_data_loader(DataLoader(run.data, batch_size=2 * BATCH))
    found = fired(run.attach().train(**options))
    assert test in found
    assert set(found) <= {"sampling/mean", "sampling/dispersion"}
    assert evidence in found[test]


def test_shuffled_fixed_batches_fire_the_dispersion_test():
    run = Run(private_options={"poisson_sampling": False}, loader_options={"shuffle": True})
    found = fired(run.attach().train())
    assert set(found) == {"sampling/dispersion"}
    assert found["sampling/dispersion"] == (
        "sampling: 20 rows in each of 40 steps, the accountant assumes Binomial(200, 0.1)"
    )


def _resume(run: Run, *, keep_accountant: bool) -> Run:
    saved = {
        "model": copy.deepcopy(run.model.state_dict()),
        "optimizer": copy.deepcopy(run.optimizer.state_dict()),
        "audit": copy.deepcopy(run.audit.state_dict()),
        "accountant": copy.deepcopy(run.engine.accountant.state_dict()),
    }
    # a new process: a new PrivacyEngine, the global RNG seeded afresh (the same seed would
    # repeat the first half's noise, which the repeat test sees)
    fresh = Run(run.seed, run.canaries, run.checks, torch_seed=run.seed + 1).attach()
    fresh.model.load_state_dict(saved["model"])
    fresh.audit.load_state_dict(saved["audit"])
    fresh.optimizer.load_state_dict(saved["optimizer"])
    if keep_accountant:
        fresh.engine.accountant.load_state_dict(saved["accountant"])
    fresh.step = run.step
    return fresh


@pytest.mark.parametrize("canaries", [0, 1000])
def test_a_resume_that_loses_the_accountant_fires_the_steps_check(canaries):
    run = _resume(Run(canaries=canaries).attach().train(20), keep_accountant=False).train(20)
    found = fired(run)
    assert found == {"steps/count": "steps: the accountant counted 20 noised steps, 40 were taken"}


@pytest.mark.parametrize("canaries", [0, 1000])
def test_a_resume_that_keeps_the_accountant_stays_silent(canaries):
    run = _resume(Run(canaries=canaries).attach().train(20), keep_accountant=True).train(20)
    assert_silent(run)
    assert run.findings()["steps/count"].evidence == (
        "steps: the accountant counted 40 noised steps, 40 were taken"
    )


def test_non_private_steps_after_training_fire_the_ledger():
    run = Run().attach().train()
    assert_silent(run)
    head = torch.optim.SGD(run.net[2].parameters(), lr=LR)
    for x, y in DataLoader(run.data, batch_size=BATCH):
        run.model.zero_grad()
        nn.functional.cross_entropy(run.model(x), y).backward()
        head.step()
    assert fired(run) == {
        "ledger/weights": "ledger: the weights changed after the last private step (step 40): "
        "a non-private update"
    }


def test_a_step_of_the_underlying_optimizer_without_noise_fires_the_ledger():
    run = Run().attach().train(5)
    run.optimizer.original_optimizer.step()  # e.g. a second optimizer wrapping the same one
    run.train(5)
    found = fired(run)
    assert found == {
        "ledger/weights": "ledger: the optimizer stepped 1 times without noise (first after "
        "private step 5): a non-private update"
    }


def test_seed_reset_every_epoch_fires_the_repeat_test():
    run = Run().attach().train(epoch_start=lambda run: torch.manual_seed(run.seed))
    found = fired(run)
    assert "noise/repeat" in found
    assert found["noise/repeat"].startswith("noise: step 11 repeats the noise of step 1 (30 of 40")


def test_a_reseeded_noise_generator_fires_the_repeat_test():
    generator = torch.Generator().manual_seed(0)
    run = Run(private_options={"noise_generator": generator}).attach()
    found = fired(run.train(before_step=lambda run: generator.manual_seed(0)))
    assert found == {
        "noise/repeat": "noise: step 2 repeats the noise of step 1 (39 of 40 steps repeat an "
        "earlier step's noise)"
    }


def test_a_run_accounted_without_noise_repeats_no_noise():
    """σ = 0, told to the accountant (ε = ∞, which holds): every step's noise is the same zero,
    which is no repeat of a random draw; the variance test says it did not test."""
    run = Run()
    run.optimizer.noise_multiplier = 0.0
    found = run.attach().train().findings()
    assert not found["noise/repeat"].fired, found["noise/repeat"].evidence
    assert found["noise/variance"].evidence == "noise: not tested: no noised step with σ·C > 0 yet"
    assert fired(run) == {}


# -- consistent changes stay silent ------------------------------------------------------------
@pytest.mark.parametrize("canaries", [0, 1000])
def test_max_grad_norm_changed_mid_run_stays_silent(canaries):
    def change(run: Run) -> None:
        if run.step == STEPS // 2:
            run.optimizer.max_grad_norm = 0.5

    run = Run(canaries=canaries).attach().train(before_step=change)
    assert_silent(run)
    assert run.findings()["clipping/probe"].evidence == (
        # probed at steps 1-10, 20, 21 (C changed), 30 and 40
        "clipping: a row of norm 100 C contributed at most C in 14 probes over 40 steps (the "
        "last C = 0.5)"
    )


@pytest.mark.parametrize("canaries", [0, 1000])
def test_per_sample_gradients_scaled_before_clipping_stay_silent(canaries):
    run = Run(canaries=canaries)
    around_clipping(run, scale_then_clip)
    assert_silent(run.attach().train())


# -- what the checks leave alone ----------------------------------------------------------------
def _trained(checks: tuple[str, ...] | None, canaries: int) -> tuple[dict, Any, torch.Tensor]:
    """Weights, canary scores and the global RNG's next draws after a run with noise."""
    run = Run()
    if canaries:
        options = {} if checks is None else {"checks": checks}
        audit = GradientCanaries(run.optimizer, canaries, seed=3, **options)
    elif checks is not None:
        audit = MechanismChecks(run.optimizer, checks=checks)
    run.train(25)
    scores = audit.scores() if canaries else None
    return copy.deepcopy(run.net.state_dict()), scores, torch.rand(5)


@pytest.mark.parametrize("canaries", [0, 1000])
def test_the_checks_leave_training_bit_identical(canaries):
    """Weights, the canaries' scores and the RNG streams are those of a run without checks
    (``checks=()``: the previous GradientCanaries): the checks draw no random numbers and
    change no gradient, optimizer state or weight."""
    off = _trained((), canaries) if canaries else _trained(None, 0)
    on = _trained(None, canaries)
    for key, value in off[0].items():
        assert torch.equal(value, on[0][key]), key
    if canaries:
        for a, b in zip(off[1], on[1], strict=True):
            assert a.tobytes() == b.tobytes()
    assert torch.equal(off[2], on[2])


def test_checks_off_give_the_canaries_of_before():
    run = Run()
    canaries = GradientCanaries(run.optimizer, 100, checks=())
    assert canaries.mechanism() == ()
    assert canaries.statistical_tests == ()
    assert "mechanism" not in canaries.state_dict()
    assert "add_noise" in run.optimizer.__dict__  # the canaries' own hooks, and only those
    canaries.detach()
    assert not {"add_noise", "pre_step", "clip_and_accumulate"} & set(run.optimizer.__dict__)


def test_a_subset_of_checks_gives_only_its_findings():
    run = Run(checks=("steps", "sampling")).attach()
    audit = run.audit
    run.train(10)
    assert [f"{f.check}/{f.test}" for f in audit.mechanism()] == [
        "sampling/mean",
        "sampling/dispersion",
        "steps/count",
    ]
    assert audit.statistical_tests == (("sampling", "mean"), ("sampling", "dispersion"))
    assert audit.checks == ("sampling", "steps")


def test_gradient_canaries_forward_to_their_checks():
    run = Run(canaries=100).attach().train(10)
    assert run.audit.statistical_tests == (
        ("noise", "variance"),
        ("sampling", "mean"),
        ("sampling", "dispersion"),
    )
    assert run.audit.mechanism() == run.audit.mechanism_checks.mechanism()
    assert [f.check for f in run.audit.mechanism()] == [
        "clipping",
        "clipping",
        "noise",
        "noise",
        "sampling",
        "sampling",
        "steps",
        "ledger",
    ]


def test_virtual_steps_count_the_rows_of_the_logical_step():
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    run = Run(canaries=100).attach()
    with BatchMemoryManager(
        data_loader=run.loader, max_physical_batch_size=7, optimizer=run.optimizer
    ) as loader:
        for _ in range(3):
            for x, y in loader:
                run.optimizer.zero_grad()
                nn.functional.cross_entropy(run.model(x), y).backward()
                run.optimizer.step()
    assert_silent(run)
    logical = len(run.engine.accountant.history) and run.engine.accountant.history[-1][2]
    assert run.audit.mechanism_checks.steps == logical
    assert run.findings()["sampling/mean"].evidence.startswith("sampling: ")


# -- checkpoints, detach, refusals ---------------------------------------------------------------
def test_state_dict_round_trip_and_a_mismatch():
    run = Run().attach().train(12)
    state = run.audit.state_dict()
    fresh = MechanismChecks(Run(torch_seed=9).optimizer)
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.state_dict().keys() == state.keys()
    assert fresh.steps == 12
    for a, b in zip(fresh.mechanism()[:5], run.audit.mechanism()[:5], strict=True):
        assert (a.test, a.p_value, a.evidence) == (b.test, b.p_value, b.evidence)
    other = MechanismChecks(Run().optimizer, checks=("steps",))
    with pytest.raises(ValueError, match=r"saved by checks=\('clipping'"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        fresh.load_state_dict(sealed({"checks": []}))
    assert state["checks"].keys() == set(MECHANISM_CHECKS)
    assert state["checks"]["noise"]["digests"].dtype == torch.uint8  # 8 bytes a step
    assert state["checks"]["noise"]["digests"].shape == (8 * 12,)


def test_a_state_saved_before_the_checks_were_objects_is_refused_saying_so():
    """The layout of privmon before #41 (the checks' names as a list, their fields flat)."""
    old = sealed(
        {
            "checks": list(MECHANISM_CHECKS),
            "steps": 12,
            "accountant_steps_at_attach": 0,
            "noise": {"squares": 0.0, "values": 0, "steps": 0, "scale": [1.0, 1.0]},
            "ledger": {"unnoised": 0, "first_unnoised": 0},
        }
    )
    fresh = MechanismChecks(Run().optimizer)
    with pytest.raises(
        ValueError,
        match=r"^state was saved by a privmon before each mechanism check kept a state of its "
        r"own .*cannot load it: resume with the privmon that saved it, or start the checks "
        r"afresh$",
    ):
        fresh.load_state_dict(old)
    assert fresh.steps == 0


def test_detach_restores_the_optimizer_and_freezes_the_ledger():
    run = Run().attach().train(5)
    before = run.audit.mechanism()
    run.audit.detach()
    assert not {"add_noise", "pre_step", "clip_and_accumulate"} & set(run.optimizer.__dict__)
    assert not run.optimizer.original_optimizer._optimizer_step_post_hooks
    assert not run.audit.attached
    run.train(3)  # steps after detaching are not the checks' business
    assert run.audit.mechanism() == before
    run.audit.detach()  # again: nothing
    again = MechanismChecks(run.optimizer)  # a new one may attach
    again.detach()


def test_detach_refuses_when_a_wrapped_method_was_wrapped_again():
    run = Run().attach()
    run.optimizer.add_noise = lambda: None
    with pytest.raises(RuntimeError, match="add_noise was replaced"):
        run.audit.detach()


def test_two_sets_of_checks_are_refused():
    run = Run().attach()
    with pytest.raises(ValueError, match="already carries mechanism checks"):
        MechanismChecks(run.optimizer)
    with pytest.raises(ValueError, match="already carries mechanism checks"):
        GradientCanaries(run.optimizer, 10)
    GradientCanaries(run.optimizer, 10, checks=()).detach()  # canaries without checks: fine
    other = Run()
    GradientCanaries(other.optimizer, 10, checks=())
    with pytest.raises(ValueError, match="pass checks= to them"):
        MechanismChecks(other.optimizer)  # it would not know the canary block
    MechanismChecks(other.optimizer, checks=())  # nothing to run: fine


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="optimizer must be an Opacus DPOptimizer"):
        MechanismChecks(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="checks must be a subset of"):
        MechanismChecks(Run().optimizer, checks=("noise", "clip"))


def test_ghost_clipping_without_its_model_refuses_clipping_and_runs_the_others():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(N, 6), torch.randint(0, 3, (N,)))
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    model, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        data_loader=DataLoader(data, batch_size=BATCH),
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        grad_sample_mode="ghost",
    )
    with pytest.raises(
        ValueError,
        match=r"clipping cannot run .*ghost clipping .*pass module=.*"
        r"Pass checks=\('noise', 'sampling', 'steps', 'ledger'\)",
    ):
        MechanismChecks(optimizer)
    checks = MechanismChecks(optimizer, checks=("noise", "sampling", "steps", "ledger"))
    with_noise_factor(optimizer, 0.5)  # after the checks: outside them, and still seen
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    found = {f"{f.check}/{f.test}": f for f in checks.mechanism()}
    assert found["noise/variance"].p_value < FAULT_LEVEL
    assert not any(f.fired for f in found.values())


def _per_sample_grads(net, x, y):
    """What ``grad_sample_mode="no_op"`` leaves to the user: each record's gradient, set as
    ``grad_sample`` (torch.func, vmapped)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(net, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for name, p in net.named_parameters():
        p.grad_sample = grads[name]


@pytest.mark.parametrize("canaries", [0, 100])
@pytest.mark.parametrize("mode", ["ew", "functorch", "no_op"])
def test_flat_clipping_in_every_grad_sample_mode_runs_the_checks_and_the_canaries(mode, canaries):
    """What the refusals advise runs: flat clipping with every grad_sample_mode but ghost
    (DistributedDPOptimizer: test_mechanism_distributed.py)."""
    run = Run(canaries=canaries, private_options={"grad_sample_mode": mode}).attach()
    if mode == "no_op":
        for x, y in run.loader:
            run.optimizer.zero_grad()
            _per_sample_grads(run.net, x, y)
            run.optimizer.step()
            run.step += 1
    else:
        run.train(10)
    assert run.audit.steps == run.step >= 10
    assert_silent(run)
    assert "clipping: a row of norm 100 C contributed at most C" in (
        run.findings()["clipping/probe"].evidence
    )


def _refusal(make) -> str:
    with pytest.raises(ValueError) as refused:
        make()
    return str(refused.value)


FLAT = (
    "flat clipping (make_private(clipping='flat'), grad_sample_mode 'hooks', 'functorch', 'ew' "
    "or 'no_op', on one process or under DDP: DistributedDPOptimizer)"
)
PER_LAYER = "per-layer clipping on one process (clipping='per_layer')"


def _private_optimizer(**options):
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(N, 6), torch.randint(0, 3, (N,)))
    made = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=SIGMA,
        **{"max_grad_norm": CLIP, **options},
    )
    return made[1]


def _adaclip():
    from opacus.optimizers import AdaClipDPOptimizer

    return AdaClipDPOptimizer(
        torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
        noise_multiplier=0.5,
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10,
        min_clipbound=0.1,
        unclipped_num_std=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )


@pytest.mark.parametrize(
    ("kind", "options", "refused", "runs"),
    [
        (
            "DPOptimizerFastGradientClipping",
            {"grad_sample_mode": "ghost", "criterion": nn.CrossEntropyLoss()},
            ("clipping",),
            ("noise", "sampling", "steps", "ledger"),
        ),
        ("DPPerLayerOptimizer", {"clipping": "per_layer", "max_grad_norm": [0.5] * 4}, (), None),
        ("AdaClipDPOptimizer", None, (), None),
    ],
)
def test_each_refusal_advises_only_what_runs(kind, options, refused, runs):
    """Each refusal names what does run on the optimizer it refuses (and that runs) and where
    the refused part runs: flat clipping in any grad_sample_mode but ghost, one process or DDP
    (each run by the test above), per-layer clipping on one process for the checks."""
    optimizer = _adaclip() if options is None else _private_optimizer(**options)
    runs = runs or MECHANISM_CHECKS
    assert MechanismChecks.runnable(optimizer) == runs
    if refused:
        names = ", ".join(refused)
        said = _refusal(lambda: MechanismChecks(optimizer))
        assert said.startswith(f"optimizer is an Opacus {kind}, on which the mechanism checks ")
        assert said.endswith(
            f"Pass checks={runs!r} to run the others; {names} run with {FLAT} or {PER_LAYER} or "
            "adaptive clipping (clipping='adaptive') or per-layer clipping under DDP."
        )
        assert "grad_sample_mode='hooks')" not in said
    MechanismChecks(optimizer, checks=runs).detach()  # what it says runs, runs
    said = _refusal(lambda: GradientCanaries(optimizer, 10, sample_rate=0.1))
    assert said.startswith(f"optimizer is an Opacus {kind}, which GradientCanaries do not support")
    assert said.endswith(
        f". GradientCanaries run with {FLAT}. On it MechanismChecks(optimizer, checks={runs!r}) "
        "runs."
    )
    if refused:  # where the refused checks run, they run
        per_layer = _private_optimizer(clipping="per_layer", max_grad_norm=[0.5] * 4)
        MechanismChecks(per_layer, checks=refused).detach()


def test_per_layer_clipping_is_checked_and_a_wrong_layer_bound_fires():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(N, 6), torch.randint(0, 3, (N,)))
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    model, optimizer, loader = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=SIGMA,
        max_grad_norm=[0.5] * 4,  # C = 1
        clipping="per_layer",
    )
    checks = MechanismChecks(optimizer)
    for step, (x, y) in enumerate(loader):
        if step == 5:
            optimizer.max_grad_norms[0] = 3.0  # one layer's bound raised, C (the noise) not
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    found = {f"{f.check}/{f.test}": f for f in checks.mechanism()}
    assert found["clipping/probe"].fired
    assert "above C = 1.0 (step 6; 5 of 10 probes)" in found["clipping/probe"].evidence
