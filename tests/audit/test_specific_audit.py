"""Tests for privmon.audit.specific: the specific / average setups and their §3.4 comparison.

Planted settings with a known answer (a "model" that memorises its training set, a model that
ignores its data), the exact training sets handed to train_fn, determinism from the seed, the
untouched global RNG, hand-made comparison arrays against scipy, argument errors, and one short
real training run.
"""

# The legacy numpy global RNG is exercised on purpose: the audit must leave it untouched.
# ruff: noqa: NPY002

from __future__ import annotations

import io
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import pearsonr
from torch import nn
from torch.utils.data import TensorDataset

from privmon.audit.results import AuditResult, SetupComparison, compare
from privmon.audit.specific import average, default_score, specific

ROOT = Path(__file__).resolve().parents[2]


# --- planted models -------------------------------------------------------------------------------


def _key(row: torch.Tensor) -> bytes:
    return row.numpy().tobytes()


def memorise(x, y, seed):
    """A 'model' that remembers exactly the records it was trained on."""
    return {_key(r) for r in x}


def lookup_score(model, x, y):
    """Scores 1 for a record in the model's training set, 0 otherwise (a perfect attack)."""
    return np.array([1.0 if _key(r) in model else 0.0 for r in x])


def ignore_data(x, y, seed):
    """A 'model' independent of its data: a random state drawn from the (seeded) global RNG."""
    return int(np.random.randint(0, 2**31 - 1))


def random_score(model, x, y):
    return np.random.default_rng(model).standard_normal(len(x))


def _data(n=40, n_ref=30, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.normal(size=(n, d)))
    y = torch.tensor(rng.integers(0, 3, n))
    rx = torch.tensor(rng.normal(size=(n_ref, d)))
    ry = torch.tensor(rng.integers(0, 3, n_ref))
    return (x, y), (rx, ry)


# --- the planted answers --------------------------------------------------------------------------


@pytest.mark.parametrize("reference_draw", ["per_model", "fixed"])
def test_memorising_model_gives_auc_one_for_every_target(reference_draw):
    data, ref = _data()
    targets = [0, 5, 9, 17, 33]
    r = specific(
        memorise,
        data,
        targets,
        n_models=12,
        seed=3,
        reference=ref,
        score_fn=lookup_score,
        reference_draw=reference_draw,
    )
    assert isinstance(r, AuditResult) and r.setup == "specific"
    np.testing.assert_array_equal(r.auc, np.ones(5))
    np.testing.assert_array_equal(r.tpr, np.ones(5))
    # The score is exactly the in/out mask: the original record is found iff it was in.
    np.testing.assert_array_equal(r.scores, r.mask.astype(float))
    assert r.scores.shape == r.mask.shape == (12, 5)
    np.testing.assert_array_equal(r.targets, targets)


def test_memorising_model_average_setup_auc_one():
    data, ref = _data()
    pool = (torch.cat([data[0], ref[0]]), torch.cat([data[1], ref[1]]))
    r = average(
        memorise, pool, [1, 2, 50], n_models=10, seed=0, dataset_size=40, score_fn=lookup_score
    )
    assert r.setup == "average" and r.replacement is None
    np.testing.assert_array_equal(r.auc, np.ones(3))
    np.testing.assert_array_equal(r.scores, r.mask.astype(float))


def test_model_ignoring_its_data_has_auc_one_half_on_average():
    n_targets, n_models = 300, 40
    data, ref = _data(n=n_targets + 10, n_ref=n_targets)
    r = specific(
        ignore_data,
        data,
        np.arange(n_targets),
        n_models=n_models,
        seed=11,
        reference=ref,
        score_fn=random_score,
    )
    # Per-target AUC of 20 vs 20 iid scores: mean 1/2, sd sqrt(41 / (12*400)) = 0.092, so the
    # mean over 300 targets has sd 0.0053.
    assert abs(r.auc.mean() - 0.5) < 0.025
    assert 0.06 < r.auc.std() < 0.13
    assert r.auc.min() < 0.4 and r.auc.max() > 0.6
    # TPR at FPR 0.1 of a null attack is about 0.1 on average (at most 2 of 20 non-members above).
    assert 0.03 < r.tpr.mean() < 0.2


