"""Tests for privmon.attacks.metric: Song & Mittal §3.1 metric attacks (correctness, confidence,
entropy, modified entropy) with class-independent and class-dependent thresholds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from torch import nn

from privmon.attacks.metric import (
    HIGHER_IS_MEMBER,
    METRICS,
    MetricAttack,
    best_thresholds,
    confidence,
    correctness,
    entropy,
    metric_values,
    modified_entropy,
)
from privmon.queries import ModifiedEntropyQuery

LOG_CLIP = math.log(1e-30)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def mentr_ref(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Eq. 8 straight from the probabilities (float64, no clipping needed away from 0 and 1)."""
    out = []
    for row, label in zip(p, y, strict=True):
        s = -(1 - row[label]) * math.log(row[label])
        s -= sum(row[i] * math.log(1 - row[i]) for i in range(len(row)) if i != label)
        out.append(s)
    return np.array(out)


def brute_gain(s, member, prior, n1, n0):
    """max over thresholds t (every value, and +inf) of p·TP/N1 − (1−p)·FP/N0 for s >= t."""
    best = 0.0
    for t in np.unique(s):
        called = s >= t
        best = max(
            best, prior * np.sum(called & member) / n1 - (1 - prior) * np.sum(called & ~member) / n0
        )
    return best


# --- metric values ---------------------------------------------------------------------------


P_HAND = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5], [0.05, 0.9, 0.05]])
Y_HAND = np.array([0, 0, 2, 2])


def test_modified_entropy_equals_eq8_by_hand():
    got = modified_entropy(P_HAND, Y_HAND)
    assert got.dtype == np.float64 and got.shape == (4,)
    np.testing.assert_allclose(got, mentr_ref(P_HAND, Y_HAND), rtol=1e-12)
    hand0 = -0.3 * math.log(0.7) - 0.2 * math.log(0.8) - 0.1 * math.log(0.9)
    assert got[0] == pytest.approx(hand0, rel=1e-13)
    hand1 = -0.9 * math.log(0.1) - 0.6 * math.log(0.4) - 0.3 * math.log(0.7)
    assert got[1] == pytest.approx(hand1, rel=1e-13)
    # binary: Mentr = -2 (1 - p_y) log p_y
    assert modified_entropy([[0.8, 0.2]], [0])[0] == pytest.approx(-2 * 0.2 * math.log(0.8))


def test_modified_entropy_extremes_are_finite_never_nan():
    s = np.concatenate(
        [
            modified_entropy(np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), [0, 1]),
            modified_entropy(np.array([[0.0, 1.0], [1 - 1e-12, 1e-12]]), [1, 1]),
        ]
    )
    assert np.isfinite(s).all()
    assert s[0] == 0.0 and s[2] == 0.0  # perfectly confident and correct
    # confidently wrong: both logs clipped at 1e-30
    assert s[1] == pytest.approx(-2 * LOG_CLIP, rel=1e-12)
    # nearly certain wrong (p_y = 1e-12): -(1 - 1e-12) log 1e-12 - (1 - 1e-12) log 1e-12
    assert s[3] == pytest.approx(-2 * (1 - 1e-12) * math.log(1e-12), rel=1e-9)
    # monotone in the true-class probability
    q = np.linspace(0.01, 0.99, 50)
    m = modified_entropy(np.stack([q, 1 - q], 1), np.zeros(50, dtype=int))
    assert (np.diff(m) < 0).all()


