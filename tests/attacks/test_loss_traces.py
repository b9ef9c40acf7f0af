"""Tests for privmon.attacks.loss_traces (LossTraces, LT-IQR: Pollock et al., "Free Record-Level
Privacy Risk Evaluation Through Artifact-Based Methods") and privmon.attacks.loss_tail (LOSS TNR:
Dodd et al., "The Tail Tells All"): values against numpy's percentile and hand counts, the
memory bound, the saved state, merging per-rank states, NaN handling and argument errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from privmon.attacks import LossTnr, LossTraces, LtIqr, loss_tnr, lt_iqr

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fed(values: np.ndarray, *, slots: int, records=None) -> LossTraces:
    """A state fed ``values[r, s]`` as record r's loss at step s (NaN: not in that batch)."""
    n, steps = values.shape
    traces = LossTraces(n_records=n, slots=slots, records=records)
    for s in range(steps):
        seen = np.flatnonzero(~np.isnan(values[:, s]))
        traces.update(torch.from_numpy(seen), torch.from_numpy(values[seen, s]), step=s)
    return traces


def numpy_iqr(values: np.ndarray) -> np.ndarray:
    """numpy's Q3 - Q1 of each row, NaN ignored (NaN for a row without a value)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN row
        q1, q3 = np.nanpercentile(values, [25, 75], axis=1)
    return q3 - q1


def test_lt_iqr_is_numpys_interquartile_range_of_each_trace():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=(40, 16)).astype(np.float32).astype(np.float64)
    values[rng.random(values.shape) < 0.3] = np.nan  # records missing from some batches
    risk = lt_iqr(fed(values, slots=16))  # one step per slot: the trace is the losses
    np.testing.assert_allclose(risk.scores.numpy(), numpy_iqr(values), rtol=1e-12, atol=0)
    assert risk.values.tolist() == (~np.isnan(values)).sum(axis=1).tolist()
    assert risk.records.tolist() == list(range(40))


def test_lt_iqr_of_a_shuffled_loop_is_the_papers_per_epoch_reduction():
    # the paper's reduction (Pollock et al.'s code: pandas' quantile(0.75) - quantile(0.25) of
    # each record's per-epoch losses); here every step is its own slot, so the trace the loop
    # feeds in shuffled batches is exactly the per-epoch trace
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(7)
    n, epochs = 30, 9
    per_epoch = rng.exponential(size=(n, epochs)) * np.linspace(2.0, 0.1, epochs)
    traces = LossTraces(n_records=n, slots=epochs * 4)  # 4 batches per epoch: stride 1
    step = 0
    for e in range(epochs):
        for b in np.array_split(rng.permutation(n), 4):
            traces.update(torch.from_numpy(b), torch.from_numpy(per_epoch[b, e]), step=step)
            step += 1
    assert traces.stride == 1
    frame = pd.DataFrame(per_epoch)
    paper = (frame.quantile(0.75, axis=1) - frame.quantile(0.25, axis=1)).to_numpy()
    np.testing.assert_allclose(lt_iqr(traces).scores.numpy(), paper, rtol=1e-6)


def test_a_thinned_trace_holds_each_slots_mean():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 64, size=(10, 64)) / 8.0  # dyadic: every sum is exact
    traces = fed(values, slots=8)
    assert traces.stride == 8 and traces.steps == 64
    means = values.reshape(10, 8, 8).mean(axis=2)
    assert np.array_equal(traces.means().numpy(), means)
    np.testing.assert_allclose(lt_iqr(traces).scores.numpy(), numpy_iqr(means), rtol=1e-12)


def test_the_window_keeps_the_slots_that_start_inside_it():
    rng = np.random.default_rng(2)
    values = rng.exponential(size=(12, 32))
    traces = fed(values, slots=32)
    means = traces.means().numpy()
    first_half = lt_iqr(traces, stop=0.5).scores.numpy()
    np.testing.assert_allclose(first_half, numpy_iqr(means[:, :16]), rtol=1e-12)
    late = lt_iqr(traces, start=0.75).scores.numpy()
    np.testing.assert_allclose(late, numpy_iqr(means[:, 24:]), rtol=1e-12)


def test_a_record_learnt_late_ranks_above_one_learnt_at_once():
    steps = np.arange(20)
    values = np.stack([np.full(20, 0.1), np.where(steps < 12, 3.0, 0.0), np.full(20, 2.0)])
    risk = lt_iqr(fed(values, slots=20))
    assert risk.most_vulnerable(1).tolist() == [1]
    assert risk.scores.tolist() == [0.0, 3.0, 0.0]


def test_memory_is_bounded_and_stated():
    traces = LossTraces(n_records=100, slots=16)
    idx = torch.arange(100)
    for step in range(0, 100_000, 997):
        traces.update(idx, torch.ones(100), step=step)
    state = traces.state_dict()
    assert state["sums"].shape == state["counts"].shape == (100, 16)
    assert traces.bytes_per_record == 16 * 8
    assert traces.stride == 8192  # the smallest power of two with 16 · stride > last step
    assert int(traces.means().isnan().logical_not().sum(dim=1)[0]) <= 16


def test_state_round_trip_through_torch_load_weights_only(tmp_path):
    rng = np.random.default_rng(3)
    values = rng.exponential(size=(30, 50))
    traces = fed(values, slots=8, records=[2, 0, 7, 29])
    traces.update(torch.tensor([0, 1]), torch.tensor([float("nan"), 1.0]), step=3)
    torch.save(traces.state_dict(), tmp_path / "traces.pt")
    state = torch.load(tmp_path / "traces.pt", weights_only=True)
    again = LossTraces(n_records=30, slots=8, records=[0, 2, 7, 29])
    again.load_state_dict(state)
    assert (again.stride, again.steps, again.dropped) == (traces.stride, traces.steps, 1)
    for key, value in traces.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert again.records.tolist() == [0, 2, 7, 29]
    torch.testing.assert_close(lt_iqr(again).scores, lt_iqr(traces).scores, rtol=0, atol=0)
    with pytest.raises(ValueError, match="other records"):
        LossTraces(n_records=30, slots=8).load_state_dict(state)
    with pytest.raises(ValueError, match="slots = 4"):
        LossTraces(n_records=30, slots=4, records=[0, 2, 7, 29]).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        again.load_state_dict({k: v for k, v in state.items() if k != "sums"})


def test_merged_rank_states_equal_one_state_fed_everything():
    rng = np.random.default_rng(4)
    single = LossTraces(n_records=50, slots=8)
    ranks = [LossTraces(n_records=50, slots=8) for _ in range(3)]
    for step in range(70):
        idx = torch.from_numpy(rng.choice(50, size=12, replace=True))  # repeats allowed
        loss = torch.from_numpy(rng.integers(0, 32, size=12) / 4.0)
        loss[0] = float("nan") if step % 9 == 0 else loss[0]
        single.update(idx, loss, step=step)
        # rank 2 gets no batch after step 40: a finer stride than the others
        owner = rng.integers(0, 3 if step < 40 else 2, size=12)
        for r, rank in enumerate(ranks):
            if step < 40 or r != 2:
                rank.update(idx[owner == r], loss[owner == r], step=step)
    assert ranks[2].stride < single.stride
    merged = ranks[0].merge(ranks[1]).merge(ranks[2])
    expected = ranks[2].merge(ranks[0]).merge(ranks[1]).state_dict()
    for key, value in single.state_dict().items():
        assert torch.equal(merged.state_dict()[key], value), key
        assert torch.equal(expected[key], value), key
    assert ranks[0].steps <= 70 and merged.dropped == single.dropped > 0


def test_non_finite_losses_are_dropped_and_counted():
    traces = LossTraces(n_records=4, slots=4, records=[0, 1, 2])
    losses = torch.tensor([1.0, float("nan"), float("inf"), float("nan")])
    before = losses.clone()
    traces.update(torch.tensor([0, 1, 2, 3]), losses, step=0)
    traces.update(torch.tensor([0, 1]), torch.tensor([3.0, 2.0]), step=1)
    assert torch.equal(losses.nan_to_num(), before.nan_to_num())  # the input is not changed
    assert traces.dropped == 2  # record 3 is not tracked: its NaN is not counted
    risk = lt_iqr(traces)
    assert risk.scores[0] == 1.0 and risk.scores[1] == 0.0 and risk.scores[2].isnan()
    assert risk.most_vulnerable(5).tolist() == [0, 1]


def test_repeated_indices_in_a_batch_each_count():
    traces = LossTraces(n_records=3, slots=4)
    traces.update(torch.tensor([1, 1, 1]), torch.tensor([1.0, 2.0, 6.0]), step=0)
    assert traces.means()[1, 0] == 3.0


def test_most_vulnerable_breaks_ties_by_the_lower_index():
    risk = LtIqr(
        records=torch.tensor([3, 5, 8, 9]),
        scores=torch.tensor([1.0, 2.0, 2.0, float("nan")], dtype=torch.float64),
        values=torch.tensor([4, 4, 4, 0]),
    )
    assert risk.most_vulnerable(3).tolist() == [5, 8, 3]


def test_training_is_bit_identical_with_and_without_the_traces():
    def train(traced: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(40, 5, generator=gen), torch.randint(0, 3, (40,), generator=gen)
        traces = LossTraces(n_records=40, slots=4)
        for step in range(12):
            idx = torch.randperm(40, generator=gen)[:8]
            losses = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="none")
            if traced:
                traces.update(idx, losses, step=step)  # not detached by the caller
            opt.zero_grad()
            losses.mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_state_lives_on_the_losses_device():
    traces = LossTraces(n_records=5, slots=4)
    traces.update(torch.tensor([0, 1]).cuda(), torch.tensor([1.0, 2.0]).cuda(), step=0)
    assert traces.means().device.type == "cuda"
    assert lt_iqr(traces).scores.device.type == "cuda"
    assert traces.state_dict()["sums"].device.type == "cpu"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LossTraces(n_records=0), "n_records"),
        (lambda: LossTraces(n_records=3, slots=5), "slots"),
        (lambda: LossTraces(n_records=3, slots=2), "slots"),
        (lambda: LossTraces(n_records=3, records=[0, 3]), "records"),
        (lambda: LossTraces(n_records=3, records=[1, 1]), "records"),
        (lambda: LossTraces(n_records=3, records=[0.5]), "records"),
    ],
)
def test_bad_construction_names_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("indices", "losses", "step", "match"),
    [
        (torch.tensor([0.0, 1.0]), torch.ones(2), 0, "indices"),
        (torch.tensor([0, 3]), torch.ones(2), 0, "indices"),
        (torch.tensor([-1, 0]), torch.ones(2), 0, "indices"),
        (torch.tensor([0, 1]), torch.ones(3), 0, "same length"),
        (torch.tensor([0, 1]), torch.ones(2, 1), 0, "losses"),
        (torch.tensor([0, 1]), torch.tensor([1, 2]), 0, "losses"),
        (torch.tensor([0, 1]), torch.ones(2), -1, "step"),
        (torch.tensor([0, 1]), torch.ones(2), 1.5, "step"),
    ],
)
def test_bad_batches_name_the_argument_and_change_nothing(indices, losses, step, match):
    traces = LossTraces(n_records=3, slots=4)
    with pytest.raises(ValueError, match=match):
        traces.update(indices, losses, step=step)
    assert traces.steps == 0 and int(traces.state_dict()["counts"].sum()) == 0


def test_bad_reading_arguments_name_the_argument():
    traces = fed(np.ones((3, 4)), slots=4)
    for kwargs, match in (
        ({"stop": 0.0}, "stop"),
        ({"start": 1.0}, "start"),
        ({"start": 0.5, "stop": 0.5}, "start"),
        ({"start": -0.1}, "start"),
    ):
        with pytest.raises(ValueError, match=match):
            lt_iqr(traces, **kwargs)
    with pytest.raises(TypeError, match="traces"):
        lt_iqr(traces.state_dict())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k"):
        lt_iqr(traces).most_vulnerable(0)
    with pytest.raises(ValueError, match="slots"):
        traces.merge(LossTraces(n_records=3, slots=8))
    with pytest.raises(ValueError, match="same records"):
        traces.merge(LossTraces(n_records=4, slots=4))


# --- LOSS TNR ------------------------------------------------------------------------------


def test_loss_tnr_is_a_hand_count():
    members = np.arange(1000.0)  # losses 0 .. 999
    nonmembers = np.arange(0.0, 2000.0, 2.0)  # 0, 2, .., 1998: a heavier tail
    est = loss_tnr(members, nonmembers)
    assert est.fpr == (0.001, 0.01)
    # FPR 0.1 %: one member may lie above the threshold, 998; 500 non-members (1000 .. 1998) do
    # FPR 1 %: ten members above 989; the non-members 990 .. 1998, 505 of them
    assert est.threshold == (998.0, 989.0)
    assert est.estimate == (0.5, 0.505)
    assert (est.n_members, est.n_nonmembers, est.dropped) == (1000, 1000, 0)


def test_loss_tnr_ties_at_the_threshold_are_not_counted_and_nan_is_dropped():
    members = torch.tensor([1.0, 1.0, 1.0, float("nan")])
    nonmembers = torch.tensor([1.0, 2.0, float("inf"), 0.5])
    est = loss_tnr(members, nonmembers, fpr=0.2)
    assert est == LossTnr(
        fpr=(0.2,), estimate=(1 / 3,), threshold=(1.0,), n_members=3, n_nonmembers=3, dropped=2
    )


def test_loss_tnr_matches_a_brute_force_search_over_thresholds():
    rng = np.random.default_rng(5)
    members, nonmembers = rng.exponential(0.3, 700), rng.exponential(1.0, 650)
    for alpha in (0.001, 0.01, 0.05):
        best = max(
            np.mean(nonmembers > t)
            for t in np.r_[members, nonmembers]
            if np.mean(members > t) <= alpha
        )
        assert loss_tnr(members, nonmembers, fpr=alpha).estimate[0] == pytest.approx(best)


def test_loss_tnr_is_the_loss_attacks_tnr_at_fnr_alpha_on_its_roc_curve():
    # "The Tail Tells All": the TNR of the loss attack (member when the loss is low) at the
    # threshold where at most a fraction alpha of the members are missed (FNR <= alpha), read
    # off scikit-learn's ROC curve of the attack (members positive, score -loss)
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(11)
    members, nonmembers = rng.lognormal(-2.0, 1.5, 3000), rng.lognormal(-1.0, 1.5, 2000)
    labels = np.r_[np.ones(members.size), np.zeros(nonmembers.size)]
    fpr, tpr, _ = metrics.roc_curve(labels, -np.r_[members, nonmembers], drop_intermediate=False)
    for alpha in (0.001, 0.01, 0.1):
        tnr = 1.0 - fpr[tpr >= 1.0 - alpha - 1e-12].min()
        assert loss_tnr(members, nonmembers, fpr=alpha).estimate[0] == pytest.approx(tnr)


@pytest.mark.parametrize(
    ("members", "nonmembers", "fpr", "match"),
    [
        (np.ones(5), np.ones(5), 0.0, "fpr"),
        (np.ones(5), np.ones(5), 1.0, "fpr"),
        (np.ones((5, 2)), np.ones(5), 0.01, "member_losses"),
        (np.ones(5), np.full(5, np.nan), 0.01, "nonmember_losses"),
        (np.ones(0), np.ones(5), 0.01, "member_losses"),
    ],
)
def test_loss_tnr_bad_arguments_name_the_argument(members, nonmembers, fpr, match):
    with pytest.raises(ValueError, match=match):
        loss_tnr(members, nonmembers, fpr=fpr)
