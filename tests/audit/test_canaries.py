"""Canaries for one-run DP audits, on real Opacus optimizers and real queries.

Gradient canaries: with no noise a canary's score (the block's gradient summed over the steps)
is the hand computation C · (times sampled) / B, once per logical step (virtual steps included),
and it goes through the optimizer's own ``add_noise``; with noise the scores are exactly the
Gaussian mechanism (KS against the analytic normal); inclusion bits, sampling rate, state_dict,
detach and the refusals. Input canaries: inclusion, the records to train on, the query's
direction and a check that leaves training untouched.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

from privmon._digest import sealed
from privmon.audit import GradientCanaries, InputCanaries

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer  # noqa: E402
from opacus.utils.batch_memory_manager import BatchMemoryManager  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"),
]

N, BATCH, CLIP, LR = 200, 20, 0.7, 0.3  # q = BATCH / N = 0.1


def private(
    *,
    sigma: float = 0.0,
    optimizer_fn=lambda params: torch.optim.SGD(params, lr=LR),
    seed: int = 0,
    **options,
):
    """A linear model made private by Opacus on random data: (model, optimizer, loader)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 2, (N,), generator=g))
    model = nn.Linear(5, 2)
    return PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer_fn(model.parameters()),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=sigma,
        max_grad_norm=CLIP,
        **options,
    )


def train(model, optimizer, loader, steps: int) -> None:
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                return


def all_scores(canaries: GradientCanaries) -> np.ndarray:
    """Scores in canary order."""
    ins, outs = canaries.scores()
    s = np.empty(canaries.n_canaries)
    s[canaries.included], s[~canaries.included] = ins, outs
    return s


# -- the mechanism ------------------------------------------------------------------------------
def test_without_noise_the_block_moves_by_the_hand_computation():
    model, opt, loader = private()
    canaries = GradientCanaries(opt, 500, seed=3)
    train(model, opt, loader, 30)
    assert canaries.steps == 30 and canaries.sample_rate == pytest.approx(0.1)
    counts = canaries.sample_counts
    assert counts.sum() > 0
    np.testing.assert_allclose(all_scores(canaries), CLIP * counts / BATCH, atol=1e-6)
    # the scores are the gradient the update received: SGD moved the block by lr times them
    block = opt.param_groups[-1]["params"][0].detach().numpy()
    np.testing.assert_allclose(-block, LR * CLIP * counts / BATCH, atol=1e-6)


def test_the_canaries_pass_through_the_optimizers_own_add_noise():
    """A spy in place of add_noise (as a buggy or patched optimizer would be) sees the canaries
    already in the summed clipped gradient, and what it makes of them is what the block gets."""
    model, opt, loader = private(sigma=1.0)
    seen = []

    def add_noise_without_noise():  # the silent bug: the summed clipped gradient goes out as is
        seen.append(opt.param_groups[-1]["params"][0].summed_grad.clone())
        for p in opt.params:
            p.grad = p.summed_grad.view_as(p).clone()

    opt.add_noise = add_noise_without_noise
    canaries = GradientCanaries(opt, 300, seed=1)
    train(model, opt, loader, 12)
    assert len(seen) == 12
    np.testing.assert_allclose(sum(seen).numpy(), CLIP * canaries.sample_counts, atol=1e-6)
    np.testing.assert_allclose(
        all_scores(canaries), CLIP * canaries.sample_counts / BATCH, atol=1e-6
    )
    canaries.detach()
    assert opt.add_noise is add_noise_without_noise  # the bug is back, not Opacus' method


def test_with_noise_the_block_is_the_gaussian_mechanism():
    """Each canary's score minus its canary part is 1/B times a sum of T normals of sd σC."""
    sigma, steps = 1.3, 40
    model, opt, loader = private(sigma=sigma)
    canaries = GradientCanaries(opt, 4000, seed=2)
    train(model, opt, loader, steps)
    noise = all_scores(canaries) - CLIP * canaries.sample_counts / BATCH
    sd = sigma * CLIP * np.sqrt(steps) / BATCH
    assert stats.kstest(noise / sd, "norm").pvalue > 1e-3
    assert np.std(noise) / sd == pytest.approx(1.0, abs=0.05)
    # Included canaries are sampled at the records' rate: counts ~ Binomial(steps, q).
    counts = canaries.sample_counts[canaries.included]
    assert counts.mean() == pytest.approx(steps * 0.1, abs=4 * np.sqrt(steps * 0.09 / counts.size))
    assert counts.var() == pytest.approx(steps * 0.09, rel=0.15)


def test_virtual_steps_add_the_canaries_once_per_logical_step():
    model, opt, loader = private(poisson_sampling=True)
    canaries = GradientCanaries(opt, 400, seed=5)
    logical = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as mem:
        for x, y in mem:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            logical += not opt._is_last_step_skipped
    assert canaries.steps == logical == len(loader)
    np.testing.assert_allclose(
        all_scores(canaries), CLIP * canaries.sample_counts / BATCH, atol=1e-6
    )


