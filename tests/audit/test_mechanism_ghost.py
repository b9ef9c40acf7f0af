"""The mechanism checks under ghost clipping (``grad_sample_mode="ghost"``, Opacus 1.6): the
clipping check probes the model's own ``get_clipping_coef`` (which weights each row's loss in
the second backward pass) with a row of norm 100 C and counts the steps whose backward pass
computed coefficients; the sampling check counts the rows the backward pass computed norms for.
Correct runs are silent over seeds and train bit-identically with and without the checks; a clip
at 10 C with noise for C, a loss that is not the criterion make_private returned (no clipping at
all) and full batches where Poisson ones are accounted are each caught in 5 of 5 seeds."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from dp_sgd import N, make_private, toy_data, toy_net, train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon.audit import MechanismChecks

pytest.importorskip("opacus")
from opacus import PrivacyEngine

BATCH, SIGMA, CLIP, STEPS = 20, 1.0, 0.1, 20  # q = 0.1; the rows' norms are above C
SEEDS = range(5)


def _run(seed: int, fault: str = "", *, watched: bool = True) -> tuple[dict, dict]:
    torch.manual_seed(seed)
    data, net = toy_data(seed + 100), toy_net()
    model, optimizer, criterion, loader = make_private(
        net,
        net,
        data,
        batch=BATCH,
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        grad_sample_mode="ghost",
    )
    checks = MechanismChecks(optimizer, module=model) if watched else None
    if fault == "clip at 10 C":  # the model clips at 10 C, the noise stays for C
        model.max_grad_norm = 10 * CLIP
    loss_of = nn.CrossEntropyLoss() if fault == "not the DP criterion" else criterion
    if fault == "full batches":
        loader = DataLoader(data, batch_size=N)
    train(model, optimizer, loader, loss_of, steps=STEPS)
    found = {} if checks is None else {f"{f.check}/{f.test}": f for f in checks.mechanism()}
    return found, {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_correct_ghost_run_is_silent(seed):
    found, _ = _run(seed)
    assert set(found) >= {"clipping/probe", "sampling/mean", "noise/variance", "ledger/weights"}
    for name, f in found.items():
        assert not f.fired, f.evidence
        assert f.p_value is None or f.p_value > 1e-3, (name, f.evidence)
    assert found["clipping/probe"].evidence.startswith(
        "clipping: a row of norm 100 C contributed at most C in 11 probes over 20 steps"
    )


def test_training_is_bit_identical_with_and_without_the_checks():
    _, watched = _run(0)
    _, alone = _run(0, watched=False)
    assert all(torch.equal(watched[k], alone[k]) for k in alone)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_clip_at_10_c_with_noise_for_c_fires_at_the_first_step(seed):
    f = _run(seed, "clip at 10 C")[0]["clipping/probe"]
    assert f.fired
    # the probe's row of norm 100 C = 10 keeps 10 C / (100 C) of it: 10 C = 1.0
    assert f.evidence == (
        "clipping: a row of norm 10 contributed 1.0, above C = 0.1 (step 1; 11 of 11 probes)"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_loss_that_is_not_the_dp_criterion_is_no_clipping_and_fires(seed):
    f = _run(seed, "not the DP criterion")[0]["clipping/probe"]
    assert f.fired
    assert f.evidence.startswith(
        "clipping: step 1 was not clipped: its backward pass computed no ghost clipping "
        f"coefficients ({STEPS} of {STEPS} steps)"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_full_batches_where_poisson_ones_are_accounted_fire_the_sampling_test(seed):
    f = _run(seed, "full batches")[0]["sampling/mean"]
    assert f.p_value < 1e-6
    assert f.evidence.startswith(f"sampling: {N} rows in each of {STEPS} steps")


def _ghost_optimizer() -> tuple[nn.Module, object]:
    net = nn.Linear(6, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _, _ = PrivacyEngine().make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(20, 6), torch.zeros(20)), 5),
            criterion=nn.CrossEntropyLoss(),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            grad_sample_mode="ghost",
        )
    return model, optimizer


def test_without_the_module_the_clipping_check_is_refused_saying_to_pass_it():
    model, optimizer = _ghost_optimizer()
    with pytest.raises(ValueError, match=r"clipping cannot run .*pass module=") as raised:
        MechanismChecks(optimizer)
    assert "checks=('noise', 'sampling', 'steps', 'ledger')" in str(raised.value)
    MechanismChecks(optimizer, checks=("noise", "sampling", "steps", "ledger")).detach()
    with MechanismChecks(optimizer, module=model) as checks:
        assert checks.checks[0] == "clipping"
    assert "get_clipping_coef" not in model.__dict__  # detached: the model's method is back


def test_a_module_that_is_not_the_optimizers_ghost_model_is_refused():
    _, optimizer = _ghost_optimizer()
    with pytest.raises(TypeError, match="module must be the GradSampleModuleFastGradientClipping"):
        MechanismChecks(optimizer, module=nn.Linear(6, 3))
    other, _ = _ghost_optimizer()
    with pytest.raises(ValueError, match="module's trainable parameters are not all"):
        MechanismChecks(optimizer, module=other)
    net = nn.Linear(6, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat_model, flat, _ = PrivacyEngine().make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(20, 6), torch.zeros(20)), 5),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
        )
    with pytest.raises(ValueError, match="module is read under ghost clipping only"):
        MechanismChecks(flat, module=flat_model)


def test_a_nan_in_one_record_names_its_row_from_the_per_sample_norms():
    """Ghost clipping keeps no per-sample gradients: the row is read from its NaN norm (its
    clipping coefficient is NaN, and so is the clipped sum)."""
    torch.manual_seed(0)
    x = torch.randn(N, 6)
    x[0, 0] = float("nan")
    data = TensorDataset(x, torch.randint(0, 3, (N,)))
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, criterion, loader = PrivacyEngine().make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
            data_loader=DataLoader(data, batch_size=BATCH),
            criterion=nn.CrossEntropyLoss(),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            grad_sample_mode="ghost",
        )
    with MechanismChecks(optimizer, module=model) as checks:
        for _ in range(3):  # 30 steps
            for xb, yb in loader:
                optimizer.zero_grad()
                criterion(model(xb), yb).backward()
                optimizer.step()
        found = {f"{f.check}/{f.test}": f for f in checks.mechanism()}["clipping/finite"]
    assert found.fired
    # Poisson batches keep the dataset's order: record 0 is row 0 of any batch it is in
    assert re.fullmatch(
        r"clipping: a per-sample gradient of record slot 0 was NaN at step \d+: it passed "
        r"clipping unbounded \(\d+ of 30 steps noised a non-finite clipped sum\)",
        found.evidence,
    ), found.evidence
