"""The mechanism checks under AdaClip (``clipping="adaptive"``, Opacus 1.6): the clipping probe
replays its ``clip_and_accumulate`` at the bound of the moment (its counts of clipped rows put
back), the noise test reads the gradient's noise against σ_g C, the part of σ the noisy count
leaves (Andrew et al., Theorem 1), with C the bound the step clipped to (AdaClip moves it after
the noise), and the count's noise against σ_u, Bonferroni-combined. Correct runs are silent over
seeds and train bit-identically; halved gradient noise, a count left without noise and a clip at
10 C are each caught in 5 of 5 seeds."""

from __future__ import annotations

import re

import pytest
import torch
from dp_sgd import make_private, toy_data, toy_net, train
from torch import nn

from privmon.audit import MechanismChecks

pytest.importorskip("opacus")

BATCH, SIGMA, SIGMA_COUNT, STEPS = 20, 1.0, 2.0, 30
SEEDS = range(5)


def _halved_gradient_noise(optimizer) -> None:
    """The gradient's noise σ_g C / 2, the count's untouched (σ chosen so that σ_g halves)."""
    original = optimizer.add_noise

    def add_noise() -> None:
        sigma, u = optimizer.noise_multiplier, optimizer.unclipped_num_std
        optimizer.noise_multiplier = (4 * (sigma**-2 - (2 * u) ** -2) + (2 * u) ** -2) ** -0.5
        try:
            original()
        finally:
            optimizer.noise_multiplier = sigma

    optimizer.add_noise = add_noise


def _count_without_noise(optimizer) -> None:
    original = optimizer.add_noise

    def add_noise() -> None:
        count = optimizer.unclipped_num
        original()
        optimizer.unclipped_num = torch.as_tensor(count, dtype=torch.float32)

    optimizer.add_noise = add_noise


def _clip_at_10_c(optimizer) -> None:
    original = optimizer.clip_and_accumulate

    def clip_and_accumulate() -> None:
        bound = optimizer.max_grad_norm
        optimizer.max_grad_norm = 10 * bound
        try:
            original()
        finally:
            optimizer.max_grad_norm = bound

    optimizer.clip_and_accumulate = clip_and_accumulate


FAULTS = {
    "halved gradient noise": _halved_gradient_noise,
    "count without noise": _count_without_noise,
    "clip at 10 C": _clip_at_10_c,
}


def _run(seed: int, fault: str = "", *, watched: bool = True) -> tuple[dict, list]:
    torch.manual_seed(seed)
    data, net = toy_data(seed + 100), toy_net()
    model, optimizer, loader = make_private(
        net,
        net,
        data,
        batch=BATCH,
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        clipping="adaptive",
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.01,
        unclipped_num_std=SIGMA_COUNT,
    )
    checks = MechanismChecks(optimizer) if watched else None
    if fault:
        FAULTS[fault](optimizer)  # after the checks: outside their wrappers, and still seen
    train(model, optimizer, loader, nn.functional.cross_entropy, steps=STEPS)
    found = {} if checks is None else {f"{f.check}/{f.test}": f for f in checks.mechanism()}
    return found, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_correct_adaclip_run_is_silent(seed):
    found, _ = _run(seed)
    assert len(found) == 8  # every test of MECHANISM_CHECKS
    for name, f in found.items():
        assert not f.fired, f.evidence
        assert f.p_value is None or f.p_value > 1e-3, (name, f.evidence)
    noise = found["noise/variance"].evidence
    ratios = [float(r) for r in re.findall(r"has ([0-9.]+) ×", noise)]
    assert len(ratios) == 2 and ratios[0] == pytest.approx(1, abs=0.05), noise


def test_training_is_bit_identical_with_and_without_the_checks():
    watched, alone = _run(0)[1], _run(0, watched=False)[1]
    assert all(torch.equal(a, b) for a, b in zip(watched, alone, strict=True))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fault", ["halved gradient noise", "count without noise"])
def test_too_little_noise_on_the_gradient_or_the_count_fires(seed, fault):
    f = _run(seed, fault)[0]["noise/variance"]
    assert f.p_value < 1e-6, f.evidence
    gradient, count = (float(r) for r in re.findall(r"has ([0-9.]+) ×", f.evidence))
    if fault == "halved gradient noise":
        assert gradient == pytest.approx(0.5, abs=0.03)
    else:
        assert count == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_a_clip_at_10_c_fires_the_probe_at_every_step(seed):
    f = _run(seed, "clip at 10 C")[0]["clipping/probe"]
    assert f.fired
    assert re.fullmatch(
        r"clipping: a row of norm [0-9.]+ contributed [0-9.]+, above C = [0-9.]+ "
        rf"\(step [0-9]+; {STEPS} of {STEPS} probes\)",  # the worst probe's step; every one fired
        f.evidence,
    ), f.evidence
    ratio = re.search(r"contributed ([0-9.]+), above C = ([0-9.]+)", f.evidence)
    assert float(ratio[1]) / float(ratio[2]) == pytest.approx(10, rel=1e-3)
