"""A check leaves training exactly as it found it: the weights after a run with checks equal, bit
for bit, the weights after the same run without them — with gradient queries, under Opacus, with
an audit loader that shares the training loader's generator, and with a training loader that keeps
persistent workers used as the member set."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_unet
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


@pytest.mark.parametrize("between", ["step and zero_grad", "backward and step"])
def test_a_check_under_expanded_weights_runs_its_queries_and_leaves_training_bit_identical(
    between,
):
    """Opacus' ``grad_sample_mode="ew"`` (torch's Expanded Weights) refuses a forward while a
    parameter holds per-sample gradients, which it does from ``backward`` to ``zero_grad``:
    a check there (mnist.py's loop checks after ``step``) hides them from its queries."""
    opacus = pytest.importorskip("opacus")
    x, y = _data(64)

    def run(with_monitor):
        net = _model()
        model, opt, loader = opacus.PrivacyEngine().make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="ew",
        )
        mon = privmon.PrivacyMonitor(
            LossQuery(model), [(x[:32], y[:32])], [(x[32:], y[32:])], every_n_steps=1,
            methods=("histogram",), strict=True,
        )  # fmt: skip
        torch.manual_seed(7)  # Opacus draws its noise from the global torch RNG
        seen = []
        for step, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            samples = [p.grad_sample for p in net.parameters()]
            if with_monitor and between == "backward and step":
                mon.step(step)
                after = [p.grad_sample for p in net.parameters()]
                seen.append(all(a is b for a, b in zip(samples, after, strict=True)))
            opt.step()
            if with_monitor and between == "step and zero_grad":
                mon.step(step)
        return _weights(net), mon, seen

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG notice
        plain, _, _ = run(False)
        watched, mon, seen = run(True)
    assert mon.n_failed == 0 and len(mon.history) == 4
    assert all(not report.failures for report in mon.history)
    assert all(0 <= report.scalars["privacy/loss/auc"] <= 1 for report in mon.history)
    assert all(seen)  # the step's per-sample gradients are back, the same tensors
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


# --- what a query may change, and what the check does about it ------------------------------------


def _bn_model():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _audit_sets(x, y):
    return [(x[:60], y[:60])], [(x[60:], y[60:])]


def test_a_query_calling_train_leaves_batchnorm_statistics_and_the_other_queries_untouched():
    x, y = _data()
    model = _bn_model()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def train_mode_loss(batch):  # a query that switches the model to training mode
        model.train()
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    mon = privmon.PrivacyMonitor(
        [CallableQuery(train_mode_loss, name="rogue", modules=model), LossQuery(model)],
        *_audit_sets(x, y),
        methods=("histogram",),
        strict=True,
    )
    report = mon.check(1)
    for k, v in model.state_dict().items():  # running mean / var, num_batches_tracked
        assert torch.equal(v, before[k]), k
    assert all(m.training for m in model.modules())
    # the LossQuery after it saw the model in eval mode with the statistics of before
    clean = privmon.PrivacyMonitor(
        LossQuery(model), *_audit_sets(x, y), methods=("histogram",), strict=True
    ).check(1)
    for tag in ("auc", "histogram/plugin", "tpr@fpr=0.1"):
        assert report.scalars[f"privacy/loss/{tag}"] == clean.scalars[f"privacy/loss/{tag}"]


def test_a_query_writing_the_weights_is_refused_by_name_and_the_others_kept(caplog):
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def stepping(batch):  # a query that trains: backward and an optimizer step
        with torch.enable_grad():
            loss = F.cross_entropy(model(batch[0]), batch[1], reduction="none")
            loss.mean().backward()
        opt.step()
        return loss.detach()

    mon = privmon.PrivacyMonitor(
        [CallableQuery(stepping, name="stepping", modules=model), LossQuery(model)],
        *_audit_sets(x, y),
        methods=("histogram",),
    )
    with caplog.at_level("ERROR", logger="privmon"):
        report = mon.check(1)
    assert report is not None and "privacy/loss/histogram/value" in report.scalars
    assert "wrote to parameters" in report.failures["stepping"]
    assert "0.weight" in report.failures["stepping"]  # the parameter, by name
    assert not any(t.startswith("privacy/stepping/") for t in report.scalars)
    assert "stepping" in caplog.text
    strict = privmon.PrivacyMonitor(
        CallableQuery(stepping, name="stepping", modules=model), *_audit_sets(x, y), strict=True
    )
    with pytest.raises(RuntimeError, match="query 'stepping' wrote to parameters"):
        strict.check(1)


