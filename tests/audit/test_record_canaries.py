"""Record canaries on real Opacus DP-SGD runs (hooks mode): the per-sample gradients of a record,
an included canary and a filler as claimed (loss_reduction "mean" and "sum", through the DP
loader's collate), the clipped contribution of a canary exactly C, Poisson empty batches; the
audit separates with the noise removed and stays under the accountant with it; faults the
gradient canaries cannot see (clipping skipped, a record stacked as several rows) raise the
audited ε above the accountant's; the wrapper is the model on a plain input; the monitor reports
the canaries' figures; inclusion bits, state_dict and the refusals."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon._digest import sealed
from privmon.audit import RecordCanaries, one_run_epsilon
from privmon.audit.record_canaries import GRADIENT_NORM, RecordCanaryModel

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"),
]

N, D, K, CLIP, LR, DELTA = 100, 5, 3, 1.0, 0.5, 1e-5


def _data(seed: int = 0, n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, K))


def _private(canaries, *, sigma=1.0, seed=0, batch_size=110, reduction="mean", **options):
    """An MLP and the canaries' slots made private by Opacus: (engine, model, optimizer,
    loader, bare model)."""
    torch.manual_seed(seed)
    net = _mlp()
    model = canaries.model(net)
    engine = PrivacyEngine()
    loader = DataLoader(
        canaries.dataset(_data(seed)),
        batch_size=batch_size,
        generator=torch.Generator().manual_seed(seed),
    )
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=CLIP,
        loss_reduction=reduction,
        **options,
    )
    return engine, model, optimizer, loader, net


def _train(model, optimizer, loader, steps, *, rows=None, reduction="mean"):
    done = 0
    while done < steps:
        for inputs, y in loader:
            if rows is not None:
                inputs, y = rows(inputs, y)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), y, reduction=reduction).backward()
            optimizer.step()
            done += 1
            if done == steps:
                return


def _without_noise(optimizer) -> None:
    """The silent bug of benchmarks/dp_faults.py: add_noise runs at σ = 0, the accountant's hook
    reads σ as told."""
    original = optimizer.add_noise

    def add_noise():
        sigma = optimizer.noise_multiplier
        optimizer.noise_multiplier = 0.0
        try:
            original()
        finally:
            optimizer.noise_multiplier = sigma

    optimizer.add_noise = add_noise


def _audited(canaries) -> dict[str, float]:
    return {
        m: one_run_epsilon(*canaries.scores(), delta=DELTA, method=m).epsilon
        for m in ("fdp", "steinke")
    }


# -- the per-sample gradients ----------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_sample_gradients_of_records_canaries_and_fillers(reduction):
    canaries = RecordCanaries(10, seed=0)
    _, model, optimizer, loader, net = _private(canaries, sigma=0.0, reduction=reduction)
    included = canaries.included
    inc, exc = int(np.flatnonzero(included)[0]), int(np.flatnonzero(~included)[0])
    train = loader.dataset
    rows = [0, N + inc, 1, N + exc, 2]  # record, canary, record, filler, record
    (x, slots), y = loader.collate_fn([train[i] for i in rows])  # the DP loader's collate
    assert slots.tolist() == [-1, inc, -1, exc, -1] and slots.dtype == torch.int64
    nn.functional.cross_entropy(model((x, slots)), y, reduction=reduction).backward()
    wrapper = model._module
    block = wrapper.block.weight
    records, canary, filler = [0, 2, 4], 1, 3
    for p in net.parameters():
        samples = p.grad_sample.reshape(len(rows), -1)
        assert torch.equal(samples[canary], torch.zeros_like(samples[canary]))
        assert torch.equal(samples[filler], torch.zeros_like(samples[filler]))
        assert bool((samples[records].norm(dim=1) > 0).all())
    samples = block.grad_sample.reshape(len(rows), -1)
    scale = len(rows) if reduction == "mean" else 1  # Opacus scales "mean" backprops by B
    expected = torch.zeros(10)
    expected[inc] = GRADIENT_NORM * scale
    assert torch.equal(samples[canary], expected)
    assert float(samples[canary].norm()) >= 1e6 * CLIP
    assert torch.equal(samples[filler], torch.zeros(10))
    assert torch.equal(samples[records], torch.zeros(3, 10))
    # the optimizer's own clipping bounds the canary to exactly C; the records are untouched by it
    optimizer.clip_and_accumulate()
    summed = block.summed_grad.reshape(-1)
    assert float(summed[inc]) == pytest.approx(CLIP, rel=1e-6, abs=0)
    assert torch.equal(torch.cat([summed[:inc], summed[inc + 1 :]]), torch.zeros(9))
    last = net[2].weight
    norms = torch.stack(
        [p.grad_sample.reshape(len(rows), -1).norm(dim=1) for p in net.parameters()], dim=1
    ).norm(dim=1)
    factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    torch.testing.assert_close(
        last.summed_grad, torch.einsum("i,i...", factors[records], last.grad_sample[records])
    )


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_sampled_canary_moves_its_coordinate_by_exactly_lr_c(mode, reduction):
    """One full-batch step without noise, in each grad-sample mode that can carry the canaries
    (ghost clipping clips by reweighting each row's loss in a second backward: the canaries follow
    it): an included canary's coordinate moves by lr · C (/ E under "mean"), the rest stay."""
    canaries = RecordCanaries(20, seed=0)
    torch.manual_seed(0)
    net = _mlp()
    model = canaries.model(net)
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    out = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(canaries.dataset(_data(0)), batch_size=N + 20),  # q = 1
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        loss_reduction=reduction,
        grad_sample_mode=mode,
        **({"criterion": criterion} if mode == "ghost" else {}),
    )
    model, optimizer, loader = (out[0], out[1], out[3]) if mode == "ghost" else out
    if mode == "ghost":
        criterion = out[2]
    before = [p.detach().clone() for p in net.parameters()]
    (x, slots), y = next(iter(loader))
    optimizer.zero_grad()
    criterion(model((x, slots)), y).backward()
    optimizer.step()
    ins, outs = canaries.scores()
    scale = optimizer.expected_batch_size if reduction == "mean" else 1
    sampled = np.isin(np.flatnonzero(canaries.included), slots.numpy())
    np.testing.assert_allclose(ins, LR * CLIP * sampled / scale, rtol=1e-6, atol=0)
    assert np.all(outs == 0.0)
    assert all(not torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))


