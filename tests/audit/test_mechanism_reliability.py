"""The DP mechanism checks never say "DP violation" on a correct run, in any dtype, and still
catch the faults: real Opacus runs of tiny models in bfloat16, float16 and float32, at σ·C ≠ 1,
under gradient accumulation, with empty Poisson batches, on a one-tensor model, with every
parameter frozen, after a resume; the findings of the states before any test can run; bad
``checks=`` and a model on the meta device refused at construction.
"""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon.audit import GradientCanaries, MechanismChecks
from privmon.audit.mechanism_evidence import sampling
from privmon.audit.mechanism_math import RowCounts

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings(
        "ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward", "ignore:.*empty"
    ),
]

LEVEL = 1e-3  # a correct run's p-values stay above; a fault's fall far below
FAULT_LEVEL = 1e-6


def private(
    *,
    n: int = 200,
    batch: int = 20,
    sigma: float = 1.0,
    clip: float = 1.0,
    dtype: torch.dtype = torch.float32,
    net: nn.Module | None = None,
    data: TensorDataset | None = None,
    seed: int = 0,
) -> tuple[nn.Module, Any, DataLoader, PrivacyEngine, nn.Module]:
    """A tiny model made private by Opacus (Poisson batches at rate batch / n)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if data is None:
        data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    net = (net or nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))).to(dtype)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
        data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=clip,
    )
    return model, optimizer, loader, engine, net


def train(model: nn.Module, optimizer: Any, loader: DataLoader, steps: int, *, every=1) -> None:
    """``steps`` optimizer steps, each over ``every`` Poisson batches (gradient accumulation)."""
    dtype = next(model.parameters()).dtype
    done = batches = 0
    while done < steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
            loss.backward()
            batches += 1
            if batches % every == 0:
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done == steps:
                    return


def findings(checks: Any) -> dict[str, Any]:
    return {f"{f.check}/{f.test}": f for f in checks.mechanism()}


def fired(checks: Any) -> dict[str, str]:
    """The tests that fire: deterministic ones that fired, statistical ones below FAULT_LEVEL."""
    return {
        name: f.evidence
        for name, f in findings(checks).items()
        if f.fired or (f.p_value is not None and f.p_value < FAULT_LEVEL)
    }


def assert_silent(checks: Any) -> None:
    for name, f in findings(checks).items():
        assert not f.fired, f.evidence
        if f.kind == "statistical":
            assert f.p_value > LEVEL, (name, f.p_value, f.evidence)


# -- refused at construction ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", [None, 5, 2.5])
def test_checks_that_are_no_names_are_refused_naming_the_argument(bad):
    _, optimizer, *_ = private()
    valid = re.escape("('clipping', 'noise', 'sampling', 'steps', 'ledger')")
    kind = type(bad).__name__
    message = rf"^checks must be a name or names from {valid} \(or empty\), got {kind}$"
    with pytest.raises(TypeError, match=message):
        MechanismChecks(optimizer, checks=bad)
    with pytest.raises(TypeError, match=message):
        GradientCanaries(optimizer, 10, checks=bad)
    assert not {"add_noise", "pre_step", "clip_and_accumulate"} & set(optimizer.__dict__)


def test_one_name_or_names_in_any_order_give_the_checks_in_their_order():
    _, optimizer, *_ = private()
    with MechanismChecks(optimizer, checks="steps") as checks:
        assert checks.checks == ("steps",)
    with MechanismChecks(optimizer, checks=["ledger", "noise", "noise"]) as checks:
        assert checks.checks == ("noise", "ledger")
    with GradientCanaries(optimizer, 10, checks=iter(["steps"])) as canaries:
        assert canaries.mechanism_checks.checks == ("steps",)


@pytest.mark.parametrize("who", ["MechanismChecks", "GradientCanaries"])
def test_a_model_on_the_meta_device_is_refused_naming_the_device(who):
    model, optimizer, loader, *_ = private(net=nn.Sequential(nn.Linear(6, 3)).to("meta"))
    refused = rf"parameter 0 \(shape \(3, 6\)\) is on the meta device, .* for {who} to read"
    with pytest.raises(ValueError, match=refused):
        if who == "MechanismChecks":
            MechanismChecks(optimizer)
        else:
            GradientCanaries(optimizer, 10)
    assert not {"add_noise", "pre_step", "clip_and_accumulate"} & set(optimizer.__dict__)
    assert len(optimizer.param_groups) == 1  # no canary block joined
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x.to("meta")), y.to("meta")).backward()
    optimizer.step()  # the step runs as without the checks


# -- low precision: the rounding of a correct step is no fault -------------------------------------
def clip_at(optimizer: Any, factor: float) -> None:
    """The optimizer clips at factor × C (its noise still calibrated to C)."""
    original = optimizer.clip_and_accumulate

    def clip_and_accumulate() -> None:
        bound = optimizer.max_grad_norm
        optimizer.max_grad_norm = bound * factor
        try:
            original()
        finally:
            optimizer.max_grad_norm = bound

    optimizer.clip_and_accumulate = clip_and_accumulate


def attach(optimizer: Any, canaries: int) -> Any:
    return GradientCanaries(optimizer, canaries) if canaries else MechanismChecks(optimizer)


@pytest.mark.parametrize("canaries", [0, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_correct_run_fires_nothing_in_any_dtype(dtype, canaries):
    model, optimizer, loader, *_ = private(dtype=dtype)
    with attach(optimizer, canaries) as checks:
        train(model, optimizer, loader, 20)
        assert_silent(checks)
        clipping = findings(checks)["clipping/probe"].evidence
    if dtype in (torch.bfloat16, torch.float16):  # the probe did round above C
        assert re.fullmatch(
            r"clipping: a row of norm 100 C contributed at most 1\.000\d+ C, within its "
            r"precision's rounding, in 11 probes over 20 steps \(the last C = 1\.0\)",
            clipping,
        ), clipping
    else:
        assert "contributed at most C in 11 probes" in clipping


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_clip_at_1_1_c_fires_in_any_dtype(dtype):
    model, optimizer, loader, *_ = private(dtype=dtype)
    clip_at(optimizer, 1.1)
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 5)
    found = fired(checks)
    assert set(found) == {"clipping/probe"}, found
    contributed = re.fullmatch(
        r"clipping: a row of norm 100 contributed ([0-9.]+), above C = 1\.0 \(step 1; 5 of 5 "
        r"probes\)",
        found["clipping/probe"],
    )
    assert contributed, found["clipping/probe"]
    assert float(contributed.group(1)) == pytest.approx(1.1, abs=0.01)


def large_sums(dtype: torch.dtype, sigma: float) -> tuple[nn.Module, Any, DataLoader]:
    """Batches of 2000 records that agree (one label, inputs of mean 3): summed-gradient entries
    of hundreds, far above σ C = 0.05 / bfloat16's resolution."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8000, 6, generator=g) + 3, torch.zeros(8000, dtype=torch.long))
    model, optimizer, loader, *_ = private(dtype=dtype, sigma=sigma, batch=2000, data=data)
    return model, optimizer, loader