def test_default_dtype_grad_mode_and_requires_grad_are_restored():
    x, y = _data()
    model = _model()
    model[0].bias.requires_grad_(False)  # frozen by the training, thawed by the query

    seen = []

    def careless(batch):
        seen.append(
            (
                torch.get_default_dtype(),
                torch.is_grad_enabled(),
                [p.requires_grad for p in model.parameters()],
            )
        )
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(True)
        for p in model.parameters():
            p.requires_grad_(not p.requires_grad)
        return batch[0][:, 0].double()

    mon = privmon.PrivacyMonitor(
        CallableQuery(careless, name="careless", modules=model),
        *_audit_sets(x, y),
        methods=("histogram",),
        strict=True,
    )
    with torch.no_grad():
        mon.check(1)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    mon.check(2)
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert [p.requires_grad for p in model.parameters()] == [True, False, True, True]
    # every call, the second batch's included, starts from the state the check found
    assert seen == [(torch.float32, False, [True, False, True, True])] * 4


def test_grads_are_cleared_before_each_query_and_restored_after():
    x, y = _data()
    model = _model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # the training step's gradients, not yet applied
    kept = [p.grad for p in model.parameters()]
    seen = []

    def accumulating(batch):  # backward without zero_grad: it reads whatever .grad holds
        with torch.enable_grad():
            F.cross_entropy(model(batch[0]), batch[1]).backward()
        seen.append(model[0].bias.grad.clone())
        return batch[0][:, 0]

    mon = privmon.PrivacyMonitor(
        CallableQuery(accumulating, name="acc", modules=model),
        *_audit_sets(x, y),
        methods=("histogram",),
        strict=True,
    )
    mon.check(1)
    model.eval()  # as in the check: dropout off
    for (xb, yb), grad in zip(((x[:60], y[:60]), (x[60:], y[60:])), seen, strict=True):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        assert torch.equal(grad, model[0].bias.grad)  # this batch's gradient alone
    model.train()
    for p, grad in zip(model.parameters(), kept, strict=True):
        p.grad = grad  # what the test's own backward replaced
    mon.check(2)
    assert all(p.grad is g for p, g in zip(model.parameters(), kept, strict=True))
    assert all(bool((g == 7.0).all()) for g in kept)


@pytest.mark.parametrize("enabled", [True, False])
def test_opacus_hooks_are_left_as_found(enabled):
    opacus = pytest.importorskip("opacus")
    x, y = _data()
    model = opacus.GradSampleModule(_model())
    if not enabled:
        model.disable_hooks()
    seen = []

    def query(batch):
        seen.append(model.hooks_enabled)
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    mon = privmon.PrivacyMonitor(
        CallableQuery(query, name="q", modules=model),
        *_audit_sets(x, y),
        methods=("histogram",),
        strict=True,
    )
    mon.check(1)
    assert seen == [False, False]  # disabled inside the check
    assert model.hooks_enabled is enabled


def test_numpy_and_python_rngs_are_restored():
    import random

    import numpy as np

    x, y = _data()

    def drawing(batch):
        np.random.rand(5)  # noqa: NPY002
        random.random()
        return batch[0][:, 0] + torch.rand(len(batch[0]))

    mon = privmon.PrivacyMonitor(
        CallableQuery(drawing, name="q"), *_audit_sets(x, y), methods=("histogram",), strict=True
    )
    np.random.seed(4)  # noqa: NPY002
    random.seed(4)
    torch.manual_seed(4)
    want = (np.random.rand(), random.random(), torch.rand(1))  # noqa: NPY002
    np.random.seed(4)  # noqa: NPY002
    random.seed(4)
    torch.manual_seed(4)
    mon.check(1)
    assert np.random.rand() == want[0] and random.random() == want[1]  # noqa: NPY002
    assert torch.equal(torch.rand(1), want[2])


