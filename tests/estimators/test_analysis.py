"""privmon.analyse: one pure call per query equals the public functions called one by one; a
failing method or step is isolated (the certificate's formulas:
tests/estimators/test_certificates.py)."""

import math

import numpy as np
import pytest
from scipy.stats import beta, norm

import privmon

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIELDS = ("value", "lower", "lower_check", "plugin", "upper")


def _case(kind: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    if kind == "gaussian":  # 1-D, the KDE on its grid
        return rng.normal(0.4, 1.0, 900), rng.normal(0.0, 1.0, 700)
    if kind == "memorised":  # member losses squeezed near 0: the exact-KDE path
        return np.abs(0.001 * rng.normal(size=800)), rng.exponential(3.0, 600)
    if kind == "2d":
        return rng.normal(0.3, 1.0, (700, 2)), rng.normal(0.0, 1.0, (600, 2))
    if kind == "3d":
        return rng.normal(0.3, 1.0, (250, 3)), rng.normal(0.0, 1.0, (200, 3))
    if kind == "nonfinite":  # NaN / inf rows dropped and counted, per-record arrays aligned
        m, h = rng.normal(0.4, 1.0, 500), rng.normal(0.0, 1.0, 400)
        m[[3, 70]] = [np.nan, np.inf]
        h[[5]] = -np.inf
        return m, h
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["gaussian", "memorised", "2d", "3d", "nonfinite"])
def test_analyse_equals_the_public_functions_one_by_one(kind):
    mem, non = _case(kind)
    res = privmon.analyse(mem, non, delta=0.1, certify_delta=0.01, top_k=5, name="q")
    assert res.name == "q" and res.dim == (1 if mem.ndim == 1 else mem.shape[1])
    assert res.failures == {}
    for method in ("histogram", "kde"):
        est = privmon.optimal_advantage(mem, non, method=method, delta=0.1)
        run = privmon.optimal_advantage(mem, non, method=method, delta=0.01)
        got = res.estimates[method]
        for field in ("value", "plugin", "upper", "halfwidth", "n_dropped"):
            assert getattr(got, field) == pytest.approx(getattr(est, field), abs=1e-12)
        assert got.lower_check == pytest.approx(est.lower, abs=1e-12)
        assert got.lower == pytest.approx(run.lower, abs=1e-12)
        assert got.lower_delta == 0.01 and got.delta == 0.1
    if mem.ndim == 1:
        summary = privmon.roc_summary(mem, non, higher_is_member=None)
        assert res.roc == pytest.approx(summary, abs=1e-12)
    else:
        assert res.roc == {}
    if mem.ndim == 1 or mem.shape[1] <= 2:
        risk, post_m, post_n = res.member_risk, res.member_posterior, res.nonmember_posterior
        assert risk.shape == (len(mem),) and post_n.shape == (len(non),)
        np.testing.assert_allclose(risk, np.abs(2 * post_m - 1), atol=1e-12)
        dropped_m = ~np.isfinite(mem).all(axis=-1) if mem.ndim > 1 else ~np.isfinite(mem)
        assert np.isnan(risk[dropped_m]).all() and np.isfinite(risk[~dropped_m]).all()
        finite = risk[~dropped_m]
        for q in (50, 90, 99):
            assert res.risk[f"q{q}"] == pytest.approx(np.quantile(finite, q / 100), abs=1e-12)
        assert res.risk["max"] == pytest.approx(finite.max())
        assert res.risk["n_above_0.5"] == float((finite > 0.5).sum())
        # the most exposed: the highest membership posteriors (the likeliest members)
        order = np.argsort(-np.nan_to_num(post_m, nan=-1.0), kind="stable")
        assert res.top_records == tuple(order[:5].tolist())
        assert res.top_risks == tuple(post_m[order[:5]].tolist())
        last = post_m[order[4]]
        assert res.top_tied == int(np.sum(post_m == last)) - int(np.sum(post_m[order[:5]] == last))
    else:  # above 2-D: no grid, so no per-record risk
        assert res.member_risk is None and res.top_records == ()


def test_a_lone_record_is_not_its_own_evidence():
    # One member far from every other record: in sample its cell holds one member and no
    # non-member, so its risk reads 1. Out of sample (the densities its fold did not shape)
    # nothing is known there, and the risk stays near the prior's 0.
    rng = np.random.default_rng(4)
    mem = np.append(rng.normal(0.0, 1.0, 400), 5.5)
    non = rng.normal(0.0, 1.0, 400)
    res = privmon.analyse(mem, non)
    in_sample = privmon.individual_risk(mem, mem, non).value
    assert in_sample[-1] == 1.0
    assert res.member_risk[-1] < 0.2