def test_noise_lost_to_the_rounding_of_large_sums_is_no_fault():
    """bfloat16 rounds s + n to a grid coarser than σ C where |s| is large: z = fl(s + n) − s
    reads less noise there, though fl(s + n), a function of s + n, is as private; only the
    entries the precision resolves are tested, and their noise is the accountant's."""
    model, optimizer, loader = large_sums(torch.bfloat16, 0.05)
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 8)
    assert_silent(checks)
    variance = findings(checks)["noise/variance"].evidence
    assert noise_ratio(variance) == pytest.approx(1.0, abs=0.15), variance


def test_halved_noise_on_large_sums_still_fires():
    model, optimizer, loader = large_sums(torch.bfloat16, 0.05)
    halve_noise(optimizer)
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 8)
    found = fired(checks)
    assert set(found) == {"noise/variance"}, found
    ratio = noise_ratio(found["noise/variance"])
    assert ratio == pytest.approx(0.5, abs=0.1)


def test_noise_repeated_by_a_seed_reset_is_still_seen_in_bfloat16():
    model, optimizer, loader, *_ = private(dtype=torch.bfloat16)
    with MechanismChecks(optimizer) as checks:
        for _ in range(4):
            torch.manual_seed(0)  # every epoch draws the same noise
            train(model, optimizer, loader, 10)
    found = fired(checks)
    assert set(found) == {"noise/repeat"}, found
    assert re.fullmatch(
        r"noise: step \d+ repeats the noise of step \d+ \(\d+ of 40 steps repeat an earlier "
        r"step's noise\)",
        found["noise/repeat"],
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_correct_clipping_of_any_shape_and_bound_stays_within_the_rounding(dtype):
    """Random widths, depths and C from 10⁻² to 10²: the probe through Opacus' own clipping
    never exceeds C by more than its precision's rounding allows (it reaches a few u)."""
    g = torch.Generator().manual_seed(1)
    u = torch.finfo(dtype).eps / 2
    worst = 0.0
    for _ in range(12):
        depth = int(torch.randint(1, 5, (1,), generator=g))
        widths = [6, *torch.randint(1, 300, (depth,), generator=g).tolist(), 3]
        layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
        clip = float(10 ** (4 * torch.rand(1, generator=g) - 2))
        model, optimizer, loader, *_ = private(net=nn.Sequential(*layers), dtype=dtype, clip=clip)
        with MechanismChecks(optimizer, checks=("clipping",)) as checks:
            train(model, optimizer, loader, 1)
            finding, finite = checks.mechanism()
        assert not finding.fired, finding.evidence
        assert not finite.fired, finite.evidence  # a correct run's gradients: finite in any dtype
        said = re.search(r"contributed at most ([0-9.]+) C", finding.evidence)
        worst = max(worst, float(said.group(1)) - 1 if said else 0.0)
    assert 0 < worst < 4 * u  # the probe did round above C, and far less than the bound


# -- the ledger compares values where a step without noise moved the counters ---------------------
def test_a_step_with_every_parameter_frozen_is_no_non_private_update():
    """Opacus steps the inner optimizer on zero gradients when no parameter requires a gradient:
    every version counter moves, no value does."""
    model, optimizer, loader, _, net = private()
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 10)
        weights = copy.deepcopy(net.state_dict())
        for p in net.parameters():
            p.requires_grad_(False)
        for _ in range(2):
            optimizer.zero_grad()
            optimizer.step()
        for key, value in weights.items():
            assert torch.equal(value, net.state_dict()[key]), key
        assert_silent(checks)
        assert findings(checks)["ledger/weights"].evidence == (
            "ledger: the weights are those of the last private step (step 10)"
        )
        with torch.no_grad():  # a real write after the frozen steps is still seen
            net[2].bias.add_(1.0)
        assert fired(checks) == {
            "ledger/weights": "ledger: the weights changed after the last private step (step "
            "10): a non-private update"
        }


