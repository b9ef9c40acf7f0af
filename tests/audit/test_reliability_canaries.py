"""Issue #31, the canaries under careless input: schedulers bound before the canaries, steps that
failed inside Opacus, canary counts that leave a side empty, a frozen first param group, a
failing ``release()``, implausible in / out splits, a checkpoint saved without canaries, and the
behaviours a mutant of ``audit/canaries.py`` changed without a test noticing."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon.audit import GradientCanaries, InputCanaries, RecordCanaries, one_run_epsilon

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:Secure RNG", "ignore:Optimal order", "ignore:Full backward"),
]

N, BATCH, CLIP, LR = 200, 20, 0.7, 0.3  # q = BATCH / N = 0.1


def private(*, sigma: float = 0.0, optimizer_fn=None, seed: int = 0, before=None, **options):
    """A linear model made private by Opacus on random data: (model, optimizer, loader,
    engine). ``before(optimizer)`` runs on the plain optimizer before ``make_private``."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 2, (N,), generator=g))
    model = nn.Linear(5, 2)
    plain = (optimizer_fn or (lambda m: torch.optim.SGD(m.parameters(), lr=LR)))(model)
    if before is not None:
        before(plain)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=plain,
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=sigma,
        max_grad_norm=CLIP,
        **options,
    )
    return model, opt, loader, engine


def step(model, opt, x, y, *, zero=None) -> None:
    (zero or opt.zero_grad)()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def in_order(canaries) -> np.ndarray:
    ins, outs = canaries.scores()
    s = np.empty(len(canaries.included))
    s[canaries.included], s[~canaries.included] = ins, outs
    return s


# -- item 2: every scheduler bound before the canaries is refused ---------------------------------
@pytest.mark.parametrize("on", ["dp", "plain"])
def test_a_reduce_on_plateau_scheduler_made_before_the_canaries_is_refused(on):
    """ReduceLROnPlateau sets no 'initial_lr': it is found among the optimizer's schedulers,
    whether bound to the DPOptimizer or to the optimizer make_private wrapped."""
    schedulers = []

    def bind(opt):
        schedulers.append(torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[1e-4]))

    _, opt, _, _ = private(before=bind if on == "plain" else None)
    if on == "dp":
        bind(opt)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau.*before the GradientCanaries"):
        GradientCanaries(opt, 10)
    assert len(opt.param_groups) == 1  # refused before the block joined


def test_a_scheduler_dropped_before_the_canaries_is_no_obstacle_and_one_made_after_works():
    model, opt, loader, _ = private()
    torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[1e-4])  # discarded at once
    gc.collect()
    canaries = GradientCanaries(opt, 10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[1e-4] * 2, patience=0)
    x, y = next(iter(loader))
    for loss in (1.0, 2.0, 3.0):  # worse and worse: the lr is reduced
        step(model, opt, x, y)
        plateau.step(loss)
    assert opt.param_groups[0]["lr"] < LR and canaries.steps == 3


# -- item 3: only steps whose noise was added count ----------------------------------------------
def test_steps_that_failed_inside_opacus_are_not_counted():
    """model.zero_grad() leaves Opacus' summed gradients, so the next add_noise raises: the
    canaries and their checks count the noised steps only, the steps the accountant counts, and
    a failed step leaves no trace (the same counts and scores as a run without it)."""
    model, opt, loader, engine = private(sigma=0.0)
    canaries = GradientCanaries(opt, 4000, seed=1)
    batches = list(loader)
    failed = 0
    for i in range(20):
        x, y = batches[i % len(batches)]
        try:
            step(model, opt, x, y, zero=model.zero_grad if i % 2 else opt.zero_grad)
        except ValueError as err:
            assert "haven't been cleared" in str(err)
            failed += 1
    counted = sum(n for _, _, n in engine.accountant.history)
    assert failed == 10 and counted == 10
    assert canaries.steps == canaries.mechanism_checks.steps == counted
    findings = {f"{f.check}/{f.test}": f for f in canaries.mechanism()}
    assert not findings["steps/count"].fired
    # the failed steps' rows are not the next step's: the batch size is 20 at every step
    assert findings["sampling/mean"].p_value > 1e-3 < findings["sampling/dispersion"].p_value

    model2, opt2, _, _ = private(sigma=0.0)
    clean = GradientCanaries(opt2, 4000, seed=1)
    for i in range(10):
        step(model2, opt2, *batches[(2 * i) % len(batches)])
    assert np.array_equal(canaries.sample_counts, clean.sample_counts)
    np.testing.assert_array_equal(in_order(canaries), in_order(clean))


