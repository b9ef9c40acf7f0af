"""Tests for privmon.bounds: DP ceilings (MACE Theorem 4 + (eps, delta) LP), epsilon lower
bounds, the threshold audit, and reading epsilon from Opacus."""

from __future__ import annotations

import itertools
import math
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from privmon.bounds import (
    _lp_ceiling,
    epsilon_audit,
    epsilon_from_counts,
    epsilon_from_opacus,
    epsilon_lower_bound,
    tanh_bound,
)

eps_st = st.floats(min_value=0.0, max_value=12.0, allow_nan=False)
prior_st = st.floats(min_value=1e-3, max_value=1 - 1e-3)
delta_st = st.floats(min_value=0.0, max_value=0.999)


def theorem4(eps: float, p: float) -> float:
    lam = math.log(p / (1 - p))
    return max(abs(math.tanh((eps + lam) / 2)), abs(math.tanh((lam - eps) / 2)))


def lp_bruteforce(eps: float, delta: float, p: float) -> float:
    """max 2p*TPR - 2(1-p)*FPR + 1 - 2p over the (eps, delta) region, by scipy linprog.

    HiGHS's default feasibility tolerance (1e-7) let it return FPR = -6e-8 at eps = 0,
    delta = 6e-8, p = 1/16, off by 1e-7 in the value: the tolerances are tightened to 1e-10."""
    e = math.exp(eps)
    a_ub = [[-e, 1.0], [-1.0, e], [1.0, -e], [e, -1.0]]  # variables (FPR, TPR)
    b_ub = [delta, e - 1 + delta, delta, e - 1 + delta]
    tight = {"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}
    res = linprog(
        c=[2 * (1 - p), -2 * p],
        A_ub=a_ub,
        b_ub=b_ub,
        bounds=[(0, 1), (0, 1)],
        method="highs",
        options=tight,
    )
    assert res.status == 0
    return -res.fun + 1 - 2 * p


# -------------------------------------------------------------------------------- required values


def test_required_values():
    assert round(tanh_bound(1.0), 4) == 0.4621
    assert tanh_bound(1.0) == pytest.approx(math.tanh(0.5), abs=1e-15)
    assert tanh_bound(0, prior=0.1) == pytest.approx(0.8, abs=1e-15)
    assert tanh_bound(0.0, prior=0.9) == pytest.approx(0.8, abs=1e-15)
    assert isinstance(tanh_bound(1.0), float)


def test_matches_theorem4_formula():
    for eps in [0.0, 0.1, 1.0, 3.0, 8.0]:
        for p in [0.01, 0.1, 0.3, 0.5, 0.77, 0.99]:
            assert tanh_bound(eps, prior=p) == pytest.approx(theorem4(eps, p), abs=1e-13)


@pytest.mark.parametrize("eps", [0.0, 0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("delta", [1e-5, 0.01, 0.1, 0.5, 0.9])
def test_half_prior_delta_closed_form(eps, delta):
    expected = (math.exp(eps) - 1 + 2 * delta) / (math.exp(eps) + 1)
    assert tanh_bound(eps, prior=0.5, delta=delta) == pytest.approx(expected, abs=1e-14)


def test_infinite_epsilon_and_vectorization():
    assert tanh_bound(math.inf) == 1.0
    assert tanh_bound(math.inf, prior=0.2, delta=0.3) == 1.0
    eps = np.array([[0.0, 1.0], [2.0, np.inf]])
    out = tanh_bound(eps, prior=0.3, delta=0.01)
    assert isinstance(out, np.ndarray) and out.shape == (2, 2)
    for e, o in zip(eps.ravel(), out.ravel(), strict=True):
        assert o == tanh_bound(float(e), prior=0.3, delta=0.01)
    assert isinstance(tanh_bound(torch.tensor([1.0, 2.0])), np.ndarray)
    assert isinstance(tanh_bound(np.float64(1.0)), float)


def test_delta_ceiling_never_below_theorem4_and_continuous():
    for p in [0.05, 0.3, 0.5, 0.9]:
        for eps in [0.0, 0.7, 2.0]:
            base = tanh_bound(eps, prior=p)
            assert tanh_bound(eps, prior=p, delta=1e-12) == pytest.approx(base, abs=1e-11)
            assert tanh_bound(eps, prior=p, delta=0.2) >= base


# -------------------------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(e1=eps_st, e2=eps_st, p=prior_st, d=delta_st)
def test_monotone_in_epsilon(e1, e2, p, d):
    lo, hi = min(e1, e2), max(e1, e2)
    assert tanh_bound(lo, prior=p, delta=d) <= tanh_bound(hi, prior=p, delta=d) + 1e-12


@settings(max_examples=200, deadline=None)
@given(e=eps_st, p=prior_st, d1=delta_st, d2=delta_st)
def test_monotone_in_delta(e, p, d1, d2):
    lo, hi = min(d1, d2), max(d1, d2)
    assert tanh_bound(e, prior=p, delta=lo) <= tanh_bound(e, prior=p, delta=hi) + 1e-12


@settings(max_examples=200, deadline=None)
@given(e=eps_st, p=prior_st, d=delta_st)
def test_within_trivial_floor_and_one(e, p, d):
    v = tanh_bound(e, prior=p, delta=d)
    assert abs(2 * p - 1) - 1e-12 <= v <= 1.0
    assert v >= tanh_bound(e, prior=p) - 1e-15


@settings(max_examples=200, deadline=None)
@given(p=st.floats(min_value=1e-6, max_value=1 - 1e-6))
def test_zero_epsilon_is_majority_guess(p):
    assert tanh_bound(0.0, prior=p) == pytest.approx(abs(2 * p - 1), abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(e=st.floats(min_value=1e-3, max_value=10.0), p=prior_st)
def test_inverse_property(e, p):
    back = epsilon_lower_bound(tanh_bound(e, prior=p), prior=p)
    assert back == pytest.approx(e, rel=1e-6, abs=1e-7)


@settings(max_examples=150, deadline=None)
@given(e=st.floats(min_value=0.0, max_value=8.0), d=delta_st, p=prior_st)
@example(e=0.0, d=5.960464477539063e-08, p=0.0625)  # linprog was off at its default tolerance
def test_lp_vertex_formula_matches_linprog(e, d, p):
    brute = lp_bruteforce(e, d, p)
    assert float(_lp_ceiling(np.asarray(e), p, d)) == pytest.approx(brute, abs=1e-7)
    # the public ceiling is max(Theorem 4, LP) for delta > 0
    if d > 0:
        expected = max(theorem4(e, p), brute)
        assert tanh_bound(e, prior=p, delta=d) == pytest.approx(expected, abs=1e-7)
    # at delta = 0 the LP value is max(tanh(eps/2), |2p-1|) <= Theorem 4
    assert float(_lp_ceiling(np.asarray(e), p, 0.0)) == pytest.approx(
        max(math.tanh(e / 2), abs(2 * p - 1)), abs=1e-12
    )
    assert float(_lp_ceiling(np.asarray(e), p, 0.0)) <= theorem4(e, p) + 1e-12


def test_lp_grid_search():
    """Independent check: dense grid over (FPR, TPR), keep feasible points, take the max."""
    g = np.linspace(0, 1, 801)
    x, y = np.meshgrid(g, g)
    rng = np.random.default_rng(3)
    for _ in range(10):
        e, d, p = rng.uniform(0, 3), rng.uniform(0, 0.3), rng.uniform(0.05, 0.95)
        ee = math.exp(e)
        ok = (
            (y <= ee * x + d + 1e-12)
            & (1 - x <= ee * (1 - y) + d + 1e-12)
            & (x <= ee * y + d + 1e-12)
            & (1 - y <= ee * (1 - x) + d + 1e-12)
        )
        best = (2 * p * y - 2 * (1 - p) * x + 1 - 2 * p)[ok].max()
        formula = float(_lp_ceiling(np.asarray(e), p, d))
        assert best <= formula + 1e-9
        assert best >= formula - 4 * 2 / 800 * max(ee, 1)  # grid resolution


# ---------------------------------------------------------------------------- epsilon_lower_bound


def test_epsilon_lower_bound_values():
    assert epsilon_lower_bound(0.0) == 0.0
    assert epsilon_lower_bound(math.tanh(0.5)) == pytest.approx(1.0, abs=1e-12)
    assert epsilon_lower_bound(1.0) == math.inf
    assert epsilon_lower_bound(1.0, prior=0.2) == math.inf
    # below the trivial floor |2p - 1| nothing leaks
    assert epsilon_lower_bound(0.5, prior=0.1) == 0.0
    adv = 0.9
    lam = math.log(0.1 / 0.9)
    assert epsilon_lower_bound(adv, prior=0.1) == pytest.approx(2 * math.atanh(adv) - abs(lam))
    out = epsilon_lower_bound(np.array([0.0, 0.5, 1.0]))
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [0.0, 2 * math.atanh(0.5), np.inf])


# -------------------------------------------------------------------------------- errors


def test_errors():
    with pytest.raises(ValueError, match="prior"):
        tanh_bound(1.0, prior=1.0)
    with pytest.raises(ValueError, match="prior"):
        tanh_bound(1.0, prior=0.0)
    with pytest.raises(ValueError, match="delta"):
        tanh_bound(1.0, delta=1.0)
    with pytest.raises(ValueError, match="delta"):
        tanh_bound(1.0, delta=-0.1)
    with pytest.raises(ValueError, match="epsilon"):
        tanh_bound(-0.1)
    with pytest.raises(ValueError, match="epsilon"):
        tanh_bound(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="epsilon"):
        tanh_bound("abc")
    with pytest.raises(ValueError, match="advantage"):
        epsilon_lower_bound(1.5)
    with pytest.raises(ValueError, match="advantage"):
        epsilon_lower_bound(np.array([0.2, -0.1]))
    with pytest.raises(ValueError, match="prior"):
        epsilon_lower_bound(0.5, prior=2.0)
    counts = dict(true_positives=5, false_negatives=5, false_positives=5, true_negatives=5)
    with pytest.raises(ValueError, match="true_positives"):
        epsilon_from_counts(**{**counts, "true_positives": -1})
    with pytest.raises(ValueError, match="false_positives"):
        epsilon_from_counts(**{**counts, "false_positives": 1.5})
    with pytest.raises(ValueError, match="member"):
        epsilon_from_counts(**{**counts, "true_positives": 0, "false_negatives": 0})
    with pytest.raises(ValueError, match="alpha"):
        epsilon_from_counts(**counts, alpha=0.0)
    with pytest.raises(ValueError, match="delta"):
        epsilon_from_counts(**counts, delta=1.0)
    with pytest.raises(TypeError):
        epsilon_from_counts(5, 5, 5, 5)  # keyword-only
    with pytest.raises(ValueError, match="max_thresholds"):
        epsilon_audit([1.0, 2.0], [0.0, 1.0], max_thresholds=0)
    with pytest.raises(ValueError, match="member_scores"):
        epsilon_audit(np.zeros((3, 2)), [0.0, 1.0])
    with pytest.raises(ValueError, match="nonmember_scores"):
        epsilon_audit([1.0], [])
    with pytest.raises(ValueError, match="alpha"):
        epsilon_audit([1.0], [0.0], alpha=1.0)


# -------------------------------------------------------------------------------- auditing


def test_epsilon_from_counts_values():
    # no signal -> 0
    assert (
        epsilon_from_counts(
            true_positives=50, false_negatives=50, false_positives=50, true_negatives=50
        )
        == 0.0
    )
    # perfect separation with many samples gives a large bound
    big = epsilon_from_counts(
        true_positives=10_000, false_negatives=0, false_positives=0, true_negatives=10_000
    )
    assert big > 5
    # delta shrinks the bound; larger alpha loosens intervals -> larger bound
    kw = dict(true_positives=700, false_negatives=300, false_positives=200, true_negatives=800)
    e0 = epsilon_from_counts(**kw)
    assert 0 < epsilon_from_counts(**kw, delta=0.05) < e0
    assert epsilon_from_counts(**kw, alpha=0.2) > e0
    assert e0 < math.log(0.7 / 0.2)
    # second orientation: TNR / FNR
    assert (
        epsilon_from_counts(
            true_positives=1000, false_negatives=0, false_positives=500, true_negatives=500
        )
        > 2
    )


def test_epsilon_from_counts_coverage_tight_binomial():
    """TPR/FPR ratio exactly e^eps (the worst case): bound > eps in at most alpha of the runs."""
    rng = np.random.default_rng(0)
    eps, alpha, n, reps = 1.0, 0.1, 400, 1000
    tpr = 0.5
    fpr = tpr / math.exp(eps)
    tps = rng.binomial(n, tpr, reps)
    fps = rng.binomial(n, fpr, reps)
    bounds = np.array(
        [
            epsilon_from_counts(
                true_positives=tp,
                false_negatives=n - tp,
                false_positives=fp,
                true_negatives=n - fp,
                alpha=alpha,
            )
            for tp, fp in zip(tps, fps, strict=True)
        ]
    )
    assert np.mean(bounds > eps) <= alpha
    assert np.median(bounds) > 0.4


def test_audit_matches_naive_loop():
    rng = np.random.default_rng(1)
    mem = rng.normal(0.5, 1, 300)
    non = rng.normal(0.0, 1, 250)
    res = epsilon_audit(mem, non, max_thresholds=20, alpha=0.1)
    pooled = np.sort(np.concatenate([mem, non]))
    pos = np.floor(np.arange(1, 21) / 21 * pooled.size).astype(int)
    ths = np.unique(pooled[pos])
    best = -1.0
    for t in ths:
        tp, fp = int((mem >= t).sum()), int((non >= t).sum())
        e = epsilon_from_counts(
            true_positives=tp,
            false_negatives=300 - tp,
            false_positives=fp,
            true_negatives=250 - fp,
            alpha=0.1 / ths.size,
        )
        if e > best:
            best, best_t = e, t
    assert res["epsilon"] == pytest.approx(best, abs=1e-12)
    assert res["threshold"] == best_t
    assert res["tpr"] == (mem >= best_t).mean()
    assert res["fpr"] == (non >= best_t).mean()
    assert set(res) == {"epsilon", "threshold", "tpr", "fpr"}


def test_audit_randomized_response_coverage():
    """Randomized response with eps = 1 is exactly eps-DP and tight: coverage <= alpha."""
    rng = np.random.default_rng(2)
    eps, alpha, n, reps = 1.0, 0.05, 2000, 300
    q = math.exp(eps) / (1 + math.exp(eps))
    results = []
    for _ in range(reps):
        mem = (rng.random(n) < q).astype(float)
        non = (rng.random(n) < 1 - q).astype(float)
        results.append(epsilon_audit(mem, non, alpha=alpha)["epsilon"])
    results = np.array(results)
    assert np.mean(results > eps) <= alpha
    assert np.median(results) > 0.7


def test_audit_laplace_mechanism_valid_and_informative():
    """Members ~ Laplace(1, 1/eps), non-members ~ Laplace(0, 1/eps) (sensitivity 1): eps-DP."""
    rng = np.random.default_rng(4)
    eps, alpha, n, reps = 1.0, 0.05, 20_000, 60
    results = []
    for _ in range(reps):
        mem = rng.laplace(1.0, 1 / eps, n)
        non = rng.laplace(0.0, 1 / eps, n)
        results.append(epsilon_audit(torch.from_numpy(mem), non, alpha=alpha)["epsilon"])
    results = np.array(results)
    assert np.mean(results > eps) <= alpha
    assert results.min() > 0.3


def test_audit_null_and_nan_and_delta():
    rng = np.random.default_rng(5)
    mem, non = rng.normal(size=2000), rng.normal(size=2000)
    assert epsilon_audit(mem, non)["epsilon"] < 0.3
    mem2 = rng.laplace(1.0, 1.0, 5000)
    non2 = rng.laplace(0.0, 1.0, 5000)
    with_nan = np.concatenate([mem2, [np.nan, np.inf]])
    assert epsilon_audit(with_nan, non2) == epsilon_audit(mem2, non2)
    assert epsilon_audit(mem2, non2, delta=0.05)["epsilon"] < epsilon_audit(mem2, non2)["epsilon"]


# -------------------------------------------------------------------------------- opacus


@pytest.mark.parametrize(("accountant", "steps"), [("rdp", 4), ("prv", 2)])
def test_epsilon_from_opacus_privacy_engine(accountant, steps):
    """A real PrivacyEngine (the default accountant is PRV, slow per call: few steps)."""
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    engine = PrivacyEngine(accountant=accountant)
    delta = 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        assert epsilon_from_opacus(engine, delta=delta) == 0.0  # nothing spent yet
        eps_seen = []
        batches = iter(loader)
        for _ in range(steps):
            x, y = next(batches)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            eps_seen.append(epsilon_from_opacus(engine, delta=delta))
        assert all(isinstance(v, float) for v in eps_seen)
        assert eps_seen[-1] == engine.get_epsilon(delta)
        if accountant == "rdp":
            assert eps_seen[-1] == epsilon_from_opacus(engine.accountant, delta=delta)
    assert len(engine.accountant.history) > 0
    assert all(b > a > 0 for a, b in itertools.pairwise(eps_seen))
    # the ceiling from the accountant's epsilon lies in (0, 1)
    assert 0 < tanh_bound(eps_seen[-1], delta=delta) < 1


def test_epsilon_from_opacus_rdp_accountant_and_errors():
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    values = []
    for _ in range(5):
        acc.step(noise_multiplier=1.1, sample_rate=0.01)
        values.append(epsilon_from_opacus(acc, delta=1e-5))
    assert values[-1] == acc.get_epsilon(1e-5)
    assert all(b > a for a, b in itertools.pairwise(values))
    # anything with an .accountant works too
    holder = types.SimpleNamespace(accountant=acc)
    assert epsilon_from_opacus(holder, delta=1e-5) == values[-1]
    with pytest.raises(TypeError, match="PrivacyEngine"):
        epsilon_from_opacus(object(), delta=1e-5)
    with pytest.raises(TypeError, match="PrivacyEngine"):
        epsilon_from_opacus(types.SimpleNamespace(accountant=None), delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        epsilon_from_opacus(acc, delta=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        epsilon_from_opacus(types.SimpleNamespace(get_epsilon=lambda d: float("nan")), delta=1e-5)
