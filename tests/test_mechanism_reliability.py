"""The DP mechanism checks never say "DP violation" on a correct run, in any dtype, and still
catch the faults: real Opacus runs of tiny models in bfloat16, float16 and float32, at σ·C ≠ 1,
under gradient accumulation, with empty Poisson batches, on a one-tensor model, with every
parameter frozen, after a resume; the findings of the states before any test can run; bad
``checks=`` and a model on the meta device refused at construction.
"""

from __future__ import annotations

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