# -- item 4: no side can be empty ---------------------------------------------------------------
def test_a_canary_count_that_can_leave_a_side_empty_is_refused_at_construction():
    for bad in (0, 1):
        with pytest.raises(ValueError, match="n_canaries must be an integer >= 2"):
            GradientCanaries(private()[1], bad)
        with pytest.raises(ValueError, match="n_canaries must be an integer >= 2"):
            RecordCanaries(bad)
    # seed 2 includes both of 2 canaries, seed 1 neither: a side would be empty
    for seed, side in ((2, "all"), (1, "none")):
        with pytest.raises(ValueError, match=rf"seed={seed} includes {side} of the 2 canaries"):
            GradientCanaries(private()[1], 2, seed=seed)
        with pytest.raises(ValueError, match=rf"seed={seed} includes {side} of the 2 canaries"):
            RecordCanaries(2, seed=seed)
        with pytest.raises(ValueError, match=rf"seed={seed} includes {side} of the 2 canaries"):
            InputCanaries([(torch.zeros(2), 0)] * 2, seed=seed)
    opt = private()[1]
    GradientCanaries(opt, 2, seed=0)  # one in, one out: accepted
    assert len(opt.param_groups) == 2


def test_records_in_a_set_are_refused_naming_the_set():
    with pytest.raises(TypeError, match=r"map-style dataset.*got set"):
        InputCanaries({("a", 0), ("b", 1), ("c", 0)})


# -- item 5: the scores do not depend on another group's learning rate ---------------------------
def test_a_frozen_first_param_group_leaves_the_scores_alone():
    """Group 0 frozen (lr 0), σ = 0: the block copied lr 0 and never moved (ε 0, silently).
    The scores are the noised gradients the block received: C · count / B."""

    def two_groups(model):
        weight, bias = model.parameters()
        return torch.optim.SGD([{"params": [weight], "lr": 0.0}, {"params": [bias], "lr": LR}])

    model, opt, loader, _ = private(optimizer_fn=two_groups)
    canaries = GradientCanaries(opt, 500, seed=3)
    for x, y in loader:
        step(model, opt, x, y)
    assert canaries.sample_counts.sum() > 0
    np.testing.assert_allclose(in_order(canaries), CLIP * canaries.sample_counts / BATCH, atol=1e-9)
    assert one_run_epsilon(*canaries.scores(), delta=1e-5).epsilon > 1.0


def test_plain_sgd_keeps_the_figures_of_the_blocks_update():
    """Under SGD with one constant lr the block's update is lr times the scores: the same order,
    the same bounds."""
    model, opt, loader, _ = private(sigma=1.0)
    canaries = GradientCanaries(opt, 4000, seed=2, checks=())
    for _ in range(3):
        for x, y in loader:
            step(model, opt, x, y)
    block = opt.param_groups[-1]["params"][0]
    update = -block.detach().double().numpy()  # θ_0 − θ_T, what the canaries scored before
    np.testing.assert_allclose(in_order(canaries) * LR, update, rtol=1e-4, atol=1e-7)
    inc = canaries.included
    for method in ("fdp", "steinke"):
        old = one_run_epsilon(update[inc], update[~inc], delta=1e-5, method=method)
        assert one_run_epsilon(*canaries.scores(), delta=1e-5, method=method) == old


# -- item 6: a failing release() loses nothing --------------------------------------------------
class Recording:
    """A loss query that records its calls; ``fail`` makes its release() raise."""

    def __init__(self, model, fail=False):
        from privmon.queries import LossQuery

        self.inner, self.calls, self.fail = LossQuery(model), [], fail
        self.name, self.higher_is_member, self.modules = "rec", False, [model]

    def prepare(self, device=None):
        self.calls.append("prepare")

    def __call__(self, batch):
        return self.inner(batch)

    def release(self):
        self.calls.append("release")
        if self.fail:
            raise RuntimeError("release exploded")


def _records(n=40):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def test_input_canaries_prepare_and_release_their_query():
    query = Recording(nn.Linear(4, 2))
    InputCanaries(_records(), query=query).scores(batch_size=7)
    assert query.calls == ["prepare", "release"]