class _Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, 1)

    def forward(self, x):
        return self.linear(x)[:, 0]  # one output per row, 1-d


@pytest.mark.parametrize("target", [None, 1.0])
def test_ghost_clipping_needs_a_loss_gradient_at_the_slot_rows_output(target):
    """Squared error against the default target (0) has no gradient at the slot rows' zero
    output: ghost clipping's second pass cannot clip such a canary, which then contributes
    nothing (a warning says so; never a false alarm); a template target of 1 gives it one."""
    canaries = RecordCanaries(20, seed=0)
    torch.manual_seed(0)
    records = TensorDataset(torch.randn(N, D), torch.randn(N))
    template = None if target is None else (torch.zeros(D), torch.tensor(target))
    model = canaries.model(_Regression())
    model, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(canaries.dataset(records, template=template), batch_size=N + 20),
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        loss_reduction="sum",
        grad_sample_mode="ghost",
        criterion=nn.MSELoss(reduction="sum"),
    )
    (x, slots), y = next(iter(loader))
    optimizer.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        criterion(model((x, slots)), y).backward()
    optimizer.step()
    silent = [w for w in caught if "cannot tell its clip factor" in str(w.message)]
    ins, outs = canaries.scores()
    sampled = np.isin(np.flatnonzero(canaries.included), slots.numpy())
    np.testing.assert_allclose(ins, LR * CLIP * sampled * (target is not None), rtol=1e-6)
    assert np.all(outs == 0.0) and len(silent) == (target is None)