def test_a_write_between_private_steps_is_found_though_no_check_falls_between():
    """An in-place edit after step 10 that the next private step builds on; at the check after
    step 20 the weights are that step's, but the ledger saw the write at step 11's start. A state
    saved and loaded keeps the count."""
    model, optimizer, loader, _, net = private()
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 10)
        assert_silent(checks)
        with torch.no_grad():
            net[2].weight.clamp_(-0.01, 0.01)  # a max-norm-like projection: still a write
        train(model, optimizer, loader, 10)
        said = (
            "ledger: the weights were written outside the optimizer's steps before 1 private "
            "steps (first after private step 10): a non-private update"
        )
        assert fired(checks) == {"ledger/weights": said}
        state = checks.state_dict()
    _, again, *_ = private()
    resumed = MechanismChecks(again)
    resumed.load_state_dict(state)
    assert fired(resumed)["ledger/weights"] == said


def test_a_step_without_noise_that_moves_the_weights_is_still_found():
    model, optimizer, loader, _, net = private()
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 10)
        for p in net.parameters():
            p.requires_grad_(False)
        optimizer.zero_grad()
        optimizer.step()  # frozen: no change
        for p in net.parameters():
            p.requires_grad_(True)
            p.grad = torch.ones_like(p)
        optimizer.original_optimizer.step()  # no noise, every weight moved
        assert fired(checks) == {
            "ledger/weights": "ledger: the optimizer stepped 1 times without noise (first after "
            "private step 10); the weights changed after the last private step (step 10): a "
            "non-private update"
        }