# --- the training sets handed to train_fn ---------------------------------------------------------


def test_specific_swaps_out_targets_in_place_and_nothing_else():
    data, ref = _data()
    x, y = data
    rx, ry = ref
    targets = np.array([2, 7, 11, 30])
    seen = []

    def train(xs, ys, seed):
        seen.append((xs.clone(), ys.clone(), seed))
        return None

    r = specific(
        train,
        data,
        targets,
        n_models=8,
        seed=5,
        reference=ref,
        score_fn=lambda m, a, b: np.zeros(len(a)),
    )
    assert len(seen) == 8
    others = np.setdiff1d(np.arange(len(x)), targets)
    for k, (xs, ys, seed) in enumerate(seen):
        assert seed == r.model_seeds[k]
        assert xs.shape == x.shape and ys.shape == y.shape
        torch.testing.assert_close(xs[others], x[others], rtol=0, atol=0)
        torch.testing.assert_close(ys[others], y[others], rtol=0, atol=0)
        used = []
        for j, t in enumerate(targets):
            if r.mask[k, j]:
                assert r.replacement[k, j] == -1
                torch.testing.assert_close(xs[t], x[t], rtol=0, atol=0)
                assert ys[t] == y[t]
            else:
                src = r.replacement[k, j]
                assert 0 <= src < len(rx)
                torch.testing.assert_close(xs[t], rx[src], rtol=0, atol=0)
                assert ys[t] == ry[src]
                used.append(src)
        assert len(set(used)) == len(used)  # no reference record twice in one model
    # Per-model draws: the replacements of a target vary across models.
    out = r.replacement[:, 0][~r.mask[:, 0]]
    assert len(set(out.tolist())) > 1


def test_fixed_reference_draw_uses_record_j_for_target_j():
    data, ref = _data()
    r = specific(
        memorise,
        data,
        [4, 8, 15],
        n_models=6,
        seed=0,
        reference=ref,
        score_fn=lookup_score,
        reference_draw="fixed",
    )
    expected = np.where(r.mask, -1, np.arange(3)[None, :])
    np.testing.assert_array_equal(r.replacement, expected)


def test_average_draws_datasets_of_the_given_size_from_the_pool():
    rng = np.random.default_rng(1)
    pool_x = torch.tensor(rng.normal(size=(60, 2)))
    pool_y = torch.arange(60)  # the label is the record's pool index
    targets = np.array([3, 10, 42])
    seen = []

    def train(xs, ys, seed):
        seen.append(ys.clone())
        return None

    r = average(
        train,
        (pool_x, pool_y),
        targets,
        n_models=10,
        seed=2,
        dataset_size=25,
        score_fn=lambda m, a, b: np.zeros(len(a)),
    )
    sets = []
    for k, ys in enumerate(seen):
        idx = ys.numpy()
        assert idx.size == 25 and np.unique(idx).size == 25
        for j, t in enumerate(targets):
            assert (t in idx) == bool(r.mask[k, j])
        sets.append(frozenset(idx.tolist()))
    assert len(set(sets)) == 10  # the dataset varies from model to model


# --- the mask, determinism, the global RNG --------------------------------------------------------