def test_a_check_running_while_another_is_in_progress_is_refused():
    # thread A's check is inside its queries when thread B calls check(): B must not save A's
    # eval mode and cleared gradients as "the training state" and put them back after A
    import threading

    x, y = _data()
    model = _model()
    model.train()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    grads = [p.grad for p in model.parameters()]
    a_inside, b_went, a_done = threading.Event(), threading.Event(), threading.Event()

    def query(batch):
        if threading.current_thread().name == "A":
            a_inside.set()
            assert b_went.wait(30)
        else:  # B's check got as far as its queries: hold it there until A has finished
            b_went.set()
            assert a_done.wait(30)
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    mon = privmon.PrivacyMonitor(
        CallableQuery(query, name="q", modules=model), *_audit_sets(x, y), methods=("histogram",)
    )
    results = {}

    def run_a():
        results["A"] = mon.check(1)
        a_done.set()

    def run_b():
        assert a_inside.wait(30)
        results["B"] = mon.check(2)
        b_went.set()

    threads = [threading.Thread(target=run_a, name="A"), threading.Thread(target=run_b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["A"] is not None and results["B"] is None  # B was refused, A measured
    assert mon.n_failed == 1 and [r.step for r in mon.history] == [1]
    assert all(m.training for m in model.modules())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))


def test_a_query_converting_the_model_or_replacing_a_weight_is_put_back_and_refused():
    x, y = _data()
    model = _bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[0].weight

    def converting(batch):  # .double() gives every parameter and buffer new storage
        model.double()
        return F.cross_entropy(model(batch[0].double()), batch[1], reduction="none")

    def replacing(batch):
        model[3].weight = nn.Parameter(torch.zeros_like(model[3].weight))
        return batch[0][:, 0]

    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    observed = []

    def observing(batch):  # what the next query sees: the training's tensors, as they were
        now = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        observed.append(all(now[k] is t and t.dtype == before[k].dtype for k, t in tensors.items()))
        return batch[0][:, 0]

    mon = privmon.PrivacyMonitor(
        [
            CallableQuery(converting, name="converting", modules=model),
            CallableQuery(observing, name="observing", modules=model),
            CallableQuery(replacing, name="replacing", modules=model),
            LossQuery(model),
        ],
        *_audit_sets(x, y),
        methods=("histogram",),
    )
    report = mon.check(1)
    assert observed == [True, True]
    assert model[0].weight is weight and weight.dtype == torch.float32
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    assert report.failures["converting"].startswith(
        "RuntimeError: query 'converting' wrote to parameters (0.weight, 0.bias, 1.weight, "
        "1.bias, 3.weight and 1 more): its scores are of other weights than training's"
    )
    assert "wrote to parameters (3.weight)" in report.failures["replacing"]
    assert "privacy/loss/histogram/value" in report.scalars  # measured on the training weights
    # five parameters, one of them an absent bias, and two models: each named, none left out
    first, second = nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1, bias=False))

    def converting_both(batch):
        first.double()
        second.double()
        return batch[0][:, 0]

    fine = CallableQuery(lambda b: b[0][:, 0], name="fine")  # so that the check has a report
    both = privmon.PrivacyMonitor(
        [CallableQuery(converting_both, name="both", modules=[first, second]), fine],
        *_audit_sets(x, y),
        methods=("histogram",),
    )
    assert (
        "wrote to parameters (Linear#0.weight, Linear#0.bias, Sequential#1.0.weight, "
        "Sequential#1.0.bias, Sequential#1.1.weight):" in both.check(1).failures["both"]
    )
    alone = privmon.PrivacyMonitor(
        [CallableQuery(converting_both, name="first", modules=first), fine],
        *_audit_sets(x, y),
        methods=("histogram",),
    )
    assert "wrote to parameters (weight, bias):" in alone.check(1).failures["first"]