@pytest.mark.parametrize(("sigma", "steps"), [(0.0, 15), (1.0, 1)])
def test_the_model_trains_as_without_canaries(sigma, steps):
    """The block leaves the model's clipping, noise, scaling and update alone: bit-identical
    weights with and without it, over many steps without noise, and over the first step with
    noise (the block's noise is drawn after the model's; later steps' draws shift)."""
    runs = []
    for n in (None, 1000):
        model, opt, loader = private(sigma=sigma)
        if n is not None:
            GradientCanaries(opt, n)
        train(model, opt, loader, steps)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@settings(max_examples=8, deadline=None)
@given(
    kind=st.sampled_from(["sgd", "momentum", "adam", "adamw"]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    seed=st.integers(0, 100),
)
def test_score_is_higher_for_sampled_canaries_under_any_update_rule(kind, weight_decay, seed):
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=LR, weight_decay=weight_decay),
        "momentum": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, weight_decay=weight_decay),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=weight_decay),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=weight_decay),
    }[kind]
    model, opt, loader = private(optimizer_fn=make, seed=seed)
    canaries = GradientCanaries(opt, 200, seed=seed)
    train(model, opt, loader, 8)
    score, counts = all_scores(canaries), canaries.sample_counts
    assert (score[counts > 0] > 0).all() and (score[counts == 0] == 0).all()


# -- inclusion and sampling -------------------------------------------------------------------
def test_inclusion_bits_are_seeded_and_fair_and_excluded_canaries_are_never_sampled():
    bits = {}
    for seed in (0, 0, 1):
        model, opt, loader = private()
        with GradientCanaries(opt, 20_000, seed=seed) as canaries:
            train(model, opt, loader, 3)
            bits.setdefault(seed, []).append(canaries.included)
            assert (canaries.sample_counts[~canaries.included] == 0).all()
    assert np.array_equal(*bits[0]) and not np.array_equal(bits[0][0], bits[1][0])
    assert stats.binomtest(int(bits[1][0].sum()), 20_000).pvalue > 1e-3


def test_sample_rate_is_read_from_the_accountant_or_given_and_checked():
    assert GradientCanaries(private()[1], 5).sample_rate == pytest.approx(0.1)
    opt = private()[1]
    with pytest.raises(ValueError, match="differs from the rate the optimizer's accountant"):
        GradientCanaries(opt, 5, sample_rate=0.2)
    bare = DPOptimizer(
        torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    with pytest.raises(ValueError, match=r"no Opacus accountant hook.*pass sample_rate"):
        GradientCanaries(bare, 5)
    for bad in (0, 1.5, float("nan"), "x"):
        with pytest.raises(ValueError, match="sample_rate"):
            GradientCanaries(bare, 5, sample_rate=bad)
    assert GradientCanaries(bare, 5, sample_rate=0.25).sample_rate == 0.25


# -- detach, state_dict ---------------------------------------------------------------------------
def test_detach_restores_the_optimizer_and_freezes_the_scores():
    model, opt, loader = private()
    groups, methods = len(opt.param_groups), dict(opt.__dict__)
    canaries = GradientCanaries(opt, 100, seed=1)
    assert len(opt.param_groups) == groups + 1
    train(model, opt, loader, 5)
    before = canaries.scores()
    canaries.detach()
    canaries.detach()  # a second call does nothing
    assert len(opt.param_groups) == groups and not canaries.attached
    assert dict(opt.__dict__) == methods
    assert set(opt.state) <= set(model.parameters())
    train(model, opt, loader, 3)  # trains as before
    after = canaries.scores()
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    GradientCanaries(opt, 10).detach()  # others may attach now


def test_detach_refuses_when_a_wrapped_method_was_wrapped_again():
    opt = private()[1]
    canaries = GradientCanaries(opt, 10)
    opt.add_noise = lambda: None
    with pytest.raises(RuntimeError, match="add_noise was replaced"):
        canaries.detach()


def test_state_dict_round_trip_resumes_the_audit():
    def setup():
        model, opt, loader = private(optimizer_fn=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.5))
        return model, opt, loader, GradientCanaries(opt, 8, seed=4)

    model, opt, loader, canaries = setup()
    train(model, opt, loader, 6)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), canaries.state_dict()))
    torch.manual_seed(9)
    train(model, opt, loader, 6)
    expected = all_scores(canaries), canaries.sample_counts, canaries.steps

    model, opt, loader, canaries = setup()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    canaries.load_state_dict(saved[2])
    torch.manual_seed(9)
    train(model, opt, loader, 6)
    np.testing.assert_array_equal(all_scores(canaries), expected[0])
    np.testing.assert_array_equal(canaries.sample_counts, expected[1])
    assert canaries.steps == expected[2] == 12