@pytest.mark.parametrize("n_models", [2, 7, 16, 33])
def test_mask_is_balanced_and_deterministic(n_models):
    data, ref = _data(n=60, n_ref=60)
    targets = np.arange(50)
    kw = dict(n_models=n_models, reference=ref, score_fn=lookup_score)
    a = specific(memorise, data, targets, seed=4, **kw)
    b = specific(memorise, data, targets, seed=4, **kw)
    c = specific(memorise, data, targets, seed=5, **kw)
    per_target = a.mask.sum(axis=0)
    assert set(per_target.tolist()) <= {n_models // 2, (n_models + 1) // 2}
    if n_models % 2:  # the odd model goes in or out at random, per target
        assert 0.25 < np.mean(per_target == n_models // 2 + 1) < 0.75
    assert abs(a.mask.mean() - 0.5) <= 0.5 / n_models + 0.05
    np.testing.assert_array_equal(a.mask, b.mask)
    assert not np.array_equal(a.mask, c.mask)
    assert a.mask.dtype == bool and not a.mask.flags.writeable


def test_specific_and_average_with_one_seed_share_mask_and_training_seeds():
    data, ref = _data()
    pool = (torch.cat([data[0], ref[0]]), torch.cat([data[1], ref[1]]))
    s = specific(
        memorise, data, [1, 2, 3], n_models=9, seed=8, reference=ref, score_fn=lookup_score
    )
    a = average(
        memorise, pool, [1, 2, 3], n_models=9, seed=8, dataset_size=40, score_fn=lookup_score
    )
    np.testing.assert_array_equal(s.mask, a.mask)
    np.testing.assert_array_equal(s.model_seeds, a.model_seeds)
    assert len(set(s.model_seeds.tolist())) == 9


def _noisy_train(x, y, seed):
    """Data- and seed-dependent 'model': a data summary plus noise from every global RNG."""
    noise = random.random() + np.random.random() + float(torch.rand(()))
    return float(x.sum()) + noise


def _noisy_score(model, x, y):
    return model * 1e-3 + torch.randn(len(x)).numpy()


@pytest.mark.parametrize("setup", ["specific", "average"])
def test_same_seed_same_result_other_seed_differs(setup):
    data, ref = _data()
    pool = (torch.cat([data[0], ref[0]]), torch.cat([data[1], ref[1]]))

    def run(seed):
        if setup == "specific":
            return specific(
                _noisy_train,
                data,
                [0, 1, 2, 3, 4],
                n_models=10,
                seed=seed,
                reference=ref,
                score_fn=_noisy_score,
            )
        return average(
            _noisy_train, pool, [0, 1, 2, 3, 4], n_models=10, seed=seed, score_fn=_noisy_score
        )

    a, b, c = run(123), run(123), run(124)
    assert a == b  # dataclass equality over every array and figure
    for name in ("scores", "mask", "auc", "tpr", "model_seeds"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.scores, c.scores)
    assert not np.array_equal(a.model_seeds, c.model_seeds)


def _rng_fingerprint():
    return (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())


def _assert_same_rng(before):
    py, np_key, th = before
    assert random.getstate() == py
    np.testing.assert_array_equal(np.random.get_state()[1], np_key)
    assert torch.equal(torch.get_rng_state(), th)


@pytest.mark.parametrize("setup", ["specific", "average"])
def test_global_rng_is_left_untouched(setup):
    data, ref = _data()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    before = _rng_fingerprint()
    if setup == "specific":
        specific(
            _noisy_train, data, [0, 1], n_models=4, seed=0, reference=ref, score_fn=_noisy_score
        )
    else:
        average(_noisy_train, data, [0, 1], n_models=4, seed=0, score_fn=_noisy_score)
    _assert_same_rng(before)
    # And the next draws are the ones the caller would have had without the audit.
    draws = (random.random(), np.random.random(), float(torch.rand(())))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert draws == (random.random(), np.random.random(), float(torch.rand(())))


def test_global_rng_restored_when_train_fn_raises():
    data, ref = _data()
    before = _rng_fingerprint()

    def boom(x, y, seed):
        torch.rand(5)
        np.random.random()
        raise RuntimeError("training failed")

    with pytest.raises(RuntimeError, match="training failed"):
        specific(boom, data, [0], n_models=2, seed=0, reference=ref, score_fn=lookup_score)
    _assert_same_rng(before)


def test_train_fn_sees_its_seed_in_the_global_rng():
    """A train_fn that never seeds anything is still reproducible: the global RNGs are seeded
    with the model's training seed during the call."""
    data, ref = _data()
    draws = []

    def train(x, y, seed):
        g = torch.Generator().manual_seed(seed)
        draws.append((float(torch.rand(())), float(torch.rand((), generator=g))))
        return None

    specific(train, data, [0], n_models=3, seed=0, reference=ref, score_fn=lambda m, a, b: [0.0])
    for global_draw, seeded_draw in draws:
        assert global_draw == seeded_draw


# --- inputs ---------------------------------------------------------------------------------------


def test_dataset_formats_give_the_same_result():
    data, ref = _data()
    x, y = data
    rx, ry = ref
    kw = dict(n_models=6, seed=1, score_fn=lookup_score)
    base = specific(memorise, data, [3, 4], reference=ref, **kw)
    as_numpy = specific(memorise, (x.numpy(), y.numpy()), [3, 4], reference=(rx, ry), **kw)
    as_dataset = specific(
        memorise, TensorDataset(x, y), [3, 4], reference=TensorDataset(rx, ry), **kw
    )
    as_records = specific(
        memorise,
        list(zip(x, y, strict=True)),
        [3, 4],
        reference=list(zip(rx, ry, strict=True)),
        **kw,
    )
    as_lists = specific(memorise, (x.tolist(), y.tolist()), [3, 4], reference=ref, **kw)
    for other in (as_numpy, as_dataset, as_records, as_lists):
        np.testing.assert_array_equal(other.scores, base.scores)
        np.testing.assert_array_equal(other.auc, base.auc)


def test_unlabelled_dataset_passes_y_none():
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    rx = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    ys = []

    def train(xs, y, seed):
        ys.append(y)
        return memorise(xs, y, seed)

    r = specific(train, x, [0, 1], n_models=4, seed=0, reference=rx, score_fn=lookup_score)
    assert ys == [None] * 4
    np.testing.assert_array_equal(r.auc, [1.0, 1.0])


def test_nonfinite_scores_are_dropped_per_target():
    data, ref = _data()

    def score(model, x, y):
        s = lookup_score(model, x, y)
        s[1] = np.nan
        return s

    r = specific(memorise, data, [0, 1, 2], n_models=6, seed=0, reference=ref, score_fn=score)
    assert r.auc[0] == 1.0 and r.auc[2] == 1.0 and math.isnan(r.auc[1])
    assert math.isnan(r.tpr[1])
    assert r.n_nonfinite == 6
    assert r.ranking("auc")[-1] == 1  # NaN ranks last


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_when_asked_and_on_a_terminal(monkeypatch):
    # tqdm on stderr: shown when asked and stderr is a terminal, never in CI logs or pipes
    data, ref = _data()
    kw = dict(n_models=5, seed=0, reference=ref, score_fn=lookup_score)
    for stream, progress, shown in (
        (_Terminal(), True, True),
        (_Terminal(), False, False),
        (io.StringIO(), True, False),  # not a terminal
    ):
        monkeypatch.setattr(sys, "stderr", stream)
        specific(memorise, data, [0], progress=progress, **kw)
        text = stream.getvalue()
        assert ("privmon specific audit" in text and "5/5" in text) == shown, text
        assert "\r" not in text or shown


def test_table_lists_the_riskiest_targets_first():
    data, ref = _data()

    def score(model, x, y):  # target 2 is perfectly exposed, the others not at all
        s = lookup_score(model, x, y)
        s[[0, 1]] = 0.0
        return s

    r = specific(memorise, data, [10, 20, 30], n_models=8, seed=0, reference=ref, score_fn=score)
    assert r.ranking("auc").tolist() == [2, 0, 1]
    lines = r.table(top=2).splitlines()
    assert len(lines) == 3 and "AUC" in lines[0] and "TPR@0.1" in lines[0]
    assert lines[1].split()[:3] == ["1", "30", "1.000"]
    assert "setup='specific'" in repr(r) and "n_models=8" in repr(r)


# --- compare (§3.4) -------------------------------------------------------------------------------


def test_compare_on_hand_made_arrays():
    spec = np.array([0.95, 0.85, 0.80, 0.90, 0.60, 0.55, 0.70, 0.50])
    avg = np.array([0.70, 0.82, 0.79, 0.60, 0.65, 0.52, 0.72, 0.50])
    c = compare(spec, avg, threshold=0.8)
    assert isinstance(c, SetupComparison) and c.metric == "custom"
    # High-risk in the specific setup (>= 0.8): records 0, 1, 2, 3. The average setup keeps
    # only record 1 above 0.8, so 3 of 4 are missed.
    np.testing.assert_array_equal(c.high_risk, [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(c.missed, [1, 0, 1, 1, 0, 0, 0, 0])
    assert (c.n_high_risk, c.n_missed) == (4, 3)
    assert c.miss_rate == 0.75
    assert c.rmse == pytest.approx(math.sqrt(np.mean((avg - spec) ** 2)), rel=1e-12)
    assert c.rmse == pytest.approx(
        math.sqrt((0.25**2 + 0.03**2 + 0.01**2 + 0.3**2 + 0.05**2 + 0.03**2 + 0.02**2) / 8)
    )
    assert c.pearson == pytest.approx(pearsonr(avg, spec).statistic, rel=1e-12)
    assert c.std_ratio == pytest.approx(np.std(avg) / np.std(spec), rel=1e-12)
    assert c.mean_specific == pytest.approx(spec.mean())
    assert c.mean_average == pytest.approx(avg.mean())
    assert "miss rate 0.750" in c.summary() and "miss_rate=0.7500 (3/4)" in repr(c)


@pytest.mark.parametrize("seed", range(4))
def test_compare_pearson_and_rmse_match_scipy_on_random_arrays(seed):
    rng = np.random.default_rng(seed)
    spec = rng.uniform(0.5, 1.0, 200)
    avg = 0.5 * spec + 0.25 + rng.normal(0, 0.05, 200)
    c = compare(spec, avg, threshold=0.8)
    assert c.pearson == pytest.approx(pearsonr(avg, spec).statistic, rel=1e-10)
    assert c.rmse == pytest.approx(np.sqrt(np.mean((avg - spec) ** 2)), rel=1e-12)
    high = spec >= 0.8
    assert c.miss_rate == pytest.approx(np.mean(avg[high] < 0.8))


def test_compare_edge_cases():
    # A risk exactly at T counts as high-risk in both setups.
    c = compare([0.8, 0.9], [0.8, 0.7], threshold=0.8)
    assert (c.n_high_risk, c.n_missed) == (2, 1)
    # No high-risk record: the miss rate is undefined.
    c = compare([0.5, 0.6], [0.9, 0.9], threshold=0.8)
    assert math.isnan(c.miss_rate) and c.n_high_risk == 0 and "n/a" in c.summary()
    # A constant risk: Pearson undefined, RMSE still defined.
    c = compare([0.7, 0.7, 0.7], [0.6, 0.8, 0.7], threshold=0.8)
    assert math.isnan(c.pearson) and c.rmse == pytest.approx(math.sqrt(0.02 / 3))
    # NaN risks are left out.
    c = compare([0.9, np.nan, 0.85, 0.5], [0.5, 0.9, np.nan, 0.4], threshold=0.8)
    assert c.n_compared == 2 and c.n_dropped == 2 and c.miss_rate == 1.0
    # Identical risks: nothing missed, RMSE 0, Pearson 1.
    r = np.array([0.5, 0.9, 0.7, 0.85])
    c = compare(r, r.copy(), threshold=0.8)
    assert c.miss_rate == 0.0 and c.rmse == 0.0 and c.pearson == pytest.approx(1.0)


def test_compare_on_audit_results_uses_metric_and_default_thresholds():
    data, ref = _data()
    pool = (torch.cat([data[0], ref[0]]), torch.cat([data[1], ref[1]]))
    s = specific(
        memorise, data, [0, 1, 2], n_models=8, seed=0, reference=ref, score_fn=lookup_score
    )
    a = average(
        ignore_data, pool, [0, 1, 2], n_models=8, seed=0, dataset_size=40, score_fn=random_score
    )
    c = compare(s, a)
    assert c.metric == "auc" and c.threshold == 0.8
    assert c.n_high_risk == 3
    assert c.n_missed == int(np.sum(a.auc < 0.8))
    assert c.rmse == pytest.approx(np.sqrt(np.mean((a.auc - 1.0) ** 2)))
    t = compare(s, a, metric="tpr")
    assert t.metric == "tpr" and t.threshold == 0.6
    assert t.n_missed == int(np.sum(a.tpr < 0.6))
    with pytest.raises(ValueError, match="specific_result comes from the 'average'"):
        compare(a, s)
    with pytest.raises(ValueError, match="metric"):
        compare(s, a, metric="accuracy")
    with pytest.raises(ValueError, match="same records"):
        compare(s, a.auc[:2])
    for bad in (-0.1, 1.5):  # every record high-risk, or none: a miss rate of nothing
        with pytest.raises(ValueError, match=r"threshold must be in the closed interval \[0, 1\]"):
            compare(s, a, threshold=bad)
    assert compare(s.auc, a.auc, threshold=1.5).n_high_risk == 0  # arrays: the caller's metric


# --- errors name the argument ---------------------------------------------------------------------


def _spec(**overrides):
    data, ref = _data()
    kw = dict(
        train_fn=memorise,
        dataset=data,
        targets=[0, 1, 2],
        n_models=4,
        seed=0,
        reference=ref,
        score_fn=lookup_score,
    )
    kw.update(overrides)
    train_fn, dataset, targets = kw.pop("train_fn"), kw.pop("dataset"), kw.pop("targets")
    return specific(train_fn, dataset, targets, **kw)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"n_models": 1}, "n_models must be an integer >= 2"),
        ({"n_models": 7, "attack": "lira"}, "n_models must be an integer >= 8"),
        ({"n_models": 3, "attack": "lira_offline"}, "n_models must be an integer >= 4"),
        ({"n_models": 0}, "n_models"),
        ({"n_models": 2.5}, "n_models"),
        ({"n_models": True}, "n_models"),
        ({"targets": [0, 40]}, r"targets must be indices in \[0, 39\].*\[40\]"),
        ({"targets": [-1]}, "targets"),
        ({"targets": []}, "targets"),
        ({"targets": [1, 1]}, "targets must not repeat"),
        ({"targets": [0.5]}, "targets must be integer"),
        ({"reference": None}, "reference is required"),
        ({"targets": list(range(31))}, r"reference must hold at least len\(targets\) = 31"),
        ({"reference": (torch.zeros(5, 4), torch.zeros(5))}, "reference records must have"),
        ({"reference": torch.zeros(5, 3)}, "reference must be labelled like dataset"),
        ({"seed": -1}, "seed"),
        ({"seed": "a"}, "seed"),
        ({"fpr": 1.0}, "fpr"),
        ({"reference_draw": "random"}, "reference_draw"),
        ({"dataset": (torch.zeros(5, 2), torch.zeros(4))}, "dataset = \\(x, y\\)"),
        ({"dataset": 3}, "dataset must be"),
        ({"dataset": TensorDataset(torch.zeros(5, 2), torch.zeros(5), torch.zeros(5))}, "pair"),
        ({"dataset": ([[1.0, 2.0], [3.0]], [0, 1])}, "dataset must hold numeric"),
        ({"score_fn": lambda m, x, y: np.zeros(2)}, r"score_fn must return one score per target"),
    ],
)
def test_bad_arguments_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        _spec(**overrides)