# -- what a user sees, for each configuration the other tests do not run --------------------------
def noise_ratio(evidence: str) -> float:
    return float(re.search(r"the noise added has ([0-9.]+) × the standard deviation", evidence)[1])


def halve_noise(optimizer: Any) -> None:
    original = optimizer.add_noise

    def add_noise() -> None:
        optimizer.noise_multiplier /= 2
        try:
            original()
        finally:
            optimizer.noise_multiplier *= 2

    optimizer.add_noise = add_noise


@pytest.mark.parametrize(("sigma", "clip"), [(2.5, 1.0), (1.0, 0.5)])
def test_the_noise_test_scales_by_sigma_c(sigma, clip):
    """S = Σ z² / (σ C)²: a correct run reads 1 × the accountant's std at any σ·C, halved
    noise 0.5 ×."""
    model, optimizer, loader, *_ = private(sigma=sigma, clip=clip)
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 10)
    assert_silent(checks)
    variance = findings(checks)["noise/variance"].evidence
    assert noise_ratio(variance) == pytest.approx(1.0, abs=0.03)
    assert f"(σ·C = {sigma * clip};" in variance
    model, optimizer, loader, *_ = private(sigma=sigma, clip=clip)
    halve_noise(optimizer)
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 10)
    found = fired(checks)
    assert set(found) == {"noise/variance"}, found
    assert noise_ratio(found["noise/variance"]) == pytest.approx(0.5, abs=0.03)


def test_gradient_accumulation_is_sampled_at_the_accumulated_rate():
    """Two Poisson batches at q = 0.05 per step: the accountant counts q = 0.1, and so do the
    rows (about 20 a step)."""
    model, optimizer, loader, *_ = private(batch=10)
    model.allow_grad_accumulation()  # Opacus forbids it over Poisson batches unless asked
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 40, every=2)
    assert_silent(checks)
    assert "the accountant assumes Binomial(200, 0.1) (mean 20.0, variance 18.0)" in (
        findings(checks)["sampling/mean"].evidence
    )


@pytest.mark.parametrize("canaries", [0, 100])
def test_a_one_tensor_model_is_checked(canaries):
    net = nn.Linear(6, 8, bias=False)
    model, optimizer, loader, *_ = private(
        net=net, data=TensorDataset(torch.randn(200, 6), torch.randint(0, 8, (200,)))
    )
    with attach(optimizer, canaries) as checks:
        train(model, optimizer, loader, 10)
    assert_silent(checks)
    found = findings(checks)
    assert "values over 10 steps" in found["noise/variance"].evidence
    assert found["noise/repeat"].evidence == "noise: no step repeats another's noise (10 steps)"
    assert found["clipping/probe"].evidence.endswith(
        "in 10 probes over 10 steps (the last C = 1.0)"
    )
    model, optimizer, loader, *_ = private(net=nn.Linear(6, 8, bias=False))
    with MechanismChecks(optimizer) as checks:  # the noise of one step, drawn again: seen
        for _ in range(2):
            torch.manual_seed(0)
            train(model, optimizer, loader, 1)
    assert fired(checks) == {
        "noise/repeat": "noise: step 2 repeats the noise of step 1 (1 of 2 steps repeat an "
        "earlier step's noise)"
    }


def test_empty_poisson_batches_are_counted_as_steps_of_no_rows():
    """q = 0.05 of 20 records: a third of the batches are empty (Opacus steps on them)."""
    model, optimizer, loader, *_ = private(n=20, batch=1)
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 30)
    assert_silent(checks)
    sampling = findings(checks)["sampling/mean"].evidence
    assert re.fullmatch(
        r"sampling: [0-9.]+ rows per step \(variance [0-9.]+\) over 30 steps, the accountant "
        r"assumes Binomial\(20, 0\.05\) \(mean 1\.0, variance 0\.95\)",
        sampling,
    ), sampling


