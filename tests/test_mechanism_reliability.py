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

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon.audit import GradientCanaries, MechanismChecks

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
    message = rf"^checks must be a name or an iterable of names from {valid} \(empty: none\)"
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
    ratio = float(re.search(r"the noise added has ([0-9.]+) ×", variance).group(1))
    assert ratio == pytest.approx(1.0, abs=0.15), variance


def test_halved_noise_on_large_sums_still_fires():
    model, optimizer, loader = large_sums(torch.bfloat16, 0.05)
    original = optimizer.add_noise

    def add_noise() -> None:
        optimizer.noise_multiplier /= 2
        try:
            original()
        finally:
            optimizer.noise_multiplier *= 2

    optimizer.add_noise = add_noise
    with MechanismChecks(optimizer) as checks:
        train(model, optimizer, loader, 8)
    found = fired(checks)
    assert set(found) == {"noise/variance"}, found
    ratio = float(re.search(r"the noise added has ([0-9.]+) ×", found["noise/variance"]).group(1))
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
            (finding,) = checks.mechanism()
        assert not finding.fired, finding.evidence
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
            "ledger/weights": "ledger: 1 parameters changed after the last private step (step "
            "10): a non-private update"
        }


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
            "private step 10); 4 parameters changed after the last private step (step 10): a "
            "non-private update"
        }
