"""The measured advantage against the ceiling a real Opacus DP budget allows."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from sklearn.datasets import load_breast_cancer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privmon
from privmon.callbacks import PrivacyMonitor, PrivacyViolationWarning
from privmon.queries import LossQuery


def _cancer(seed=0):
    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return x[order], y[order]


def _batches(x, y, size=100):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def test_dp_sgd_at_epsilon_one_stays_below_its_ceiling():
    torch.manual_seed(0)
    x, y = _cancer()
    members, nonmembers = (x[:250], y[:250]), (x[250:500], y[250:500])
    model = nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(*members), batch_size=50)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=opt,
        data_loader=loader,
        target_epsilon=1.0,
        target_delta=1e-5,
        epochs=10,
        max_grad_norm=1.0,
    )
    mon = PrivacyMonitor(
        LossQuery(model),
        _batches(*members),
        _batches(*nonmembers),
        every_n_steps=10,
        accountant=engine,
        delta=1e-5,
        strict=True,
    )
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyViolationWarning)
        for _ in range(10):
            for xb, yb in loader:
                if len(xb) == 0:
                    continue
                step += 1
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                mon.step(step)
    final = mon.check(step)
    assert final.epsilon == pytest.approx(engine.get_epsilon(1e-5))
    assert 0.5 < final.epsilon <= 1.05
    assert final.scalars["privacy/ceiling/tanh"] == pytest.approx(privmon.tanh_bound(final.epsilon))
    assert final.scalars["privacy/ceiling/eps_delta"] == pytest.approx(
        privmon.tanh_bound(final.epsilon, delta=1e-5)
    )
    for rep in mon.history:
        assert not rep.dp_violation
        for method in ("histogram", "kde"):
            assert (
                rep.scalars[f"privacy/loss/{method}/lower"]
                <= rep.scalars["privacy/ceiling/eps_delta"]
            )


def test_broken_dp_accounting_trips_the_violation_flag():
    """Noise far below what the accountant is told: an overfit model, an accountant that
    believes noise_multiplier=8 was used. The certified leak exceeds the claimed ceiling."""
    torch.manual_seed(0)
    x, _ = _cancer()
    y = torch.randint(0, 2, (len(x),), generator=torch.Generator().manual_seed(1))  # random labels
    members, nonmembers = (x[:200], y[:200]), (x[200:400], y[200:400])
    model = nn.Sequential(nn.Linear(30, 256), nn.ReLU(), nn.Linear(256, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    accountant = RDPAccountant()
    for _ in range(300):  # memorise the random labels, no noise at all
        opt.zero_grad()
        F.cross_entropy(model(members[0]), members[1]).backward()
        opt.step()
    for _ in range(300):  # ... while the accountant is told a lot of noise was added
        accountant.step(noise_multiplier=8.0, sample_rate=0.05)
    mon = PrivacyMonitor(
        LossQuery(model),
        _batches(*members),
        _batches(*nonmembers),
        accountant=accountant,
        delta=1e-5,
        strict=True,
    )
    with pytest.warns(PrivacyViolationWarning, match="exchangeable"):
        rep = mon.check(300)
    eps = accountant.get_epsilon(1e-5)
    assert rep.epsilon == pytest.approx(eps) and eps < 0.5
    assert rep.dp_violation and rep.scalars["privacy/dp_violation"] == 1.0
    assert rep.scalars["privacy/loss/histogram/lower"] > privmon.tanh_bound(eps, delta=1e-5)
    assert any("certified lower bound" in m for m in rep.messages)
    # the implied epsilon lower bound contradicts the claimed epsilon
    assert rep.scalars["privacy/loss/histogram/epsilon_lower_bound"] > eps