def test_buffers_written_out_of_sight_or_resized_are_put_back_and_untouched_ones_not_written():
    x, y = _data()
    model = _bn_model()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    versions = {k: v._version for k, v in model.named_buffers()}
    mon = privmon.PrivacyMonitor(
        LossQuery(model), *_audit_sets(x, y), methods=("histogram",), strict=True
    )
    mon.check(1)  # a check that changes nothing writes nothing (autograd checks versions)
    assert {k: v._version for k, v in model.named_buffers()} == versions

    def sneaky(batch):  # through .data: no version bump, no mode change
        model[1].running_mean.data.add_(1.0)
        model[1].running_var.resize_(3)
        return batch[0][:, 0]

    mon = privmon.PrivacyMonitor(
        CallableQuery(sneaky, name="sneaky", modules=model), *_audit_sets(x, y), strict=True
    )
    mon.check(1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_prepare_runs_in_the_check_state_and_a_failing_eval_leaves_training_untouched():
    x, y = _data()
    model = _model()
    model.train()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    seen = []

    class Preparing(CallableQuery):
        def prepare(self, device=None):
            seen.append((model.training, torch.is_grad_enabled(), model[0].weight.grad))

    privmon.PrivacyMonitor(
        Preparing(lambda b: b[0][:, 0], name="q", modules=model), *_audit_sets(x, y), strict=True
    ).check(1)
    assert seen == [(False, False, None)]

    class Stubborn(nn.Module):  # refuses to leave training mode
        def train(self, mode=True):
            if not mode:
                raise RuntimeError("stays in training mode")
            return super().train(mode)

    stubborn = nn.Sequential(model, Stubborn())
    grads = [p.grad for p in model.parameters()]
    mon = privmon.PrivacyMonitor(
        CallableQuery(lambda b: b[0][:, 0], name="q", modules=[stubborn]), *_audit_sets(x, y)
    )
    assert mon.check(1) is None and mon.n_failed == 1
    assert all(m.training for m in stubborn.modules())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert torch.is_grad_enabled()


def test_the_guard_alone_restores_what_its_block_changed_even_when_it_raises():
    from privmon._training_guard import TrainingGuard
    from privmon.audit.opacus_per_sample import PerSampleState

    model = _bn_model()
    weight, before = model[0].weight, model[0].weight.detach().clone()
    guard = TrainingGuard([model], [], per_sample=PerSampleState([model]))
    with pytest.raises(RuntimeError, match="inside"), guard:
        model[0].weight = nn.Parameter(torch.zeros(8, 5))
        torch.set_default_dtype(torch.float64)
        raise RuntimeError("inside")
    assert model[0].weight is weight and torch.equal(weight, before)
    assert torch.get_default_dtype() == torch.float32


def test_only_opacus_modules_have_their_hooks_switched():
    x, y = _data()

    class LooksLikeOpacus(nn.Linear):  # a hooks_enabled flag, but no disable_hooks()
        hooks_enabled = True

    model = LooksLikeOpacus(5, 2)
    mon = privmon.PrivacyMonitor(
        CallableQuery(lambda b: model(b[0])[:, 0], name="q", modules=model),
        *_audit_sets(x, y),
        strict=True,
    )
    assert mon.check(1) is not None and model.hooks_enabled is True


def test_a_persistent_audit_loader_is_iterated_through_a_twin_of_each_kind():
    from torch.utils.data import IterableDataset

    from privmon._training_guard import audit_view

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(6.0))

    data = TensorDataset(torch.arange(6.0))
    loaders = [
        DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True),
        DataLoader(data, batch_size=None, num_workers=1, persistent_workers=True),
        DataLoader(Stream(), batch_size=4, num_workers=1, persistent_workers=True),
    ]
    for loader in loaders:
        twin = audit_view(loader)
        assert twin is not loader and twin.persistent_workers is False
        got = [b[0] if isinstance(b, (list, tuple)) else b for b in twin]
        want = [b[0] if isinstance(b, (list, tuple)) else b for b in loader]
        assert len(got) == len(want) > 0
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    plain = DataLoader(data, batch_size=4)
    assert audit_view(plain) is plain


