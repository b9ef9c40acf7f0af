"""Reported DP bugs, each reproduced on CPU with real Opacus (1.6), and what privmon says of
it: the mechanism checks' finding where it catches the bug, or its silence and why where the
run it sees is the mechanism the accountant accounts (the guide's table of faults, "What the
alarm catches, and what it cannot", has a row for each).

- opacus #813: a ``WeightedRandomSampler`` in the loader handed to ``make_private``;
- opacus #834: ``len(accountant)`` counts the accountant's history entries, not its steps;
- opacus #820: LoRA adapters trained outside the private step (the reported shape, without
  PEFT: adapter parameters the DP optimizer does not hold);
- opacus #819 / #571: the expected-batch-size normaliser E = int(N q) depends on N;
- synthcity's DP-GAN: ``make_private_with_epsilon(poisson_sampling=False)`` on a sequential
  loader;
- jax_privacy #288: with gradient accumulation, the accountant counting micro-batches while the
  optimizer takes one update per G of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from privmon.audit import GradientCanaries, MechanismChecks

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore"),  # Opacus' secure-RNG and sample-rate notices
]

SIGMA, CLIP = 1.0, 1.0
FAULT_LEVEL, LEVEL = 1e-6, 1e-3


def _data(n: int, features: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def _train(model, optimizer, loader, steps: int, *, accumulate: int = 1) -> int:
    """``steps`` optimizer steps (``accumulate`` backward passes each); returns the batches."""
    taken = batches = 0
    while taken < steps:
        for x, y in loader:
            if batches % accumulate == 0:
                optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            batches += 1
            if batches % accumulate == 0:
                optimizer.step()
                taken += 1
                if taken == steps:
                    break
    return batches


def _found(checks, accountant=None) -> dict:
    return {f"{f.check}/{f.test}": f for f in checks.mechanism(accountant)}


def _fired(found: dict) -> list[str]:
    return [
        name
        for name, f in found.items()
        if f.fired or (f.p_value is not None and f.p_value < FAULT_LEVEL)
    ]


def _silent(found: dict) -> None:
    for name, f in found.items():
        assert not f.fired, f.evidence
        assert f.p_value is None or f.p_value > LEVEL, (name, f.evidence)


# -- opacus #813 ---------------------------------------------------------------------------------
def _weighted(n: int, *, heavy: float) -> DataLoader:
    """The report's loader (scaled down): 128 draws an epoch with replacement, batches of 16, so
    ``len(loader)`` = 8 and Opacus accounts q = 1/8; record 0 weighs ``heavy`` times the others
    (class rebalancing)."""
    weights = torch.ones(n)
    weights[0] = heavy
    sampler = WeightedRandomSampler(weights, num_samples=128, replacement=True)
    return DataLoader(_data(n, 10), batch_size=16, sampler=sampler)


def test_opacus_813_a_weighted_sampler_kept_by_the_loader_fires_the_sampling_test():
    """``poisson_sampling=False`` keeps the user's sampler: 16 rows a step drawn with
    replacement, accounted as Poisson at q = 1/len(loader) = 0.125 of 10,000 records (E =
    1,250). Record 0, 10,000 times heavier, is in nearly every batch, several times: far above
    the accounted rate, with more than C of sensitivity."""
    torch.manual_seed(0)
    net = nn.Linear(10, 3)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=_weighted(10_000, heavy=10_000.0),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=False,
    )
    with MechanismChecks(optimizer) as checks:
        _train(model, optimizer, loader, 16)
    found = _found(checks)
    assert "sampling/mean" in _fired(found)
    assert found["sampling/mean"].evidence == (
        "sampling: 16 rows in each of 16 steps, the accountant assumes Binomial(10000, 0.125)"
    )


def test_opacus_813_with_poisson_sampling_the_rate_is_the_accounted_one_and_privmon_is_silent():
    """The default (``poisson_sampling=True``) replaces the sampler (opacus #600): each of the
    10,000 records is drawn at q = 1/8, about 1,250 rows a step where the user asked for 16 —
    and the accountant's ε is for that q. The mechanism is the accounted one: no alarm; the
    sampling evidence shows the batches' true size."""
    torch.manual_seed(0)
    net = nn.Linear(10, 3)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=_weighted(10_000, heavy=10_000.0),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    with MechanismChecks(optimizer) as checks:
        _train(model, optimizer, loader, 8)
    found = _found(checks)
    _silent(found)
    said = found["sampling/mean"].evidence
    assert "the accountant assumes Binomial(10000, 0.125) (mean 1250.0" in said
    mean = float(said.split(" rows per step")[0].removeprefix("sampling: "))
    assert 1_150 < mean < 1_350


# -- opacus #834 ---------------------------------------------------------------------------------
def test_opacus_834_len_accountant_is_no_step_count_and_a_resume_built_on_it_fires_steps():
    """``len(accountant)`` is the number of distinct (σ, q) entries of its history, 1 after 30
    steps; privmon counts the history's steps. A resume that rebuilds the accountant from
    ``len()`` (1 step for 30 taken) fires the steps check."""
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(_data(200), batch_size=20),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    with MechanismChecks(optimizer) as checks:
        _train(model, optimizer, loader, 30)
        assert len(engine.accountant) == 1
        assert _found(checks)["steps/count"].evidence == (
            "steps: the accountant counted 30 noised steps, 30 were taken"
        )
        rebuilt = RDPAccountant()
        rebuilt.history = [(SIGMA, 0.1, len(engine.accountant))]  # the resume's "steps so far"
        found = _found(checks, rebuilt)
    assert _fired(found) == ["steps/count"]
    assert found["steps/count"].evidence == (
        "steps: the accountant counted 1 noised steps, 30 were taken"
    )


# -- opacus #820 ---------------------------------------------------------------------------------
class _Adapted(nn.Module):
    """A frozen base layer and a LoRA adapter (B A, B zero at the start)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 3).requires_grad_(False)
        self.lora_a = nn.Linear(6, 2, bias=False)
        self.lora_b = nn.Linear(2, 3, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _adapted(params):
    torch.manual_seed(0)
    net = _Adapted()
    model, optimizer, loader = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(params(net), lr=0.1),
        data_loader=DataLoader(_data(200), batch_size=20),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    return net, model, optimizer, loader


def _adapter_run(outside_first: bool) -> dict:
    """10 steps of the DP optimizer over the adapter, and a second, non-private optimizer (a
    trainer's own) stepping the adapter too: after the private step, or before it, on the
    gradient ``backward`` left in ``.grad`` (the batch's, unclipped and unnoised)."""
    net, model, optimizer, loader = _adapted(lambda n: [n.lora_a.weight, n.lora_b.weight])
    outside = torch.optim.SGD([net.lora_a.weight, net.lora_b.weight], lr=0.1)
    with MechanismChecks(optimizer) as checks:
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if outside_first:
                outside.step()
            optimizer.step()
            if not outside_first:
                outside.step()
            if step == 9:
                break
        return _found(checks)


def test_opacus_820_an_adapter_updated_after_the_private_step_fires_the_ledger():
    found = _adapter_run(outside_first=False)
    assert _fired(found) == ["ledger/weights"]
    assert found["ledger/weights"].evidence == (
        "ledger: the weights were written outside the optimizer's steps before 9 private steps "
        "(first after private step 1); the weights changed after the last private step (step "
        "10): a non-private update"
    )


def test_opacus_820_an_adapter_updated_before_the_private_step_fires_the_ledger():
    """The non-private update the private step then builds on: the private step finds the
    weights written since the one before (from the second private step on)."""
    found = _adapter_run(outside_first=True)
    assert _fired(found) == ["ledger/weights"]
    assert found["ledger/weights"].evidence == (
        "ledger: the weights were written outside the optimizer's steps before 9 private steps "
        "(first after private step 1): a non-private update"
    )


# -- opacus #819 / #571 --------------------------------------------------------------------------
def test_opacus_819_the_normaliser_tells_neighbours_apart_and_privmon_is_silent():
    """600 and 599 records at q = 0.1: Opacus divides by E = int(N q), 60 and 59, so every update
    of one is 60/59 of the other's. The checks pass on both (the accounted mechanism is the one
    that ran: the leak is in it), yet the noise-only coordinates of the canary block show the
    scale, σ C √T / E, to about √(1/m) = 0.45 % with the m = 50,000 excluded of 100,000
    canaries: 599 records' noise-only updates are 60/59 = 1.7 % larger."""
    spreads = {}
    for n in (600, 599):
        torch.manual_seed(0)
        net = nn.Linear(6, 3)
        model, optimizer, loader = PrivacyEngine().make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(_data(n), batch_size=60),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
        )
        assert optimizer.expected_batch_size == n // 10
        with GradientCanaries(optimizer, 100_000, seed=0) as canaries:
            _train(model, optimizer, loader, 20)
        _silent({f"{f.check}/{f.test}": f for f in canaries.mechanism()})
        _, out_scores = canaries.scores()  # excluded canaries: Σ_t noise_t / E
        spreads[n] = float(np.std(out_scores))
        scale = SIGMA * CLIP * np.sqrt(20) / (n // 10)  # σ C √T / E, with E = int(N q)
        assert spreads[n] / scale == pytest.approx(1.0, abs=0.015)
    assert spreads[600] / spreads[599] < 1 - 0.5 / 60  # told apart: 59/60 = 0.983 against 1


# -- synthcity's DP-GAN --------------------------------------------------------------------------
def test_synthcity_dpgan_poisson_sampling_false_fires_the_dispersion_test():
    """synthcity's GAN makes its discriminator private with
    ``make_private_with_epsilon(..., poisson_sampling=False)`` on its own loader (no sampler,
    no shuffle): the same 10 batches of 64 every epoch, accounted as Poisson at q = 0.1 (the
    RDP accountant here: synthcity's default, PRV, calibrates σ in seconds more)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(), nn.Linear(16, 3))
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=2e-4),
        data_loader=DataLoader(_data(640), batch_size=64),
        epochs=3,
        target_epsilon=3.0,
        target_delta=1 / 640,
        max_grad_norm=2.0,
        poisson_sampling=False,
    )
    with MechanismChecks(optimizer) as checks:
        _train(model, optimizer, loader, 30)
    found = _found(checks)
    assert _fired(found) == ["sampling/dispersion"]
    assert found["sampling/dispersion"].evidence == (
        "sampling: 64 rows in each of 30 steps, the accountant assumes Binomial(640, 0.1)"
    )


# -- jax_privacy #288 ----------------------------------------------------------------------------
def test_jax_privacy_288_an_accountant_counting_micro_batches_fires_the_steps_check():
    """Gradient accumulation (Opacus' BatchMemoryManager: each Poisson batch of about 20 rows in
    micro-batches of at most 8, one update per batch): Opacus' own accountant counts the 10
    updates, but an accountant stepped once per micro-batch — the unit of jax_privacy's
    fit()-time budget check — counts more, and the steps check says so when given it."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(_data(200), batch_size=20),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    per_batch = RDPAccountant()
    with MechanismChecks(optimizer) as checks:
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=8, optimizer=optimizer
        ) as micro:
            for x, y in micro:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                per_batch.step(noise_multiplier=SIGMA, sample_rate=0.1)
                if checks.steps == 10:
                    break
        assert _found(checks)["steps/count"].evidence == (
            "steps: the accountant counted 10 noised steps, 10 were taken"
        )
        found = _found(checks, per_batch)
    micro_batches = sum(entry[2] for entry in per_batch.history)
    assert micro_batches > 20
    assert "steps/count" in _fired(found)
    assert found["steps/count"].evidence == (
        f"steps: the accountant counted {micro_batches} noised steps, 10 were taken"
    )