def test_modified_entropy_matches_query_and_torch_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5, generator=g, dtype=torch.float64) * 4
    y = torch.randint(0, 5, (64,), generator=g)
    q = ModifiedEntropyQuery(nn.Identity())((logits, y))
    probs = F.softmax(logits, dim=1)
    torch.testing.assert_close(
        torch.from_numpy(modified_entropy(probs, y)), q, rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(modified_entropy(probs.numpy(), y.numpy()), q.numpy(), rtol=1e-9)
    # float32 probabilities are accepted (computed in float64)
    got32 = modified_entropy(probs.float(), y)
    np.testing.assert_allclose(got32, q.numpy(), rtol=1e-4, atol=1e-6)


def test_other_metrics_by_hand():
    np.testing.assert_array_equal(correctness(P_HAND, Y_HAND), [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(confidence(P_HAND, Y_HAND), [0.7, 0.1, 0.5, 0.05])
    ent = [-sum(v * math.log(v) for v in row) for row in P_HAND]
    np.testing.assert_allclose(entropy(P_HAND), ent, rtol=1e-13)
    np.testing.assert_allclose(entropy(P_HAND, Y_HAND), ent, rtol=1e-13)
    one_hot = entropy(np.eye(3))
    assert (one_hot == 0).all() and not np.signbit(one_hot).any()
    # ties in the arg-max: the first maximal class counts
    np.testing.assert_array_equal(correctness([[0.5, 0.5], [0.5, 0.5]], [0, 1]), [1.0, 0.0])
    for name in METRICS:
        np.testing.assert_array_equal(
            metric_values(P_HAND, Y_HAND, name),
            {
                "mentr": modified_entropy,
                "entropy": entropy,
                "confidence": confidence,
                "correctness": correctness,
            }[name](P_HAND, Y_HAND),
        )


def test_non_finite_rows_give_nan_and_are_dropped_at_fit():
    p = np.array([[0.9, 0.1], [np.nan, np.nan], [0.2, 0.8], [0.6, 0.4]])
    y = np.array([0, 0, 0, 1])
    s = modified_entropy(p, y)
    assert np.isnan(s[1]) and np.isfinite(s[[0, 2, 3]]).all()
    att = MetricAttack("confidence").fit(p, y, np.array([[0.5, 0.5], [0.3, 0.7]]), [0, 0])
    assert att.n_dropped_ == 1
    assert not att.predict(p, y)[1]  # a NaN record is never called a member


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"metric": "loss"}, "metric"),
        ({"prior": 1.0}, "prior"),
        ({"prior": 0}, "prior"),
        ({"class_conditional": "yes"}, "class_conditional"),
        ({"min_class_records": 0}, "min_class_records"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MetricAttack(**kwargs)


def test_bad_inputs_are_rejected_with_clear_messages():
    with pytest.raises(ValueError, match="softmax"):
        modified_entropy([[2.0, -1.0], [0.3, 0.1]], [0, 1])  # logits, not probabilities
    with pytest.raises(ValueError, match=r"\(n, C\)"):
        modified_entropy([0.2, 0.8], [0, 1])
    with pytest.raises(ValueError, match=r"lie in \[0, 1\]"):
        confidence([[0.2, 0.8]], [2])
    with pytest.raises(ValueError, match="shape"):
        confidence([[0.2, 0.8]], [0, 1])
    with pytest.raises(ValueError, match="non-integer"):
        confidence([[0.2, 0.8]], [0.5])
    with pytest.raises(ValueError, match="metric"):
        metric_values(P_HAND, Y_HAND, "loss")
    att = MetricAttack()
    with pytest.raises(RuntimeError, match="fit"):
        att.predict(P_HAND, Y_HAND)
    att.fit(P_HAND, Y_HAND, P_HAND[::-1], Y_HAND)
    with pytest.raises(ValueError, match="classes"):
        att.predict(np.full((2, 4), 0.25), [0, 1])


# --- threshold search --------------------------------------------------------------------------


def _random_case(rng, n=40, c=3, rounding=1):
    probs = rng.dirichlet(np.full(c, 0.7), size=n)
    probs = np.round(probs, rounding)
    probs = np.where(probs.sum(1, keepdims=True) == 0, 1.0 / c, probs)
    probs = probs / probs.sum(1, keepdims=True)
    return probs, rng.integers(0, c, n), rng.random(n) < 0.5


@pytest.mark.parametrize("metric", METRICS)
def test_thresholds_are_optimal_against_brute_force(metric):
    rng = np.random.default_rng(1)
    for _ in range(25):
        probs, y, mem = _random_case(rng)
        if mem.all() or not mem.any():
            continue
        prior = float(rng.uniform(0.1, 0.9))
        s = metric_values(probs, y, metric) * (1 if HIGHER_IS_MEMBER[metric] else -1)
        n1, n0 = mem.sum(), (~mem).sum()
        pooled = MetricAttack(metric, class_conditional=False, prior=prior)
        res = pooled.fit(probs[mem], y[mem], probs[~mem], y[~mem]).evaluate(
            probs[mem], y[mem], probs[~mem], y[~mem]
        )
        assert res["accuracy"] == pytest.approx(
            1 - prior + brute_gain(s, mem, prior, n1, n0), abs=1e-12
        )
        cc = MetricAttack(metric, prior=prior).fit(probs[mem], y[mem], probs[~mem], y[~mem])
        res_cc = cc.evaluate(probs[mem], y[mem], probs[~mem], y[~mem])
        gain = 0.0
        for k in range(3):
            sel = y == k
            if cc.class_fitted_[k]:
                gain += brute_gain(s[sel], mem[sel], prior, n1, n0)
            else:  # fallback: the pooled threshold
                t = -pooled.threshold_ if not HIGHER_IS_MEMBER[metric] else pooled.threshold_
                called = s[sel] >= t
                gain += (
                    prior * np.sum(called & mem[sel]) / n1
                    - (1 - prior) * np.sum(called & ~mem[sel]) / n0
                )
        assert res_cc["accuracy"] == pytest.approx(1 - prior + gain, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_class_dependent_never_worse_on_fitting_data(data):
    c = data.draw(st.integers(2, 4))
    n = data.draw(st.integers(2, 30))
    weights = np.array(
        data.draw(
            st.lists(st.lists(st.integers(0, 4), min_size=c, max_size=c), min_size=n, max_size=n)
        ),
        dtype=float,
    )
    weights[weights.sum(1) == 0] = 1.0
    probs = weights / weights.sum(1, keepdims=True)
    y = np.array(data.draw(st.lists(st.integers(0, c - 1), min_size=n, max_size=n)))
    mem = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    mem[0], mem[1] = True, False
    metric = data.draw(st.sampled_from(METRICS))
    prior = data.draw(st.floats(0.05, 0.95))
    min_rec = data.draw(st.integers(1, 3))
    args = (probs[mem], y[mem], probs[~mem], y[~mem])
    ind = MetricAttack(metric, class_conditional=False, prior=prior).fit(*args).evaluate(*args)
    dep = MetricAttack(metric, prior=prior, min_class_records=min_rec).fit(*args).evaluate(*args)
    assert dep["accuracy"] >= ind["accuracy"] - 1e-12
    assert ind["accuracy"] >= max(prior, 1 - prior) - 1e-12  # never below the trivial guess
    for r in (ind, dep):
        assert r["advantage"] == pytest.approx(2 * r["accuracy"] - 1)
        assert r["accuracy"] == pytest.approx(prior * r["tpr"] + (1 - prior) * (1 - r["fpr"]))


def test_orientation_and_thresholds_in_metric_units():
    # members: confident and correct; non-members: less confident
    mp = np.array([[0.99, 0.01], [0.95, 0.05], [0.02, 0.98], [0.1, 0.9]])
    my = np.array([0, 0, 1, 1])
    hp = np.array([[0.6, 0.4], [0.3, 0.7], [0.45, 0.55], [0.8, 0.2]])
    hy = np.array([0, 0, 1, 1])
    for metric in METRICS:
        att = MetricAttack(metric, class_conditional=False).fit(mp, my, hp, hy)
        res = att.evaluate(mp, my, hp, hy)
        v = metric_values(np.concatenate([mp, hp]), np.concatenate([my, hy]), metric)
        called = v >= att.threshold_ if HIGHER_IS_MEMBER[metric] else v <= att.threshold_
        np.testing.assert_array_equal(
            att.predict(np.concatenate([mp, hp]), np.concatenate([my, hy])), called
        )
        if metric != "correctness":
            assert res["accuracy"] == 1.0 and res["tpr"] == 1.0 and res["fpr"] == 0.0
    # mentr: members have the lower values, so the threshold lies between the groups
    att = MetricAttack("mentr", class_conditional=False).fit(mp, my, hp, hy)
    assert modified_entropy(mp, my).max() <= att.threshold_ < modified_entropy(hp, hy).min()
    # the paper's correctness rule (member iff correct) is what the fit finds here
    corr = MetricAttack("correctness", class_conditional=False).fit(mp, my, hp, hy)
    assert 0.0 < corr.threshold_ <= 1.0


def test_no_signal_calls_nobody_and_per_class_thresholds():
    same = np.array([[0.7, 0.3], [0.4, 0.6]])
    att = MetricAttack("confidence").fit(same, [0, 1], same, [0, 1])
    assert att.threshold_ == math.inf and np.all(att.thresholds_ == math.inf)
    assert not att.predict(same, [0, 1]).any()
    # class 0 members are confident, class 1 members are *less* confident than at class 0: one
    # threshold cannot separate both, per-class thresholds can
    mp = np.array([[0.9, 0.1], [0.95, 0.05], [0.4, 0.6], [0.45, 0.55]])
    hp = np.array([[0.7, 0.3], [0.75, 0.25], [0.6, 0.4], [0.65, 0.35]])
    y = np.array([0, 0, 1, 1])
    dep = MetricAttack("confidence").fit(mp, y, hp, y)
    ind = MetricAttack("confidence", class_conditional=False).fit(mp, y, hp, y)
    assert dep.evaluate(mp, y, hp, y)["accuracy"] == 1.0
    assert ind.evaluate(mp, y, hp, y)["accuracy"] < 1.0
    assert dep.class_fitted_.all() and 0.75 < dep.thresholds_[0] <= 0.9
    assert 0.4 < dep.thresholds_[1] <= 0.55
    # a label never seen at fit time uses the class-independent threshold
    three = MetricAttack("confidence", min_class_records=3).fit(mp, y, hp, y)
    assert not three.class_fitted_.any() and np.all(three.thresholds_ == three.threshold_)


def test_best_thresholds_vectorized_groups_match_single_groups():
    rng = np.random.default_rng(3)
    s = torch.tensor(np.round(rng.normal(size=300), 1))
    g = torch.tensor(rng.integers(0, 5, 300))
    m = torch.tensor(rng.random(300) < 0.4)
    n1, n0 = int(m.sum()), int((~m).sum())
    tau = best_thresholds(s, g, m, 6, prior=0.3, n1=n1, n0=n0)
    assert tau[5] == math.inf  # empty group: nobody
    for k in range(5):
        sel = g == k
        one = best_thresholds(
            s[sel],
            torch.zeros(int(sel.sum()), dtype=torch.long),
            m[sel],
            1,
            prior=0.3,
            n1=n1,
            n0=n0,
        )
        assert tau[k] == one[0]
        # the threshold falls between observed values: it calls the same records as the value
        # it was chosen at
        vals = s[sel]
        if math.isfinite(float(tau[k])):
            chosen = vals[vals >= tau[k]].min()
            assert bool(((vals >= tau[k]) == (vals >= chosen)).all())


def test_torch_and_numpy_inputs_agree():
    probs, y, mem = _random_case(np.random.default_rng(7), n=200, c=4, rounding=3)
    a = MetricAttack("mentr").fit(probs[mem], y[mem], probs[~mem], y[~mem])
    t = torch.from_numpy(probs)
    b = MetricAttack("mentr").fit(
        t[mem], torch.from_numpy(y)[mem], t[~mem], torch.from_numpy(y[~mem])
    )
    np.testing.assert_array_equal(a.thresholds_, b.thresholds_)
    np.testing.assert_array_equal(a.predict(probs, y), b.predict(t, torch.from_numpy(y)))
    assert a.evaluate(probs[mem], y[mem], probs[~mem], y[~mem]) == b.evaluate(
        t[mem], y[mem], t[~mem], y[~mem]
    )


# --- a real overfit classifier -----------------------------------------------------------------


@pytest.fixture(scope="module")
def shadow_and_target():
    """Two MLPs overfit on disjoint halves of load_digits: a shadow (for fitting) and a target."""
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(y))
    out = []
    for half in (perm[: len(y) // 2], perm[len(y) // 2 :]):
        mem, non = half[: len(half) // 2], half[len(half) // 2 :]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
        for _ in range(200):
            opt.zero_grad()
            F.cross_entropy(model(xt[mem]), yt[mem]).backward()
            opt.step()
        with torch.no_grad():
            p = F.softmax(model(xt).double(), 1).numpy()
        out.append((p[mem], y[mem], p[non], y[non]))
    return out


def test_shadow_fitted_attacks_leak_on_the_target(shadow_and_target):
    shadow, target = shadow_and_target
    results = {}
    for metric in METRICS:
        for cc in (False, True):
            att = MetricAttack(metric, class_conditional=cc).fit(*shadow)
            results[metric, cc] = att.evaluate(*target)
            on_shadow = att.evaluate(*shadow)
            assert on_shadow["accuracy"] >= 0.5
    # train accuracy 100 %, test ~96 %: every attack except correctness beats a coin on the target
    for metric in ("mentr", "entropy", "confidence"):
        for cc in (False, True):
            assert results[metric, cc]["advantage"] > 0.1, (metric, cc, results[metric, cc])
    # the paper's finding: modified entropy does at least as well as plain entropy
    assert results["mentr", False]["accuracy"] >= results["entropy", False]["accuracy"] - 0.01