def test_poisson_empty_batches_pass_through_the_wrapper():
    canaries = RecordCanaries(10, seed=0)
    # 20 records + 10 slots at q = 1/30: about a third of the batches are empty
    torch.manual_seed(0)
    model = canaries.model(_mlp())
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(
            canaries.dataset(_data(0, 20)),
            batch_size=1,
            generator=torch.Generator().manual_seed(3),  # a first batch that is not empty
        ),
        noise_multiplier=1.0,
        max_grad_norm=CLIP,
    )
    sizes = []
    for _ in range(3):
        for (x, slots), y in loader:
            sizes.append(len(slots))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model((x, slots)), y).backward()
            optimizer.step()
    assert sizes[0] > 0 and sizes.count(0) >= 10 and len(sizes) == 90
    assert np.isfinite(np.concatenate(canaries.scores())).all()
    assert engine.accountant.history[-1][2] == 90  # every step counted, empty ones included


# -- the audit -------------------------------------------------------------------------------------
def test_without_noise_the_scores_separate_and_the_audit_exceeds_the_accountant():
    canaries = RecordCanaries(1000, seed=0)
    engine, model, optimizer, loader, _ = _private(canaries, sigma=2.0)
    _without_noise(optimizer)
    _train(model, optimizer, loader, 40)
    ins, outs = canaries.scores()
    assert np.all(outs == 0.0)  # fillers: zero gradient, no noise
    assert np.mean(ins > 0) > 0.95  # each included canary sampled ~4 times in 40 steps (q = 0.1)
    # each sampled step moves its coordinate by lr · C / E exactly
    steps = ins / (LR * CLIP / optimizer.expected_batch_size)
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    eps = engine.get_epsilon(DELTA)
    audited = _audited(canaries)
    assert min(audited.values()) > eps, (audited, eps)


def test_with_the_noise_the_audit_stays_under_the_accountant():
    for seed in range(3):
        canaries = RecordCanaries(1000, seed=seed)
        engine, model, optimizer, loader, _ = _private(canaries, sigma=1.0, seed=seed)
        _train(model, optimizer, loader, 40)
        eps = engine.get_epsilon(DELTA)
        audited = _audited(canaries)
        assert max(audited.values()) < eps, (seed, audited, eps)
        ins, outs = canaries.scores()
        assert ins.mean() > outs.mean()  # the canaries are seen, within the noise


class _Unclipped(DPOptimizer):
    """benchmarks/dp_faults.py's clipping skipped: per-sample gradients summed unclipped."""

    def clip_and_accumulate(self) -> None:
        for p in self.params:
            grad = self._get_flat_grad_sample(p).to(p.dtype).sum(0)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad


def _four_rows(inputs, y):
    """benchmarks/dp_faults.py's augmentation stacked as rows: each sampled record 4 times."""
    (x, slots) = inputs
    return (torch.cat([x] * 4), torch.cat([slots] * 4)), torch.cat([y] * 4)


@pytest.mark.parametrize("fault", ["clipping skipped", "four rows per record"])
def test_faults_past_the_clipping_raise_the_audited_epsilon_above_the_accountants(fault):
    canaries = RecordCanaries(1000, seed=0)
    engine, model, optimizer, loader, _ = _private(canaries, sigma=2.0)
    rows = None
    if fault == "clipping skipped":
        optimizer.__class__ = _Unclipped
    else:
        rows = _four_rows
    _train(model, optimizer, loader, 80, rows=rows)
    eps = engine.get_epsilon(DELTA)
    audited = _audited(canaries)
    assert audited["fdp"] > eps, (audited, eps)


# -- the wrapper ---------------------------------------------------------------------------------
def test_the_wrapper_on_a_plain_input_is_the_model_bit_for_bit():
    canaries = RecordCanaries(50, seed=0)
    _, model, optimizer, loader, net = _private(canaries, sigma=1.0)
    _train(model, optimizer, loader, 5)
    x = _data(1).tensors[0]
    expected = net(x)
    assert torch.equal(canaries.model(net)(x), expected)  # a fresh wrapper
    assert torch.equal(model(x), expected)  # the private one (GradSampleModule of the wrapper)
    assert torch.equal(model._module(x), expected)
    # on slots: the model's rows for records, zeros independent of the model for slots
    slots = torch.tensor([-1, 3, -1, 7] + [-1] * (len(x) - 4))
    out = model((x, slots))
    real = slots < 0
    assert torch.equal(out[real], expected[real])
    assert torch.equal(out[~real], torch.zeros(2, K))


