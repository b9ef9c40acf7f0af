"""PrivacyMonitor: a check never changes training, reports the right figures, survives failures."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingSink
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import privmon
from privmon._digest import sealed
from privmon.callbacks import PrivacyEarlyStopping, PrivacyMonitor
from privmon.estimators.binned_scores import BinnedScores
from privmon.estimators.smoothing import kde_grid_too_coarse
from privmon.queries import CallableQuery, LossQuery


def _data(seed=0, n=240, d=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()
    return x, y


def _batches(x, y, size=40):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def _net(d=8):
    return nn.Sequential(
        nn.Linear(d, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2)
    )


def _noisy_query(model):
    """A query that draws from every global RNG: the monitor must restore them all."""

    def fn(batch):
        x, y = batch
        random.random()
        np.random.rand()  # noqa: NPY002
        noise = 1e-3 * torch.randn(len(x))
        return F.cross_entropy(model(x), y, reduction="none") + noise

    return CallableQuery(fn, name="noisy_loss", modules=model)


def _train(monitor_on: bool, steps=30):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)  # noqa: NPY002
    x, y = _data()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[:120], y[:120]), batch_size=20, shuffle=True
    )
    mon = None
    if monitor_on:
        mon = PrivacyMonitor(
            [_noisy_query(model), LossQuery(model)],
            loader,  # a shuffling DataLoader: iterating it draws from the torch RNG
            _batches(x[120:], y[120:]),
            every_n_steps=5,
            strict=True,
        )
    step = 0
    while step < steps:
        for xb, yb in loader:
            step += 1
            loss = F.cross_entropy(model(xb), yb) + 1e-3 * torch.randn(()).abs()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step(step)
            if step >= steps:
                break
    return model, opt, mon, (random.random(), np.random.rand(), torch.rand(1))  # noqa: NPY002


def test_training_is_bit_identical_with_and_without_the_monitor():
    m0, o0, _, rng0 = _train(False)
    m1, o1, mon, rng1 = _train(True)
    assert len(mon.history) == 6
    for (k, a), (_, b) in zip(m0.state_dict().items(), m1.state_dict().items(), strict=True):
        assert torch.equal(a, b), k  # weights and BatchNorm statistics
    for s0, s1 in zip(
        o0.state_dict()["state"].values(), o1.state_dict()["state"].values(), strict=True
    ):
        assert torch.equal(s0["momentum_buffer"], s1["momentum_buffer"])
    assert rng0[0] == rng1[0] and rng0[1] == rng1[1] and torch.equal(rng0[2], rng1[2])
    assert m1.training  # mode restored


def test_training_is_bit_identical_under_opacus():
    opacus = pytest.importorskip("opacus")

    def run(monitor_on):
        torch.manual_seed(1)
        x, y = _data(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x[:120], y[:120]), batch_size=20
        )
        engine = opacus.PrivacyEngine(accountant="rdp")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        mon = None
        if monitor_on:
            mon = PrivacyMonitor(
                [_noisy_query(model)],
                _batches(x[:120], y[:120]),
                _batches(x[120:], y[120:]),
                every_n_steps=3,
                accountant=engine,
                strict=True,
            )
        step = 0
        for _ in range(2):
            for xb, yb in loader:
                if len(xb) == 0:
                    continue
                step += 1
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                if mon is not None:
                    mon.step(step)
        return model, engine, mon

    m0, e0, _ = run(False)
    m1, e1, mon = run(True)
    assert mon.history and all(r.epsilon is not None for r in mon.history)
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(a, b)
    assert e0.accountant.history == e1.accountant.history
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(a.grad_sample, b.grad_sample)  # Opacus state untouched by checks
    assert mon.history[-1].epsilon == pytest.approx(e1.get_epsilon(1e-5))


def test_report_figures_equal_the_functional_estimators():
    torch.manual_seed(0)
    x, y = _data(2)
    model = _net()
    query = LossQuery(model)
    mon = PrivacyMonitor(
        query,
        _batches(x[:120], y[:120]),
        _batches(x[120:], y[120:]),
        strict=True,
        interval_delta=0.1,
    )
    rep = mon.check(7)
    model.eval()
    with torch.no_grad():
        mem = F.cross_entropy(model(x[:120]), y[:120], reduction="none")
        non = F.cross_entropy(model(x[120:]), y[120:], reduction="none")
    for method in ("histogram", "kde"):
        est = privmon.optimal_advantage(mem, non, method=method, delta=0.1)
        assert rep.scalars[f"privacy/loss/{method}/value"] == pytest.approx(est.value)
        assert rep.scalars[f"privacy/loss/{method}/lower_check"] == pytest.approx(est.lower)
        assert rep.queries["loss"].estimates[method].plugin == pytest.approx(est.plugin)
    # loss: members score lower, so the AUC is read with the sign flipped
    assert rep.scalars["privacy/loss/auc"] == pytest.approx(privmon.auc(-mem, -non))
    offline = privmon.analyse(mem, non, delta=0.1)  # out of sample, as checks read it
    risk = offline.member_risk
    np.testing.assert_allclose(rep.queries["loss"].member_risk, risk)
    np.testing.assert_allclose(rep.queries["loss"].member_posterior, offline.member_posterior)
    assert rep.queries["loss"].top_records[0] == int(np.argmax(offline.member_posterior))
    assert rep.scalars["privacy/loss/risk/max"] == pytest.approx(risk.max())
    assert rep.step == 7 and rep.epsilon is None and not rep.dp_violation


@pytest.mark.parametrize("shape", ["gaussian", "memorised"])
def test_shared_binning_pass_equals_the_functional_estimators(shape):
    # 1-D: the monitor bins once on the KDE's 2000-cell grid and sums cells for the histogram.
    # Gaussian scores keep the KDE on the grid; member losses squeezed near 0 beside spread-out
    # non-member losses give a member bandwidth below one cell: the exact KDE path.
    rng = np.random.default_rng(3)
    mem = rng.normal(0.3, 1.0, 1500)
    non = rng.normal(0.0, 1.0, 1300)
    if shape == "memorised":
        mem, non = np.abs(0.001 * mem), rng.exponential(3.0, 1300)
    query = CallableQuery(lambda b: torch.as_tensor(b), name="s", higher_is_member=True)
    mon = PrivacyMonitor(
        query, np.array_split(mem, 3), np.array_split(non, 2), strict=True, interval_delta=0.1
    )
    rep = mon.check(1)
    pooled = torch.as_tensor(np.concatenate([mem, non]))[:, None]
    grid = BinnedScores(bins=2000, margin=0.0)
    grid.update(torch.as_tensor(mem)[:, None], torch.as_tensor(non)[:, None])
    ns, _, covs = grid.moments()
    width = (pooled.amax(dim=0) - pooled.amin(dim=0)) / 2000
    assert kde_grid_too_coarse(ns, covs, width, "scott") == (shape == "memorised")
    for method in ("histogram", "kde"):
        est = privmon.optimal_advantage(mem, non, method=method, delta=0.1)
        got = rep.queries["s"].estimates[method]
        for field in ("value", "plugin", "upper"):
            assert getattr(got, field) == pytest.approx(getattr(est, field), abs=1e-12)
        assert got.lower_check == pytest.approx(est.lower, abs=1e-12)
    risk = privmon.analyse(mem, non, delta=0.1).member_risk  # out of sample, as checks read it
    np.testing.assert_allclose(rep.queries["s"].member_risk, risk)
    for q in (50, 90, 99):
        assert rep.scalars[f"privacy/s/risk/q{q}"] == pytest.approx(np.quantile(risk, q / 100))
    assert rep.scalars["privacy/s/auc"] == pytest.approx(privmon.auc(mem, non))


def test_a_failing_check_is_logged_and_skipped(caplog):
    x, y = _data()
    model = _net()

    def broken(batch):
        raise RuntimeError("query exploded")

    mon = PrivacyMonitor(
        CallableQuery(broken, name="bad", modules=model),
        _batches(x[:120], y[:120]),
        _batches(x[120:], y[120:]),
        every_n_steps=1,
    )
    model.train()
    with caplog.at_level(logging.ERROR, logger="privmon"):
        assert mon.step(3) is False
    assert mon.n_failed == 1 and mon.history == []
    assert "step 3" in caplog.text and "query exploded" in caplog.text
    assert model.training  # restored even though the query raised
    strict = PrivacyMonitor(
        CallableQuery(broken, name="bad", modules=model),
        _batches(x[:120], y[:120]),
        _batches(x[120:], y[120:]),
        strict=True,
    )
    with pytest.raises(RuntimeError, match="query exploded"):
        strict.check(1)


def test_nan_scores_are_dropped_and_counted():
    x, y = _data()

    def fn(batch):
        xb, _ = batch
        s = xb[:, 0].clone()
        s[:3] = float("nan")
        return s

    mon = PrivacyMonitor(
        CallableQuery(fn, name="q"),
        _batches(x[:120], y[:120]),
        _batches(x[120:], y[120:]),
        strict=True,
    )
    rep = mon.check(0)
    assert rep.scalars["privacy/q/n_dropped"] == 3 * 6  # 3 per batch, 3 + 3 batches
    assert np.isnan(rep.queries["q"].member_risk).sum() == 9


def test_history_keeps_the_last_report_whole_and_earlier_ones_as_figures():
    x, y = _data()
    model = _net()

    mon = PrivacyMonitor(
        LossQuery(model),
        _batches(x[:120], y[:120]),
        _batches(x[120:], y[120:]),
        every_n_steps=1,
        strict=True,
        methods=("histogram",),
        sinks=(keep := RecordingSink()),
    )
    for s in range(1, 5):
        mon.step(s)
    assert [r.step for r in mon.history] == [1, 2, 3, 4] and mon.history.steps.tolist() == [
        1,
        2,
        3,
        4,
    ]
    assert mon.history[-1] is keep.reports[-1]  # the latest: per-query results and arrays
    assert mon.history[-1].queries["loss"].member_risk is not None
    for kept, full in zip(mon.history[:-1], keep.reports[:-1], strict=True):
        assert kept.queries == {}  # earlier checks: their figures only
        assert kept.scalars.keys() == full.scalars.keys()
        for tag, value in full.scalars.items():  # to float32 precision
            assert kept.scalars[tag] == pytest.approx(value, rel=1e-7, abs=1e-30), tag
    values = mon.history.column("privacy/loss/histogram/value")
    assert values == pytest.approx(
        [r.scalars["privacy/loss/histogram/value"] for r in keep.reports]
    )
    assert mon.step(4) is False and len(mon.history) == 4  # a step is checked once
    assert mon.step(3) is False and len(mon.history) == 4  # and never an earlier one again


def test_early_stopping_and_state_round_trip(tmp_path):
    x, y = _data()
    model = _net()

    def make():
        return PrivacyMonitor(
            LossQuery(model),
            _batches(x[:120], y[:120]),
            _batches(x[120:], y[120:]),
            every_n_steps=2,
            methods=("histogram",),
            strict=True,
            early_stopping=PrivacyEarlyStopping("privacy/loss/auc", 0.0, patience=1),  # AUC > 0
        )

    mon = make()
    assert mon.step(2) is False  # first exceedance: patience 1
    assert mon.step(4) is True
    assert mon.early_stopping.stopped_step == 4
    path = tmp_path / "monitor.pt"
    torch.save(mon.state_dict(), path)
    fresh = make()
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.should_stop and [r.step for r in fresh.history] == [2, 4]
    assert list(fresh.history) == list(fresh.history.from_state_dict(mon.history.state_dict()))
    assert fresh.history[-1].scalars == pytest.approx(mon.history[-1].scalars, rel=1e-7)
    assert fresh.step(4) is True and len(fresh.history) == 2  # no duplicate step after resume
    # one run id per run, on every report, kept by a resume; another monitor is another run
    assert len(mon.run_id) == 32 and make().run_id != mon.run_id
    assert fresh.run_id == mon.run_id
    assert {r.run_id for r in mon.history} == {r.run_id for r in fresh.history} == {mon.run_id}
    assert mon.history[-1].to_json()["run_id"] == mon.run_id
    state = mon.state_dict()
    with pytest.raises(ValueError, match="run_id must be a non-empty string"):
        make().load_state_dict(sealed({**state, "run_id": ""}))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"prior": 1.0}, "prior"),
        ({"delta": 0.0}, "delta"),
        ({"interval_delta": 2.0}, "interval_delta"),
        ({"methods": ("hist",)}, "methods"),
        ({"max_batches": 0}, "max_batches"),
        ({"accountant": object()}, "accountant"),
        ({"early_stopping": "yes"}, "early_stopping"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs, match):
    x, y = _data()
    with pytest.raises(ValueError, match=match):
        PrivacyMonitor(LossQuery(_net()), _batches(x, y), _batches(x, y), **kwargs)


def test_max_batches_limits_the_audit():
    x, y = _data()
    seen = []

    def fn(batch):
        seen.append(len(batch[0]))
        return batch[0][:, 0]

    mon = PrivacyMonitor(
        CallableQuery(fn, name="q"),
        _batches(x[:120], y[:120]),
        _batches(x[120:], y[120:]),
        max_batches=2,
        strict=True,
    )
    rep = mon.check(0)
    assert seen == [40, 40, 40, 40]
    assert rep.queries["q"].estimates["histogram"].n_members == 80


def test_per_record_risk_is_tracked_across_checks(tmp_path):
    x, y = _data()

    def fn(batch):
        xb, _ = batch
        return xb[:, 0]

    members, nonmembers = _batches(x[:120], y[:120]), _batches(x[120:], y[120:])
    mon = PrivacyMonitor(
        CallableQuery(fn, name="q"),
        members,
        nonmembers,
        every_n_steps=1,
        methods=("histogram",),
        strict=True,
    )
    posteriors = []
    for s in (1, 2, 3):
        rep = mon.check(s)
        posteriors.append(rep.queries["q"].member_posterior)
    stacked = np.vstack(posteriors)  # a deterministic query: every check, the same posteriors
    assert np.array_equal(stacked[0], stacked[2])
    top = mon.top_records(5)
    expected = np.argsort(-stacked.max(axis=0), kind="stable")[:5]
    assert [i for i, _ in top] == expected.tolist()
    assert [r for _, r in top] == pytest.approx(stacked.max(axis=0)[expected].tolist())
    peak = stacked.max(axis=0)
    assert top.tied_beyond == int((peak == peak[expected[-1]]).sum()) - int(
        (peak[expected] == peak[expected[-1]]).sum()
    )
    last, mean = mon.top_records(3, by="last"), mon.top_records(3, by="mean")
    assert [i for i, _ in last] == [i for i, _ in mean]
    assert [r for _, r in last] == pytest.approx([r for _, r in mean], abs=1e-12)
    path = mon.export_records(tmp_path / "risk.csv")
    rows = (tmp_path / "risk.csv").read_text().splitlines()
    assert rows[0] == "query,index,last_posterior,max_posterior,max_step,mean_posterior,checks"
    assert len(rows) == 121 and path.endswith("risk.csv")
    first = rows[1].split(",")
    assert first[:2] == ["q", "0"] and int(first[-1]) == 3 and int(first[4]) == 1
    assert float(first[3]) == pytest.approx(stacked[0, 0], rel=1e-5)
    # raw scores (x[:, 0]) never reach the CSV: only indices and risks
    assert f"{float(x[0, 0]):.6g}" not in rows[1]
    # the tracks survive a checkpoint
    path = tmp_path / "m.pt"
    torch.save(mon.state_dict(), path)
    fresh = PrivacyMonitor(
        CallableQuery(fn, name="q"), members, nonmembers, methods=("histogram",), strict=True
    )
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.top_records(5) == top
    with pytest.raises(ValueError, match="by"):
        mon.top_records(3, by="median")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0, float("nan")]), max_size=40),
    st.integers(0, 45),
)
def test_most_exposed_equals_a_stable_sort(risks, k):
    from privmon.estimators.risk import most_exposed as _most_exposed

    risk = np.asarray(risks, dtype=np.float64)
    order = np.argsort(-np.nan_to_num(risk, nan=-1.0), kind="stable")
    assert _most_exposed(risk, k) == tuple(int(i) for i in order[:k])


def test_any_callable_is_a_query():
    # A lambda and a plain function are queries: named query / <__name__>, and they measure
    # exactly what the same function wrapped in a CallableQuery measures.
    x, y = _data()
    model = _net()
    model.eval()

    def per_record_loss(batch):
        xb, yb = batch
        return F.cross_entropy(model(xb), yb, reduction="none")

    members, nonmembers = _batches(x[:120], y[:120]), _batches(x[120:], y[120:])
    mon = PrivacyMonitor(
        [lambda b: model(b[0])[:, 1], per_record_loss], members, nonmembers, modules=[model]
    )
    assert [q.name for q in mon.queries] == ["query", "per_record_loss"]
    rep = mon.check(1)
    wrapped = PrivacyMonitor(
        CallableQuery(per_record_loss, name="per_record_loss", modules=model),
        members,
        nonmembers,
    ).check(1)
    # δ is split over 2 queries there, 1 here
    run_level = ("/lower", "/epsilon_lower_bound", "/detectable")
    compared = [
        t for t in wrapped.scalars if t.startswith("privacy/per_record_loss/")
        and not t.endswith(run_level)
    ]  # fmt: skip
    assert len(compared) > 10
    for tag in compared:
        assert rep.scalars[tag] == pytest.approx(wrapped.scalars[tag], abs=1e-12), tag
    with pytest.raises(ValueError, match=r"privmon\.queries"):
        PrivacyMonitor("loss", members, nonmembers)


def test_history_reads_figures_back_as_their_shortest_decimal_pads_absent_tags_and_keeps_notes():
    from privmon.callbacks.history import ReportHistory
    from privmon.report import Report

    history = ReportHistory()
    history.append(Report(step=1, scalars={"a": 0.563}, failures={"q": "exploded"}))
    history.append(Report(step=2, scalars={"a": 0.25, "b": 1 / 3}, messages=("violation",)))
    history.append(Report(step=3, scalars={"b": 0.1}))
    first, second, _ = history  # the last is kept whole; the others are rebuilt
    assert first.scalars == {"a": 0.563}  # float32 storage, read back as the shortest decimal
    assert second.scalars == {"a": 0.25, "b": 0.33333334}
    assert first.failures == {"q": "exploded"} and first.messages == ()
    assert second.messages == ("violation",) and second.failures == {}
    np.testing.assert_array_equal(history.column("a"), [0.563, 0.25, np.nan])  # absent: NaN
    np.testing.assert_array_equal(history.column("b"), [np.nan, 0.33333334, 0.1])
    restored = ReportHistory.from_state_dict(history.state_dict())
    assert [r.failures for r in restored] == [{"q": "exploded"}, {}, {}]
    assert restored[0].scalars == {"a": 0.563}
    # a read-only sequence of reports
    assert [r.step for r in history[-2:]] == [2, 3] and history[-3].step == 1
    for index in (3, -4):
        with pytest.raises(IndexError, match=f"history index {index} out of range for 3 checks"):
            history[index]
    assert repr(history) == "ReportHistory(3 checks)"
    assert (history == 3) is False and history != "x" and history == list(history)
    assert history != list(history)[:2] and history != [*history[:2], first]
    with pytest.raises(KeyError, match="no check reported 'c'"):
        history.column("c")
    same = ReportHistory()
    for step in (1, 2, 3):
        same.append(Report(step=step, scalars={"a": 1.0}))
    assert len(same.state_dict()["tagsets"]) == 1  # one tag set, however many checks