def test_a_mismatched_state_is_refused():
    state = GradientCanaries(private()[1], 8, seed=4).state_dict()
    for kwargs, field in [
        ({"n_canaries": 9, "seed": 4}, "n_canaries"),
        ({"n_canaries": 8, "seed": 5}, "seed"),
    ]:
        with pytest.raises(ValueError, match=field):
            GradientCanaries(private()[1], **kwargs).load_state_dict(state)
    opt = private()[1]
    tampered = sealed({**state, "included": ~state["included"]})
    with pytest.raises(ValueError, match="included"):
        GradientCanaries(opt, 8, seed=4).load_state_dict(tampered)
    with pytest.raises(ValueError, match="lacks"):
        GradientCanaries(private()[1], 8, seed=4).load_state_dict(sealed({"seed": 4}))


# -- refusals -----------------------------------------------------------------------------------
def test_bad_arguments_are_refused_with_the_valid_range():
    with pytest.raises(TypeError, match=r"Opacus DPOptimizer.*got SGD"):
        GradientCanaries(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), 10)
    for bad in (0, 1, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="n_canaries must be an integer >= 2"):
            GradientCanaries(private()[1], bad)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        GradientCanaries(private()[1], 5, seed=-1)
    opt = private()[1]
    GradientCanaries(opt, 5)
    with pytest.raises(ValueError, match="already carries GradientCanaries"):
        GradientCanaries(opt, 5)


def test_a_scheduler_made_before_the_block_is_refused_and_one_made_after_schedules_it():
    opt = private()[1]
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    with pytest.raises(ValueError, match="create the GradientCanaries before the scheduler"):
        GradientCanaries(opt, 5)
    model, opt, loader = private()
    GradientCanaries(opt, 5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    train(model, opt, loader, 1)
    scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == [LR / 2, LR / 2]


def test_per_layer_clipping_is_refused():
    model = nn.Linear(3, 2)
    per_layer = DPPerLayerOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=[1.0, 1.0],
        expected_batch_size=4,
    )
    with pytest.raises(ValueError, match=r"DPPerLayerOptimizer.*per-layer clipping"):
        GradientCanaries(per_layer, 5, sample_rate=0.1)


# -- input canaries -------------------------------------------------------------------------------
def mislabelled(n: int = 64):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_input_canaries_inclusion_and_training_records():
    records = mislabelled(400)
    canaries = InputCanaries(records, seed=7)
    assert np.array_equal(canaries.included, InputCanaries(records, seed=7).included)
    assert not np.array_equal(canaries.included, InputCanaries(records, seed=8).included)
    assert stats.binomtest(int(canaries.included.sum()), 400).pvalue > 1e-3
    extra = canaries.training_records
    assert len(extra) == canaries.included.sum()
    x_in = torch.stack([extra[i][0] for i in range(len(extra))])
    assert torch.equal(x_in, records.tensors[0][canaries.included])
    assert len(ConcatDataset([mislabelled(10), extra])) == 10 + len(extra)


def test_input_canary_scores_follow_the_querys_direction_and_leave_training_untouched():
    from privmon.queries import ConfidenceQuery, LossQuery

    records = mislabelled()
    canaries = InputCanaries(records, seed=1)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    model.train()
    rng = torch.get_rng_state()
    ins, outs = canaries.scores(LossQuery(model), batch_size=7)
    assert model.training and torch.equal(rng, torch.get_rng_state())
    x, y = records.tensors
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model.eval()(x), y, reduction="none").numpy()
    np.testing.assert_allclose(ins, -loss[canaries.included], rtol=1e-5)
    np.testing.assert_allclose(outs, -loss[~canaries.included], rtol=1e-5)
    conf_in, _ = canaries.scores(ConfidenceQuery(model))
    probs = torch.softmax(model(x), 1).gather(1, y[:, None])[:, 0].detach().numpy()
    np.testing.assert_allclose(conf_in, probs[canaries.included], rtol=1e-5)


def test_input_canaries_refuse_what_they_cannot_score():
    from privmon.queries import CallableQuery

    canaries = InputCanaries(mislabelled())
    with pytest.raises(ValueError, match="known direction"):
        canaries.scores(CallableQuery(lambda b: b[0][:, 0], name="raw"))
    two = CallableQuery(lambda b: b[0][:, :2], name="two", higher_is_member=True)
    with pytest.raises(ValueError, match="one score per record"):
        canaries.scores(two)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        canaries.scores(two, batch_size=0)
    with pytest.raises(TypeError, match="map-style dataset"):
        InputCanaries(iter([1, 2, 3]))
    with pytest.raises(ValueError, match="at least 2"):
        InputCanaries([(torch.zeros(2), 0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        InputCanaries([(torch.zeros(2), 0)] * 2)