def test_the_shuffling_warning_points_at_the_callers_line():
    data = TensorDataset(torch.randn(20))
    with pytest.warns(UserWarning, match="shuffling DataLoader") as record:
        privmon.PrivacyMonitor(
            CallableQuery(lambda b: b[0], name="s"),
            DataLoader(data, batch_size=5, shuffle=True),
            [torch.zeros(5)],
        )
    assert record[0].filename == __file__


def test_modules_with_absent_buffers_are_guarded():
    """BatchNorm without running statistics registers its buffers as None: the guard passes
    them by, and the query still counts."""
    x, y = _data()
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(), nn.Linear(8, 2)
    )
    assert model[1].running_mean is None
    mon = privmon.PrivacyMonitor(
        CallableQuery(
            lambda b: F.cross_entropy(model(b[0]), b[1], reduction="none"), name="q", modules=model
        ),
        *_audit_sets(x, y),
        strict=True,
    )
    report = mon.check(1)
    assert report is not None and mon.n_failed == 0 and not report.failures
    assert model[1].running_mean is None


def test_a_lazy_module_not_yet_run_among_a_querys_modules_is_guarded():
    # its parameters have no data yet: reading them failed every check
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(120, 5, generator=g), torch.randint(0, 2, (120,), generator=g)
    model = nn.Sequential(nn.Linear(5, 2))
    head = nn.LazyLinear(3)
    query = CallableQuery(
        lambda b: F.cross_entropy(model(b[0]), b[1], reduction="none"),
        name="q",
        modules=[model, head],
    )
    mon = privmon.PrivacyMonitor(query, [(x[:60], y[:60])], [(x[60:], y[60:])], strict=True)
    report = mon.check(1)
    assert report.failures == {} and "privacy/q/auc" in report.scalars
    assert isinstance(head.weight, torch.nn.parameter.UninitializedParameter)


def _diffusion_run(monitor_queries):
    """A diffusers training loop (UNet2DModel, DDPMScheduler.add_noise, noise and timesteps from
    the global RNG, dropout on, an EMA of the weights), checked every step when queries are given:
    the weights, the EMA weights and the global RNG state at the end."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.training_utils import EMAModel

    from privmon.queries import DiffusionQuery

    torch.manual_seed(0)
    unet = tiny_unet(dropout=0.1)
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=100)
    ema = EMAModel(unet.parameters(), decay=0.9)
    images = torch.rand(24, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
    loader = DataLoader(TensorDataset(images), batch_size=8, shuffle=True)
    opt = torch.optim.Adam(unet.parameters(), lr=1e-3)
    mon = None
    if monitor_queries:
        queries = [
            DiffusionQuery(unet, scheduler, s, timesteps=t, interval=5)
            for s, t in (("loss", [10, 50]), ("pia", 20), ("secmi", 10), ("sima", 30))
        ]
        mon = privmon.PrivacyMonitor(
            queries, [images[:12]], [images[12:]], every_n_steps=1, strict=True
        )
    torch.manual_seed(5)
    step = 0
    for _ in range(2):
        for (x0,) in loader:
            noise = torch.randn_like(x0)
            t = torch.randint(0, scheduler.config.num_train_timesteps, (len(x0),))
            loss = F.mse_loss(unet(scheduler.add_noise(x0, noise, t), t).sample, noise)
            opt.zero_grad()
            loss.backward()
            if mon is not None:
                mon.step(step)
            opt.step()
            ema.step(unet.parameters())
            step += 1
    if mon is not None:
        assert len(mon.history) == step and unet.training
    return _weights(unet), [p.clone() for p in ema.shadow_params], torch.get_rng_state()


def test_a_diffusion_training_loop_is_bit_identical_with_diffusion_queries():
    plain, plain_ema, plain_rng = _diffusion_run(False)
    checked, checked_ema, checked_rng = _diffusion_run(True)
    for a, b in zip(plain + plain_ema, checked + checked_ema, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain_rng, checked_rng)