def test_non_callables_are_named():
    with pytest.raises(TypeError, match="train_fn"):
        _spec(train_fn=3)
    with pytest.raises(TypeError, match="score_fn"):
        _spec(score_fn="loss")
    with pytest.raises(TypeError, match="score_fn"):
        _spec(score_fn=None)  # default loss attack needs an nn.Module


def test_average_bad_arguments_are_named():
    data, _ = _data()
    kw = dict(n_models=4, seed=0, score_fn=lookup_score)
    with pytest.raises(ValueError, match=r"dataset_size must lie in .* = \[3, 37\], got 38"):
        average(memorise, data, [0, 1, 2], dataset_size=38, **kw)
    with pytest.raises(ValueError, match="dataset_size"):
        average(memorise, data, [0, 1, 2], dataset_size=2, **kw)
    with pytest.raises(ValueError, match="targets"):
        average(memorise, data, [40], **kw)
    with pytest.raises(ValueError, match="n_models"):
        average(memorise, data, [0], n_models=1, seed=0, score_fn=lookup_score)


# --- the default loss attack and a real training run ----------------------------------------------


def test_default_score_is_negative_cross_entropy_and_keeps_modes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    model.train()
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    s = default_score(model, x, y)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    with torch.no_grad():
        expected = -nn.functional.cross_entropy(model(x), y, reduction="none")
    torch.testing.assert_close(s, expected)
    with pytest.raises(ValueError, match="labels"):
        default_score(model, x, None)