@pytest.mark.parametrize("dim", [1, 2])
def test_per_record_risk_under_the_null_flags_nobody(dim):
    # identically distributed members and non-members, 200 + 400 records as in the demo:
    # at most 1 % of members above risk 0.8 (over 30 seeded sets of records)
    above = []
    for seed in range(30):
        rng = np.random.default_rng(seed)
        mem, non = rng.normal(size=(200, dim)), rng.normal(size=(400, dim))
        above.append(np.mean(privmon.analyse(mem, non).member_risk > 0.8))
    assert np.mean(above) <= 0.01, above


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_posterior_is_calibrated_against_the_true_posterior(mu):
    # members ~ N(mu, 1), non-members ~ N(0, 1), prior 1/2: P(member | x) = φ(x − mu) /
    # (φ(x − mu) + φ(x)). RMSE of the out-of-sample posterior against it ≤ 0.05 at 1,000 +
    # 1,000, on average over 8 seeded sets of records (a single set varies by about ±0.01).
    rmse = []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        mem, non = rng.normal(mu, 1.0, 1000), rng.normal(0.0, 1.0, 1000)
        res = privmon.analyse(mem, non)
        x = np.concatenate([mem, non])
        truth = norm.pdf(x - mu) / (norm.pdf(x - mu) + norm.pdf(x))
        got = np.concatenate([res.member_posterior, res.nonmember_posterior])
        rmse.append(np.sqrt(np.mean((got - truth) ** 2)))
    assert np.mean(rmse) <= 0.05, rmse


def test_posteriors_point_the_right_way():
    # members score higher: their posterior P(member | score) is above 1/2 where they dominate
    rng = np.random.default_rng(1)
    mem, non = rng.normal(2.0, 1.0, 600), rng.normal(0.0, 1.0, 600)
    res = privmon.analyse(mem, non)
    assert np.median(res.member_posterior) > 0.75
    assert np.median(res.nonmember_posterior) < 0.25


def test_analyse_orientation_and_discrete_queries():
    rng = np.random.default_rng(2)
    loss_m, loss_h = rng.exponential(0.5, 500), rng.exponential(1.0, 500)  # members lower
    res = privmon.analyse(loss_m, loss_h, higher_is_member=False)
    assert res.roc == pytest.approx(privmon.roc_summary(loss_m, loss_h, higher_is_member=False))
    assert res.roc["auc"] > 0.6
    correct_m = (rng.random(500) < 0.9).astype(float)
    correct_h = (rng.random(500) < 0.7).astype(float)
    res = privmon.analyse(correct_m, correct_h, discrete=True)
    assert tuple(res.estimates) == ("histogram",)  # no KDE on a discrete query
    est = privmon.optimal_advantage(correct_m, correct_h)
    assert res.estimates["histogram"].value == pytest.approx(est.value, abs=1e-12)


def test_dead_units_never_raise():
    # A hidden layer with a dead ReLU unit (a constant column) and a duplicated unit (a collinear
    # column): every method still measures the leak in the live units.
    rng = np.random.default_rng(0)
    mem, non = rng.normal(0.5, 1.0, (600, 4)), rng.normal(0.0, 1.0, (600, 4))
    mem[:, 2] = non[:, 2] = 0.0
    mem[:, 3], non[:, 3] = mem[:, 0], non[:, 0]
    res = privmon.analyse(mem, non)
    assert tuple(res.estimates) == ("histogram", "kde") and res.failures == {}
    truth = 2 * norm.cdf(0.5 * np.sqrt(2) / 2) - 1  # the live units 0 and 1: a shift of 0.5 each
    for est in res.estimates.values():
        assert abs(est.value - truth) < 0.08 and est.lower > 0


def test_a_failing_method_is_isolated(monkeypatch):
    # Fault injection: the KDE's density evaluation raises (as a singular covariance or an
    # exhausted device would). The KDE is reported as failed; the histogram is still computed,
    # and errors="raise" re-raises the KDE's error.
    from privmon.estimators import density

    def broken(self, x):
        raise RuntimeError("density exploded")

    rng = np.random.default_rng(0)
    mem, non = rng.normal(0.5, 1.0, (300, 3)), rng.normal(0.0, 1.0, (300, 3))
    hist = privmon.optimal_advantage(mem, non, method="histogram")
    monkeypatch.setattr(density.GaussianKDE, "log_density", broken)
    res = privmon.analyse(mem, non, errors="skip")
    assert tuple(res.estimates) == ("histogram",)
    assert res.failures == {"kde": "RuntimeError: density exploded"}
    assert res.estimates["histogram"].value == pytest.approx(hist.value, abs=1e-12)
    with pytest.raises(RuntimeError, match="density exploded"):
        privmon.analyse(mem, non)