def test_a_resume_says_the_c_and_sigma_c_of_the_saved_run():
    """σ = 2.5, C = 0.5 (σ·C = 1.25), clipping at 3 C: the resumed checks' sentences are the
    saved run's, before any step of their own."""
    model, optimizer, loader, *_ = private(sigma=2.5, clip=0.5)
    clip_at(optimizer, 3.0)
    saved = MechanismChecks(optimizer)
    train(model, optimizer, loader, 12)
    state = copy.deepcopy(saved.state_dict())
    before = findings(saved)
    _, fresh_optimizer, *_ = private(sigma=2.5, clip=0.5, seed=1)
    with MechanismChecks(fresh_optimizer) as resumed:
        resumed.load_state_dict(state)
        after = findings(resumed)
    assert after["clipping/probe"].evidence == (
        "clipping: a row of norm 50 contributed 1.5, above C = 0.5 (step 1; 10 of 10 probes)"
    )
    assert "(σ·C = 1.25; " in after["noise/variance"].evidence
    for name in ("clipping/probe", "noise/variance", "noise/repeat", "sampling/mean"):
        assert after[name] == before[name], name


def test_the_findings_before_any_step_are_all_there():
    _, optimizer, *_ = private()
    with GradientCanaries(optimizer, 10) as canaries:
        assert [
            (f.check, f.test, f.fired, f.p_value, f.evidence) for f in canaries.mechanism()
        ] == [
            ("clipping", "probe", False, None, "clipping: not tested: no private step yet"),
            ("clipping", "finite", False, None, "clipping: no private step yet"),
            ("noise", "variance", False, 1.0, "noise: not tested: no noised step with σ·C > 0 yet"),
            ("noise", "repeat", False, None, "noise: no noised step yet"),
            (
                "sampling",
                "mean",
                False,
                1.0,
                "sampling: not tested: no private step with q < 1 yet",
            ),
            (
                "sampling",
                "dispersion",
                False,
                1.0,
                "sampling: not tested: no private step with q < 1 yet",
            ),
            (
                "steps",
                "count",
                False,
                None,
                "steps: the accountant counted 0 noised steps, 0 were taken",
            ),
            ("ledger", "weights", False, None, "ledger: no private step yet"),
        ]


def test_a_step_hook_that_is_no_accountant_s_leaves_sampling_and_steps_untested():
    model, optimizer, loader, *_ = private()
    optimizer.step_hook = lambda optimizer: None  # e.g. the user's own accounting
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 5)
    assert_silent(checks)
    found = findings(checks)
    assert len(found) == 8
    for test in ("mean", "dispersion"):
        assert (found[f"sampling/{test}"].p_value, found[f"sampling/{test}"].evidence) == (
            1.0,
            "sampling: not tested: the optimizer's step hook is no Opacus accountant's, so the "
            "sampling rate the accountant uses is unknown",
        )
    assert found["steps/count"].evidence.startswith("steps: not tested: no Opacus accountant")


def test_an_optimizer_without_expected_batch_size_leaves_sampling_untested():
    model, optimizer, loader, *_ = private()
    optimizer.loss_reduction = "sum"  # Opacus needs no expected batch size to sum
    optimizer.expected_batch_size = None
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 5)
    assert_silent(checks)
    found = findings(checks)
    assert len(found) == 8
    for test in ("mean", "dispersion"):
        assert (found[f"sampling/{test}"].p_value, found[f"sampling/{test}"].evidence) == (
            1.0,
            "sampling: not tested: the optimizer has no expected_batch_size to tell the dataset "
            "size N from",
        )


def test_a_rank_s_rows_are_tested_against_its_shard():
    """Two ranks, N = 200 at q = 0.1 (expected batch size 10 a rank): a rank's shard holds 100
    records, so Binomial(100, 0.1) rows are silent and Binomial(200, 0.1), the whole dataset,
    fire; on one process the same rows are the whole dataset's."""
    rng = np.random.default_rng(0)
    shard, whole = RowCounts(), RowCounts()
    for k in rng.binomial(100, 0.1, size=30):
        shard.add(int(k), 0.1)
    for k in rng.binomial(200, 0.1, size=30):
        whole.add(int(k), 0.1)
    assert sampling("mean", shard, 0.1, 10, world=2).p_value > LEVEL
    found = sampling("mean", whole, 0.1, 10, world=2)
    assert found.p_value < FAULT_LEVEL
    assert "the accountant assumes Binomial(100, 0.1) on this rank's shard" in found.evidence
    assert sampling("mean", whole, 0.1, 20, world=1).p_value > LEVEL