@pytest.fixture
def one_thread():
    """Tiny full-batch models: one thread is ~100x faster than two on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_real_training_exposes_mislabelled_records(one_thread):
    """A tiny MLP memorises mislabelled training records: their loss is low when they are in
    and high when they are out, so their per-record AUC is ~1, while typical records sit lower."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(digits.target))
    x = torch.tensor(digits.data[idx] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[idx])
    n = 80
    train_x, train_y = x[:n], y[:n].clone()
    flipped = [0, 1, 2]
    train_y[flipped] = (train_y[flipped] + 5) % 10  # planted outliers: wrong labels
    typical = [3, 4, 5]
    reference = (x[n : n + 20], y[n : n + 20])

    def train(xs, ys, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(60):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
        return model

    kw = dict(n_models=10, seed=0, reference=reference)
    r = specific(train, (train_x, train_y), flipped + typical, **kw)
    assert r.scores.shape == (10, 6) and np.all(np.isfinite(r.scores))
    assert np.all(r.auc[:3] >= 0.95), r.auc
    assert r.auc[:3].mean() > r.auc[3:].mean()
    again = specific(train, (train_x, train_y), flipped + typical, **kw)
    np.testing.assert_array_equal(again.scores, r.scores)  # reproducible from the seed


def test_example_runs_with_tiny_settings():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "specific_setup_audit.py"),
            *("--models", "6", "--targets", "5", "--epochs", "20", "--top", "3"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "6 models per setup" in out
    assert " auc: miss rate " in out and " tpr: miss rate " in out and "Pearson" in out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 3
    for row in rows:
        assert all(0.0 <= float(v) <= 1.0 for v in row[3:7])


# --- checkpoints ----------------------------------------------------------------------------------


def _counting(train_fn, calls):
    def train(x, y, seed):
        calls.append(seed)
        return train_fn(x, y, seed)

    return train


@pytest.mark.parametrize("setup", ["specific", "average"])
def test_a_checkpoint_folder_resumes_the_audit_without_retraining(tmp_path, setup):
    """Each model's scores are saved once it is scored; a later call reads them back, trains
    only the missing models and gives the same audit; another audit's folder is refused."""
    data, ref = _data()
    targets = [0, 5, 9, 17]

    def run(calls, **kw):
        train = _counting(ignore_data, calls)
        common = {"n_models": 6, "seed": 3, "score_fn": random_score, **kw}
        if setup == "specific":
            return specific(train, data, targets, reference=ref, **common)
        return average(train, data, targets, dataset_size=20, **common)

    first: list[int] = []
    full = run(first, checkpoint_dir=tmp_path)
    assert len(first) == 6
    assert sorted(os.listdir(tmp_path)) == [f"{setup}-{k:06d}.pt" for k in range(6)]
    for k in (2, 4):
        (tmp_path / f"{setup}-{k:06d}.pt").unlink()
    again: list[int] = []
    resumed = run(again, checkpoint_dir=tmp_path)
    assert again == [int(full.model_seeds[k]) for k in (2, 4)]  # only the missing models
    np.testing.assert_array_equal(resumed.scores, full.scores)
    np.testing.assert_array_equal(resumed.auc, full.auc)
    np.testing.assert_array_equal(run([]).scores, full.scores)  # as without a folder
    with pytest.raises(ValueError, match=rf"audit.{setup}: .* seed \('3' in the folder, '4' here"):
        run([], checkpoint_dir=tmp_path, seed=4)
    with pytest.raises(ValueError, match=r"n_models \('6' in the folder, '8' here\)"):
        run([], checkpoint_dir=tmp_path, n_models=8)
    with pytest.raises(ValueError, match=r"score_fn \('.*random_score' in the folder, .*"):
        run([], checkpoint_dir=tmp_path, score_fn=lambda model, x, y: random_score(model, x, y))