def test_analyse_rejects_bad_arguments():
    x = np.arange(10.0)
    for kwargs, name in (
        ({"methods": ("histogram", "knn")}, "methods"),
        ({"methods": ()}, "methods"),
        ({"prior": 1.0}, "prior"),
        ({"delta": 0.0}, "delta"),
        ({"certify_delta": 2.0}, "certify_delta"),
        ({"higher_is_member": "yes"}, "higher_is_member"),
        ({"top_k": -1}, "top_k"),
        ({"errors": "ignore"}, "errors"),
    ):
        with pytest.raises(ValueError, match=name):
            privmon.analyse(x, x, **kwargs)
    with pytest.raises(ValueError, match="no finite scores"):
        privmon.analyse([np.nan, np.inf], x)
    with pytest.raises(ValueError, match="same dimension"):
        privmon.analyse(np.zeros((5, 2)), np.zeros((5, 3)))


def test_epsilon_from_counts_splits_alpha_between_the_rates():
    # log(Beta⁻¹(0.025; 700, 301) / Beta⁻¹(0.975; 201, 800)) = 1.08684
    eps = privmon.epsilon_from_counts(
        true_positives=700, false_negatives=300, false_positives=200, true_negatives=800
    )
    expected = math.log(beta.ppf(0.025, 700, 301) / beta.ppf(0.975, 201, 800))
    assert eps == pytest.approx(expected, abs=1e-10)
    assert eps == pytest.approx(1.08684, abs=5e-6)


def test_ties_at_the_cut_are_counted():
    from privmon.estimators.risk import most_exposed, tied_beyond

    risk = np.array([0.2, 0.9, 0.5, 0.5, 0.1, 0.5, np.nan])
    top = most_exposed(risk, 2)
    assert top == (1, 2) and tied_beyond(risk, top) == 2  # records 3 and 5 share 0.5
    assert tied_beyond(risk, most_exposed(risk, 4)) == 0
    assert tied_beyond(risk, ()) == 0


@pytest.mark.parametrize("dim", [1, 2, 3, 8])
def test_null_value_is_unbiased_in_every_dimension(dim):
    # Identical members and non-members, 200 + 200: every rule is measured on records it did not
    # learn from, so its mean value stays near the floor 0 (a rule measured on its own training
    # records reports ~0.47 at d = 3). Mean over 12 seeded sets; one set spreads by ~0.05.
    values = {"histogram": [], "kde": []}
    for seed in range(12):
        rng = np.random.default_rng(100 + seed)
        res = privmon.analyse(rng.normal(size=(200, dim)), rng.normal(size=(200, dim)))
        for method, est in res.estimates.items():
            values[method].append(est.value)
    for method, v in values.items():
        assert np.mean(v) <= 0.03, (method, v)


def test_one_dimensional_figures_do_not_depend_on_how_a_score_is_scaled():
    # s, log s, s³ and −1/s carry the same information: the value, the certified bound, the
    # per-record risks and the ROC agree (the ranks are identical, so they agree exactly); the
    # paper's plug-ins do not, and are not asked to.
    rng = np.random.default_rng(11)
    s_m, s_h = np.exp(rng.normal(0.4, 1.0, 1000)), np.exp(rng.normal(0.0, 1.0, 1000))
    results = [
        privmon.analyse(f(s_m), f(s_h), higher_is_member=True)
        for f in (lambda s: s, np.log, lambda s: s**3, lambda s: -1 / s)
    ]
    base = results[0]
    assert base.estimates["kde"].value > 0.1
    for res in results[1:]:
        for method in ("histogram", "kde"):
            for field in ("value", "lower", "lower_check"):
                got, want = (
                    getattr(res.estimates[method], field),
                    getattr(base.estimates[method], field),
                )
                assert abs(got - want) <= 0.01, (method, field)
        np.testing.assert_allclose(res.member_risk, base.member_risk, atol=0.01)
        assert res.roc == pytest.approx(base.roc, abs=1e-12)


def test_one_far_score_moves_the_figures_by_one_record():
    # A finite member score of 1e6 — or 1e200, whose variance overflows — among 400: the rules
    # read ranks, so the record only moves to the top rank; the plug-in U_N, defined on the raw
    # scale, is lost at 1e200 (NaN, reported), never the check.
    rng = np.random.default_rng(12)
    mem, non = rng.normal(0.6, 1.0, 400), rng.normal(0.0, 1.0, 400)
    base = privmon.analyse(mem, non)
    for far in (1e6, 1e200):
        moved = mem.copy()
        moved[np.argmax(mem)] = far  # the top member goes further up: the ranks are unchanged
        res = privmon.analyse(moved, non)
        for method in ("histogram", "kde"):
            assert res.estimates[method].value == base.estimates[method].value
            assert res.estimates[method].lower == base.estimates[method].lower
    assert np.isnan(res.estimates["kde"].plugin)
    assert res.failures["kde/plugin"].startswith("ValueError")