def test_a_failing_release_keeps_the_canary_figures(caplog):
    from privmon import PrivacyMonitor
    from privmon.queries import LossQuery
    from privmon.report.tags import canary_epsilon

    model = nn.Linear(4, 2)
    canaries = InputCanaries(_records(), query=Recording(model, fail=True), seed=3)
    with caplog.at_level(logging.ERROR, logger="privmon"):
        ins, outs = canaries.scores()
    assert len(ins) + len(outs) == 40 and "release exploded" in caplog.text
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(60, 4, generator=g), torch.randint(0, 2, (60,), generator=g)
    monitor = PrivacyMonitor(
        LossQuery(model),
        [(x[:30], y[:30])],
        [(x[30:], y[30:])],
        methods=("histogram",),
        canaries=canaries,
    )
    report = monitor.check(1)
    assert canary_epsilon("fdp") in report.scalars and canary_epsilon("steinke") in report.scalars
    assert not any("canaries" in k for k in report.failures)


def test_a_failing_query_is_not_hidden_by_its_failing_release(caplog):
    broken = InputCanaries(_records(), seed=3)

    class Raises(Recording):
        def __call__(self, batch):
            raise KeyError("the query's own fault")

    with caplog.at_level(logging.ERROR, logger="privmon"):
        with pytest.raises(KeyError, match="the query's own fault"):
            broken.scores(Raises(nn.Linear(4, 2), fail=True))
    assert "release exploded" in caplog.text


# -- item 11: an in / out split fair coins cannot make ---------------------------------------------
def test_an_implausible_split_is_refused_and_says_what_the_bound_assumes():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"10 in and 10000 out.*independent fair coin"):
        one_run_epsilon(rng.normal(3, 1, 10), rng.normal(0, 1, 10_000), delta=1e-5)
    one_run_epsilon(rng.normal(3, 1, 460), rng.normal(0, 1, 540), delta=1e-5)  # plausible


def test_the_split_p_value_is_the_exact_two_sided_binomial_test():
    from scipy import stats

    from privmon.audit.one_run import SPLIT_LEVEL, check_inclusion
    from privmon.audit.one_run_math import split_p_value

    for n_in, n_out in ((0, 1), (1, 1), (3, 7), (10, 10_000), (460, 540), (5000, 5000), (0, 40)):
        want = stats.binomtest(n_in, n_in + n_out, 0.5).pvalue
        assert split_p_value(n_in, n_out) == pytest.approx(want, rel=1e-9, abs=1e-300)
    uneven = np.arange(1000) < 300  # 300 of 1000: p ~ 1e-37
    assert split_p_value(300, 700) < SPLIT_LEVEL
    with pytest.raises(ValueError, match=r"seed=7 includes 300 of the 1000 canaries"):
        check_inclusion(uneven, seed=7)
    assert check_inclusion(np.arange(1000) < 480, seed=7).sum() == 480


# -- hazard: a checkpoint saved without the canaries ---------------------------------------------
def test_loading_an_optimizer_state_saved_without_canaries_names_the_block():
    _, opt, _, _ = private()
    saved = opt.state_dict()
    canaries = GradientCanaries(opt, 10)
    with pytest.raises(ValueError, match=r"groups.*GradientCanaries' block.*before attaching"):
        opt.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"GradientCanaries"):
        opt.original_optimizer.load_state_dict(saved)
    opt.load_state_dict(opt.state_dict())  # a state saved with the canaries loads
    canaries.detach()
    opt.load_state_dict(saved)  # and after detach, the state saved without them


# -- mutant: gradient accumulation (grad_sample lists) --------------------------------------------
def test_accumulated_backward_passes_are_one_step_at_the_accumulated_rate():
    model, opt, loader, _ = private(poisson_sampling=False)
    canaries = GradientCanaries(opt, 20_000, seed=0, checks=())
    batches = iter([*loader, *loader])  # 10 batches an epoch
    for _ in range(5):
        opt.zero_grad()
        for _ in range(3):
            x, y = next(batches)
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert canaries.steps == 5
    inc = canaries.included
    rate = canaries.sample_counts[inc].sum() / (inc.sum() * 5)
    assert rate == pytest.approx(3 * BATCH / N, abs=0.01)
