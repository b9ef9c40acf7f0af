"""A check leaves training exactly as it found it: the weights after a run with checks equal, bit
for bit, the weights after the same run without them — with gradient queries, under Opacus, with
an audit loader that shares the training loader's generator, and with a training loader that keeps
persistent workers used as the member set."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privmon
from privmon.queries import CallableQuery, LossQuery

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(n=120):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 2, (n,), generator=g)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _gradient_norm(model):
    """A gradient query: each record's loss-gradient norm, computed with ``backward()``."""

    def query(batch):
        x, y = batch
        norms = []
        with torch.enable_grad():
            for i in range(len(x)):
                model.zero_grad()
                F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
                norms.append(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))
        return torch.stack(norms)

    return query


def _train(model, loader, monitor=None, *, epochs=2, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if monitor is not None:  # between backward and step: .grad must survive the check
                monitor.step(step)
            opt.step()
            step += 1
    return step


def test_a_gradient_query_leaves_grads_and_weights_untouched():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=30)
    plain = _model()
    torch.manual_seed(5)
    _train(plain, loader)
    model = _model()
    query = CallableQuery(_gradient_norm(model), name="gradnorm", modules=model)
    mon = privmon.PrivacyMonitor(
        query, [(x[:60], y[:60])], [(x[60:], y[60:])], every_n_steps=1, strict=True
    )
    torch.manual_seed(5)
    steps = _train(model, loader, mon)
    assert len(mon.history) == steps  # every check ran, in the middle of every step
    for a, b in zip(_weights(plain), _weights(model), strict=True):
        assert torch.equal(a, b)
    assert mon.last_report.scalars["privacy/gradnorm/histogram/value"] >= 0


def test_opacus_training_survives_gradient_queries():
    opacus = pytest.importorskip("opacus")
    x, y = _data(64)

    def private(model):
        loader = DataLoader(TensorDataset(x, y), batch_size=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return opacus.PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )

    def run(with_monitor):
        model, opt, loader = private(_model())
        mon = None
        if with_monitor:
            # torch.autograd.grad through the GradSampleModule (the reported crash), and a
            # backward() through the model it wraps (Opacus' hooks sit on its submodules)
            def autograd_norm(batch):
                xb, yb = batch
                with torch.enable_grad():
                    loss = F.cross_entropy(model(xb), yb)
                    grads = torch.autograd.grad(loss, list(model.parameters()))
                return torch.full((len(xb),), float(sum((g**2).sum() for g in grads)))

            queries = [
                CallableQuery(autograd_norm, name="autograd", modules=model),
                CallableQuery(_gradient_norm(model._module), name="backward"),
            ]
            mon = privmon.PrivacyMonitor(
                queries,
                [(x[:32], y[:32])],
                [(x[32:], y[32:])],
                every_n_steps=1,
                methods=("histogram",),
                strict=True,
            )
        torch.manual_seed(7)  # Opacus draws its noise from the global torch RNG
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus' secure-RNG notice
            _train(model, loader, mon, opt=opt)
        return _weights(model), mon

    plain, _ = run(False)
    watched, mon = run(True)
    assert mon.n_failed == 0 and len(mon.history) == 8
    for a, b in zip(plain, watched, strict=True):
        assert torch.equal(a, b)


def test_an_audit_loader_sharing_the_training_generator_does_not_advance_it():
    x, y = _data()
    data = TensorDataset(x, y)

    def run(with_monitor):
        g = torch.Generator().manual_seed(11)
        train = DataLoader(data, batch_size=30, shuffle=True, generator=g)
        model, mon = _model(), None
        if with_monitor:
            members = DataLoader(TensorDataset(x[:60], y[:60]), batch_size=20, shuffle=True)
            members.sampler.generator = g  # one generator for both, as users share a seed
            with pytest.warns(UserWarning, match="shuffling DataLoader"):
                mon = privmon.PrivacyMonitor(
                    LossQuery(model),
                    members,
                    DataLoader(TensorDataset(x[60:], y[60:]), batch_size=20),
                    every_n_steps=2,
                    strict=True,
                )
        torch.manual_seed(5)
        _train(model, train, mon)
        return _weights(model)

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_a_persistent_worker_training_loader_as_member_set_keeps_its_epoch():
    x, y = _data()
    train = DataLoader(TensorDataset(x, y), batch_size=40, num_workers=1, persistent_workers=True)
    model = _model()
    mon = privmon.PrivacyMonitor(
        LossQuery(model), train, [(x[:40], y[:40])], every_n_steps=1, strict=True
    )
    seen = []
    for step, (xb, _) in enumerate(train):  # the check runs in the middle of the epoch
        seen.append(len(xb))
        mon.step(step)
    assert seen == [40, 40, 40]  # the epoch saw all 120 records, not 40
    assert len(mon.history) == 3
    assert mon.last_report.queries["loss"].member_risk.shape == (120,)
