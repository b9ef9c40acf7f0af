"""Tests for privmon.estimators.binned_scores.BinnedScores and advantage.StreamingAdvantage:
batch-size independence, merging, persistence, overflow / NaN accounting, fold assignment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from privmon import StreamingAdvantage, optimal_advantage
from privmon.estimators.advantage import advantage_from_state
from privmon.estimators.binned_scores import MAX_CELLS, BinnedScores
from privmon.estimators.folds import fold_of
from privmon.estimators.order_statistics import robust_range

METHODS = ("histogram", "kde")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def data(seed: int, n1: int = 1500, n2: int = 1300, d: int = 1):
    rng = np.random.default_rng(seed)
    m = rng.normal(0.0, 1.0, (n1, d))
    m[:, 0] += 0.8
    h = rng.normal(0.0, 1.2, (n2, d))
    return (m[:, 0], h[:, 0]) if d == 1 else (m, h)


def stream(est, m, h, sizes=(1, 7, 100, 13, 500, 2, 999)):
    """Feed m and h in batches of varying sizes, sometimes one class only."""
    i = j = k = 0
    while i < len(m) or j < len(h):
        s = sizes[k % len(sizes)]
        k += 1
        mb = m[i : i + s] if i < len(m) and k % 5 != 3 else None
        hb = h[j : j + 2 * s] if j < len(h) and k % 7 != 4 else None
        if mb is None and hb is None:
            continue
        est.update(mb, hb)
        i += 0 if mb is None else s
        j += 0 if hb is None else 2 * s


def range_of(m, h):
    """The grid the functional form uses: the pooled range, cut at 5 IQRs beyond the quartiles."""
    lo, hi = robust_range(torch.as_tensor(np.concatenate([m, h])).reshape(len(m) + len(h), -1))
    return lo.numpy(), hi.numpy()


STATE_FIELDS = ("counts", "sum1", "sum2", "n_seen", "n_dropped", "n_overflow")


def assert_same_state(a: BinnedScores, b: BinnedScores):
    assert a.bins == b.bins
    assert torch.equal(a.low, b.low) and torch.equal(a.high, b.high)
    for name in STATE_FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ----------------------------------------------------------------------------- batch independence


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("d", [1, 2])
def test_batches_of_any_size_equal_one_update(method, d):
    m, h = data(1, d=d)
    low, high = range_of(m, h)
    one = StreamingAdvantage(method=method, low=low, high=high, dim=d)
    one.update(m, h)
    many = StreamingAdvantage(method=method, low=low, high=high, dim=d)
    stream(many, m, h)
    assert_same_state(one.state, many.state)
    assert many.compute() == one.compute()
    functional = optimal_advantage(m, h, method=method)
    if d == 2:  # with the grid on the data range, the streaming form is the functional form,
        # but for the certificate: the functional one bins its rule's records on their own range
        stream_figures = one.compute().as_dict()
        for name, figure in functional.as_dict().items():
            if name not in ("lower", "lower_check"):
                assert stream_figures[name] == figure, name
    else:  # 1-D: the functional rule reads ranks, which a stream cannot; the plug-in agrees
        assert one.compute().plugin == pytest.approx(functional.plugin, abs=1e-12)
        assert one.compute().value == pytest.approx(functional.value, abs=0.03)


def test_streaming_kde_stays_on_the_grid_for_a_narrow_class():
    """Documented exception: the functional KDE switches to exact kernel sums when a class's
    bandwidth is below a grid cell; the stream keeps no records and stays on the grid, so it
    equals the functional estimate only with a grid fine enough for that class."""
    rng = np.random.default_rng(15)
    m, h = rng.normal(0.5, 0.002, 300), rng.normal(0.0, 1.0, 300)
    low, high = range_of(m, h)
    est = StreamingAdvantage(method="kde", low=low, high=high)
    est.update(m, h)
    exact = optimal_advantage(m, h, method="kde")
    assert est.compute() != exact
    assert est.compute().plugin == pytest.approx(exact.plugin, abs=1e-3)
    fine = StreamingAdvantage(method="kde", low=low, high=high, bins=8192)
    fine.update(m, h)
    assert fine.compute().plugin == pytest.approx(exact.plugin, abs=1e-3)


def test_empty_batches_are_a_no_op():
    m, h = data(5)
    low, high = range_of(m, h)
    a = StreamingAdvantage(low=low, high=high)
    a.update(m, h)
    b = StreamingAdvantage(low=low, high=high)
    b.update(np.empty(0), np.empty(0))
    b.update(m, h)
    b.update(torch.empty(0), None)
    assert a.compute() == b.compute()


@pytest.mark.parametrize("prior", [0.3, 0.8])
def test_streaming_prior_and_delta_equal_functional(prior):
    m, h = data(2)
    low, high = range_of(m, h)
    est = StreamingAdvantage(prior=prior, delta=0.1, low=low, high=high)
    stream(est, m, h)
    # the stream's functional twin: the same grid filled in one update (1-D optimal_advantage
    # reads ranks instead, see test_batches_of_any_size_equal_one_update)
    state = BinnedScores(bins=100, margin=0.0, low=low, high=high)
    state.update(m, h)
    assert est.compute() == advantage_from_state(state, prior=prior, delta=0.1)


def test_torch_float32_batches_equal_numpy():
    m, h = data(3)
    m32, h32 = m.astype(np.float32), h.astype(np.float32)
    a = StreamingAdvantage(low=-6, high=6)
    a.update(m32, h32)
    b = StreamingAdvantage(low=-6, high=6)
    b.update(torch.from_numpy(m32[:700]), torch.from_numpy(h32[:10]))
    b.update(torch.from_numpy(m32[700:]), torch.from_numpy(h32[10:]))
    assert_same_state(a.state, b.state)
    assert a.compute() == b.compute()


# ----------------------------------------------------------------------------- grid, overflow


def test_grid_fixed_by_first_batch_with_margin():
    s = BinnedScores(bins=10, margin=0.1)
    s.update(np.array([0.0, 0.9]), np.array([2.0]))
    assert float(s.low) == pytest.approx(-0.2)
    assert float(s.high) == pytest.approx(2.2)
    assert s.dim == 1 and s.bins == (10,)
    np.testing.assert_allclose(s.width.numpy(), [0.24], rtol=1e-12)
    assert s.n_overflow.tolist() == [0, 0]
    s.update(np.array([5.0, -1.0, 2.2, -0.2]), None)  # two outside, two on the edges
    assert s.n_overflow.tolist() == [2, 0]
    assert s.n_seen.tolist() == [6, 1]
    counts = s.class_counts()
    # overflow records land in the edge bins; edges are inside ([low, high] closed)
    assert counts[0].tolist() == [3, 0, 0, 0, 1, 0, 0, 0, 0, 2]
    assert counts[1].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]


def test_flat_first_batch_gets_a_unit_wide_grid():
    s = BinnedScores(bins=4)
    s.update(np.full(3, 2.0), np.full(2, 2.0))
    # [x - 0.5, x + 0.5], then widened by the default margin 0.1 of its width on each side
    assert float(s.low) == pytest.approx(1.4) and float(s.high) == pytest.approx(2.6)
    assert s.class_counts()[:, 2].tolist() == [3, 2]


def test_overflow_counted_per_class():
    s = BinnedScores(low=0.0, high=1.0, bins=5)
    s.update(np.array([-1.0, 0.0, 0.5, 1.0, 2.0]), np.array([3.0, 0.2, -0.01]))
    assert s.n_overflow.tolist() == [2, 2]
    assert s.n_seen.tolist() == [5, 3]
    assert s.class_counts().sum(dim=1).tolist() == [5, 3]


def test_2d_cell_index_row_major():
    s = BinnedScores(low=[0.0, 0.0], high=[1.0, 2.0], bins=(2, 4))
    x = torch.tensor([[0.1, 0.1], [0.1, 1.9], [0.9, 0.6], [1.0, 2.0], [-5.0, 3.0]])
    cell, inside = s.cell_index(x.double())
    assert cell.tolist() == [0, 3, 5, 7, 3]
    assert inside.tolist() == [True, True, True, True, False]


# ----------------------------------------------------------------------------- NaN accounting


# regression: torch.from_numpy rejected negative strides
def test_update_accepts_reversed_numpy_view():
    x = np.linspace(0.0, 1.0, 11)
    a, b = BinnedScores(low=0, high=1), BinnedScores(low=0, high=1)
    a.update(x[::-1].copy(), x)
    b.update(x[::-1], x)
    assert torch.equal(a.class_counts(), b.class_counts())


def test_nan_rows_dropped_and_counted():
    m, h = data(4)
    mm = np.concatenate([m[:10], [np.nan, np.inf], m[10:]])
    hh = np.concatenate([[-np.inf], h])
    clean = StreamingAdvantage(low=-6, high=6)
    clean.update(m, h)
    dirty = StreamingAdvantage(low=-6, high=6)
    dirty.update(mm, hh)
    dirty.update(np.array([np.nan, np.nan]), None)  # all-NaN batch: counted, nothing binned
    assert dirty.state.n_dropped.tolist() == [4, 1]
    assert torch.equal(dirty.state.counts, clean.state.counts)
    assert dirty.compute().as_dict() == clean.compute().as_dict() | {"n_dropped": 5}


def test_all_nan_first_batch_does_not_fix_the_grid():
    s = BinnedScores(bins=10, margin=0.0)
    s.update(np.array([np.nan, np.nan, np.nan]), None)
    assert not s.initialized
    assert s.n_dropped.tolist() == [3, 0]
    s.update(np.array([0.0, 1.0]), np.array([0.5]))
    assert float(s.low) == 0.0 and float(s.high) == 1.0
    assert s.n_dropped.tolist() == [3, 0]


# ----------------------------------------------------------------------------- moments


def test_moments_equal_numpy():
    m, h = data(5, d=2)
    s = BinnedScores(bins=20)
    s.update(m, h)
    n, mean, cov = s.moments()
    assert n.tolist() == [len(m), len(h)]
    np.testing.assert_allclose(mean[0].numpy(), m.mean(0), rtol=1e-12)
    np.testing.assert_allclose(cov[1].numpy(), np.cov(h.T), rtol=1e-9)
    folds = fold_of(torch.arange(len(m)), 4).numpy()
    sel = np.isin(folds, [0, 2])
    n02, mean02, cov02 = s.moments([0, 2])
    assert int(n02[0]) == sel.sum()
    np.testing.assert_allclose(mean02[0].numpy(), m[sel].mean(0), rtol=1e-12)
    np.testing.assert_allclose(cov02[0].numpy(), np.cov(m[sel].T), rtol=1e-9)


# ----------------------------------------------------------------------------- merge


@pytest.mark.parametrize("method", METHODS)
def test_merge_counts_equal_combined_state(method):
    m, h = data(6)
    kw = {"method": method, "low": -6.0, "high": 7.0}
    a, b, both = (StreamingAdvantage(**kw) for _ in range(3))
    a.update(m[:600], h[:200])
    b.update(m[600:], h[200:])
    both.update(m, h)
    assert a.merge_(b) is a
    assert torch.equal(a.state.class_counts(), both.state.class_counts())
    assert a.state.n_seen.tolist() == [len(m), len(h)]
    np.testing.assert_allclose(a.state.sum1.sum(1), both.state.sum1.sum(1), rtol=1e-12)
    np.testing.assert_allclose(a.state.sum2.sum(1), both.state.sum2.sum(1), rtol=1e-12)
    # each state numbers its own records (fold ids restart per rank): per-fold counts, value and
    # lower may differ from one stream, but everything computed from class totals agrees
    merged, single = a.compute(), both.compute()
    assert merged.plugin == pytest.approx(single.plugin, abs=1e-12)
    assert merged.halfwidth == single.halfwidth
    assert merged.upper == pytest.approx(single.upper, abs=1e-12)
    assert (merged.n_members, merged.n_nonmembers) == (len(m), len(h))
    assert merged.value == pytest.approx(single.value, abs=0.03)


def test_merge_equals_state_with_both_batches_per_fold():
    """Merging is adding: state(A) + state(B) == counts of A and B each binned from index 0."""
    m, h = data(7)
    a, b = BinnedScores(low=-6, high=7), BinnedScores(low=-6, high=7)
    a.update(m[:500], h[:500])
    b.update(m[500:], h[500:])
    ref_a, ref_b = BinnedScores(low=-6, high=7), BinnedScores(low=-6, high=7)
    ref_a.update(m[:500], h[:500])
    ref_b.update(m[500:], h[500:])
    ab = BinnedScores(low=-6, high=7).merge_(a).merge_(b)
    ba = BinnedScores(low=-6, high=7).merge_(b).merge_(a)
    for name in ("counts", "n_seen", "n_dropped", "n_overflow"):
        expected = getattr(ref_a, name) + getattr(ref_b, name)
        assert torch.equal(getattr(ab, name), expected)
        assert torch.equal(getattr(ba, name), expected)
    assert advantage_from_state(ab) == advantage_from_state(ba)


def test_merge_into_uninitialized_and_with_uninitialized():
    m, h = data(8)
    a = BinnedScores()
    a.update(m, h)
    empty = BinnedScores()
    empty.merge_(a)
    assert_same_state(empty, a)
    before = a.counts.clone()
    a.merge_(BinnedScores())
    assert torch.equal(a.counts, before)
    empty.counts += 1  # a copy, not a view of a's tensors
    assert torch.equal(a.counts, before)


# regression: merge_ lost n_dropped of a state that had seen only NaN batches
def test_merge_keeps_dropped_counts_of_uninitialized_state():
    m, h = data(9)
    full = BinnedScores()
    full.update(m, h)
    only_nan = BinnedScores()
    only_nan.update(np.array([np.nan, np.nan]), np.array([np.inf]))
    assert only_nan.n_dropped.tolist() == [2, 1]
    a = BinnedScores().merge_(full)
    a.merge_(only_nan)
    assert a.n_dropped.tolist() == [2, 1]
    only_nan.merge_(full)
    assert only_nan.n_dropped.tolist() == [2, 1]


def test_merge_mismatched_grids_raise():
    a, b = BinnedScores(low=0, high=1), BinnedScores(low=0, high=2)
    a.update([0.5], [0.5])
    b.update([0.5], [0.5])
    with pytest.raises(ValueError, match="grid"):
        a.merge_(b)
    c = BinnedScores(low=0, high=1, bins=50)
    c.update([0.5], [0.5])
    with pytest.raises(ValueError, match="grid"):
        a.merge_(c)
    d = BinnedScores(low=0, high=1, folds=5)
    d.update([0.5], [0.5])
    with pytest.raises(ValueError, match="folds"):
        a.merge_(d)


# ----------------------------------------------------------------------------- persistence


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("d", [1, 2])
def test_state_dict_round_trip_through_torch_save(method, d, tmp_path):
    m, h = data(10, d=d)
    est = StreamingAdvantage(method=method, dim=d, prior=0.4)
    stream(est, m, h)
    ref = est.compute()
    # in memory
    fresh = StreamingAdvantage(method=method, dim=d, prior=0.4)
    fresh.load_state_dict(est.state_dict())
    assert fresh.compute() == ref
    # through a file, loaded with weights_only=True (plain tensors / numbers / strings only)
    path = tmp_path / "state.pt"
    torch.save(est.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    again = StreamingAdvantage(method=method, dim=d, prior=0.4)
    again.load_state_dict(loaded)
    assert again.compute() == ref
    assert_same_state(again.state, est.state)
    # the loaded state is independent of the saved one
    est.update(m[:5], h[:5])
    assert again.compute() == ref


def test_resume_after_load_continues_the_stream():
    m, h = data(11)
    full = StreamingAdvantage()
    full.update(m[:400], h[:300])
    full.update(m[400:], h[300:])
    part = StreamingAdvantage()
    part.update(m[:400], h[:300])
    resumed = StreamingAdvantage()
    resumed.load_state_dict(part.state_dict())
    resumed.update(m[400:], h[300:])  # fold ids continue from n_seen
    assert_same_state(resumed.state, full.state)
    assert resumed.compute() == full.compute()


def test_uninitialized_state_dict_round_trip(tmp_path):
    s = BinnedScores()
    s.update(np.array([np.nan]), None)
    path = tmp_path / "s.pt"
    torch.save(s.state_dict(), path)
    t = BinnedScores()
    t.load_state_dict(torch.load(path, weights_only=True))
    assert not t.initialized
    assert t.n_dropped.tolist() == [1, 0]


def test_load_state_dict_mismatch_raises():
    est = StreamingAdvantage(prior=0.5)
    est.update(*data(12))
    sd = est.state_dict()
    with pytest.raises(ValueError, match="prior"):
        StreamingAdvantage(prior=0.3).load_state_dict(sd)
    with pytest.raises(ValueError, match="method"):
        StreamingAdvantage(method="kde").load_state_dict(sd)
    with pytest.raises(ValueError, match="folds"):
        BinnedScores(folds=6).load_state_dict(sd["state"])
    bad = dict(sd["state"], counts=sd["state"]["counts"][:, :, :10])
    with pytest.raises(ValueError, match="counts"):
        BinnedScores().load_state_dict(bad)


def test_reset_keeps_grid_and_zeroes_counts():
    est = StreamingAdvantage()
    est.update(*data(13))
    low = est.state.low.clone()
    est.reset()
    assert torch.equal(est.state.low, low)
    for name in STATE_FIELDS:
        assert not getattr(est.state, name).any(), name
    with pytest.raises(ValueError, match="member"):
        est.compute()


# ----------------------------------------------------------------------------- folds


@pytest.mark.parametrize("order", ["random", "sorted"])
def test_fold_assignment_balanced(order):
    x = np.random.default_rng(14).normal(size=10_000)
    if order == "sorted":
        x = np.sort(x)
    s = BinnedScores(bins=50)
    for i in range(0, 10_000, 1234):  # in batches
        s.update(x[i : i + 1234], x[i : i + 1234][::-1].copy())
    per_fold = s.counts.sum(dim=2)  # (class, fold)
    assert per_fold.sum().item() == 20_000
    frac = per_fold / 10_000
    assert torch.all((frac - 0.25).abs() <= 0.02), frac
    # each fold is spread over the whole (sorted) stream, not a contiguous block
    fold_means = s.sum1[0, :, 0] / per_fold[0]
    assert torch.all((fold_means - x.mean()).abs() < 0.05), fold_means


def test_fold_of_depends_only_on_position():
    idx = torch.arange(50_000)
    f = fold_of(idx, 4)
    assert f.min() >= 0 and f.max() <= 3
    counts = torch.bincount(f, minlength=4)
    assert torch.all((counts - 12_500).abs() <= 250)
    assert torch.equal(fold_of(idx[1000:2000], 4), f[1000:2000])
    assert fold_of(torch.arange(100), 7).max() <= 6


# ----------------------------------------------------------------------------- bad input


def test_dimension_mismatch_raises():
    s = BinnedScores()
    s.update(np.zeros(5) + np.arange(5), np.arange(3.0))
    with pytest.raises(ValueError, match="member_scores has 2 dimensions"):
        s.update(np.zeros((4, 2)), None)
    with pytest.raises(ValueError, match="nonmember_scores"):
        s.update(None, np.zeros((4, 3)))
    with pytest.raises(ValueError, match="same dimension"):
        BinnedScores().update(np.zeros((3, 2)), np.zeros(3))
    est = StreamingAdvantage(low=[0, 0], high=[1, 1], dim=2)
    with pytest.raises(ValueError, match="dimensions"):
        est.update(np.zeros(3), np.zeros(3))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"folds": 3}, "folds"),
        ({"folds": 4.5}, "folds"),
        ({"bins": 0}, "bins"),
        ({"bins": (10, 0)}, "bins"),
        ({"bins": ()}, "bins"),
        ({"bins": True}, "bins"),
        ({"margin": -0.1}, "margin"),
        ({"margin": float("nan")}, "margin"),
        ({"margin": float("inf")}, "margin"),
        ({"low": 0.0}, "low and high"),
        ({"high": 1.0}, "low and high"),
        ({"low": 1.0, "high": 1.0}, "high must be greater"),
        ({"low": [0.0, 0.0], "high": [1.0]}, "one value per dimension"),
        ({"low": [0.0, 0.0], "high": [1.0, 1.0], "bins": (5, 5, 5)}, "one value per dimension"),
        ({"bins": (4096, 4096), "low": [0, 0], "high": [1, 1]}, str(MAX_CELLS)),
    ],
)
def test_binned_scores_bad_configuration(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BinnedScores(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"dim": 3}, "dim"),
        ({"dim": 0}, "dim"),
        ({"dim": True}, "dim"),
        ({"prior": 1.0}, "prior"),
        ({"prior": float("nan")}, "prior"),
        ({"delta": 0.0}, "delta"),
        ({"method": "Histogram"}, "method"),
        ({"bandwidth": "wide"}, "bandwidth"),
        ({"folds": 2}, "folds"),
    ],
)
def test_streaming_advantage_bad_configuration(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StreamingAdvantage(**kwargs)


def test_compute_without_both_classes_raises():
    with pytest.raises(ValueError, match="no scores"):
        StreamingAdvantage().compute()
    est = StreamingAdvantage()
    est.update(np.arange(5.0), None)
    with pytest.raises(ValueError, match="non-member"):
        est.compute()
    est2 = StreamingAdvantage()
    est2.update(None, np.arange(5.0))
    with pytest.raises(ValueError, match="member"):
        est2.compute()


# --- coarsening, order statistics ---------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2])
def test_coarsened_state_equals_binning_on_the_coarse_grid(d):
    m, h = data(11, d=d)
    # dyadic edges: the fine and the coarse cell of every score agree exactly in floating point
    lo, hi = [-8.0] * d, [8.0] * d
    fine = BinnedScores(bins=[40, 20][:d], low=lo, high=hi)
    fine.update(m, h)
    coarse = BinnedScores(bins=[8, 5][:d], low=lo, high=hi)
    coarse.update(m, h)
    got = fine.coarsen([5, 4][:d])
    assert got.bins == coarse.bins
    for name in ("counts", "sum1", "sum2", "n_seen", "n_dropped", "n_overflow"):
        assert torch.equal(getattr(got, name), getattr(coarse, name)), name
    assert torch.equal(got.width, coarse.width)
    assert fine.counts.sum() == got.counts.sum()  # the fine state is left as it was


def test_coarsen_rejects_factors_that_do_not_divide_the_bins():
    state = BinnedScores(bins=100, low=0.0, high=1.0)
    with pytest.raises(ValueError, match="factor must be a positive integer"):
        state.coarsen(3)
    with pytest.raises(ValueError, match="factor"):
        state.coarsen(0)
    with pytest.raises(ValueError, match="no scores yet"):
        BinnedScores(bins=100).coarsen(2)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 101, 4000])
def test_robust_range_order_statistics_equal_torch(n):
    from privmon.estimators.order_statistics import column_quantiles

    x = torch.from_numpy(np.random.default_rng(n).standard_t(2, size=(n, 2)))
    (q1, q3), (lo, hi) = column_quantiles(x, (0.25, 0.75), extra=(0, n - 1))
    assert torch.equal(q1, torch.quantile(x, 0.25, dim=0))
    assert torch.equal(q3, torch.quantile(x, 0.75, dim=0))
    assert torch.equal(lo, x.min(dim=0).values) and torch.equal(hi, x.max(dim=0).values)
    x_np = x.numpy().copy()
    robust_range(x)
    np.testing.assert_array_equal(x.numpy(), x_np)  # the caller's scores are not reordered