def test_a_monitor_reports_the_record_canaries_figures():
    from privmon import PrivacyMonitor, PrivacyViolationWarning
    from privmon.queries import LossQuery
    from privmon.report.tags import canary_epsilon

    figures = {}
    for noise in ("correct", "none"):
        canaries = RecordCanaries(1000, seed=0)
        engine, model, optimizer, loader, _ = _private(canaries, sigma=2.0)
        if noise == "none":
            _without_noise(optimizer)
        data = _data(1, 100)
        x, y = data.tensors
        monitor = PrivacyMonitor(
            LossQuery(model),
            [(x[:50], y[:50])],
            [(x[50:], y[50:])],
            every_n_steps=20,
            methods=("histogram",),
            accountant=engine,
            canaries=canaries,
            strict=True,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrivacyViolationWarning)
            for step in range(1, 41):
                _train(model, optimizer, loader, 1)
                monitor.step(step)
        alarms = [w for w in caught if issubclass(w.category, PrivacyViolationWarning)]
        assert bool(alarms) == (noise == "none")
        report = monitor.last_report
        figures[noise] = {m: report.scalars[canary_epsilon(m)] for m in ("fdp", "steinke")}
        assert report.scalars["privacy/canaries/n_canaries"] == 1000
        assert report.dp_violation == (noise == "none"), (noise, figures, report.epsilon)
    assert 0.0 <= figures["correct"]["fdp"] < figures["none"]["fdp"]


# -- inclusion, state, refusals ------------------------------------------------------------------
def test_the_inclusion_bits_are_seeded_and_balanced():
    a, b = RecordCanaries(10_000, seed=3), RecordCanaries(10_000, seed=3)
    assert np.array_equal(a.included, b.included)
    assert not np.array_equal(a.included, RecordCanaries(10_000, seed=4).included)
    assert abs(a.included.sum() - 5_000) < 4 * 50  # Binomial(10⁴, ½): sd 50
    assert a.n_canaries == 10_000 and a.included.dtype == bool
    assert np.array_equal(a.included, np.random.default_rng(3).random(10_000) < 0.5)
    a.included[:] = False  # a copy
    assert a.included.any()


def test_state_dict_resumes_the_block_and_refuses_other_canaries():
    canaries = RecordCanaries(30, seed=1)
    _, model, optimizer, loader, _ = _private(canaries, sigma=1.0)
    _train(model, optimizer, loader, 3)
    state = canaries.state_dict()
    assert set(state) == {"n_canaries", "seed", "included", "values", "digest"}
    before = canaries.scores()
    again = RecordCanaries(30, seed=1)
    again.load_state_dict(state)  # before model(): kept until the block exists
    np.testing.assert_array_equal(np.concatenate(again.scores()), np.concatenate(before))
    again.model(_mlp())
    for got, want in zip(again.scores(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="seed=1; these have seed=2"):
        RecordCanaries(30, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        again.load_state_dict(sealed({"n_canaries": 30}))
    with pytest.raises(RuntimeError, match=r"call model\(\) first"):
        RecordCanaries(30).scores()


def test_refusals():
    with pytest.raises(ValueError, match="n_canaries must be an integer >= 2"):
        RecordCanaries(0)
    canaries = RecordCanaries(5)
    with pytest.raises(TypeError, match="map-style"):
        canaries.dataset(iter([]))
    with pytest.raises(TypeError, match=r"\(input, target, ...\) tuples"):
        canaries.dataset([torch.zeros(3)])
    with pytest.raises(ValueError, match=r"torch\.nn\.Module"):
        canaries.model(lambda x: x)
    wrapper = canaries.model(nn.Linear(D, K))
    assert isinstance(wrapper, RecordCanaryModel)
    with pytest.raises(ValueError, match="a row per input row"):
        wrapper((torch.zeros(4, D), torch.tensor([-1, 0, 1])))
    train = canaries.dataset(_data(0, 4))
    assert len(train) == 9 and train[8][0][1].item() == 4 and train[0][0][1].item() == -1
    with pytest.raises(IndexError):
        train[9]
