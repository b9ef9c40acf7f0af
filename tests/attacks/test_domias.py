"""Tests for privmon.attacks.domias and privmon.attacks.baselines.

Reference values come from scipy (gaussian_kde, multivariate_normal) and from per-record loops that
follow the published DOMIAS code's definitions of the baselines (squared Euclidean distances).
"""

from __future__ import annotations

import math
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from scipy.stats import gaussian_kde, multivariate_normal, norm, spearmanr

from privmon.attacks.baselines import eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.domias import domias_scores
from privmon.estimators.density import GaussianKDE
from privmon.estimators.roc import auc

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def population(n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """Correlated, skewed data: a Gaussian pushed through a fixed mixing and an exp on axis 0."""
    mix = np.eye(d) + 0.3 * np.random.default_rng(99).normal(size=(d, d))
    x = rng.normal(size=(n, d)) @ mix.T
    x[:, 0] = np.exp(0.5 * x[:, 0])
    return x


def planted(seed: int = 0, d: int = 3, n_mem: int = 150, noise: float = 0.05):
    """Synthetic set = members + small noise (overfitting); reference from the population."""
    rng = np.random.default_rng(seed)
    mem, non = population(n_mem, d, rng), population(n_mem, d, rng)
    syn = np.repeat(mem, 6, axis=0) + noise * rng.normal(size=(6 * n_mem, d))
    ref = population(1500, d, rng)
    return mem, non, syn, ref


# --- per-record reference implementations of the published definitions --------------------------


def ref_sq_dists(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.sum((x - y) ** 2, axis=1)


def ref_gan_leaks(test, syn):
    return np.array([np.exp(-ref_sq_dists(x, syn).min()) for x in test])


def ref_gan_leaks_cal(test, syn, ref):
    return np.array(
        [np.exp(-ref_sq_dists(x, syn).min() + ref_sq_dists(x, ref).min()) for x in test]
    )


def ref_monte_carlo(test, syn):
    dist = np.array([ref_sq_dists(x, syn) for x in test])
    eps = np.median(dist.min(axis=1))
    return np.array([np.sum(row < eps) for row in dist]) / len(syn)


def ref_domias_kde(test, syn, ref, bw="scott"):
    return gaussian_kde(syn.T, bw).logpdf(test.T) - gaussian_kde(ref.T, bw).logpdf(test.T)


# --- DOMIAS with KDE -----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 3, 8])
@pytest.mark.parametrize("bandwidth", ["scott", "silverman", 0.4])
def test_kde_scores_equal_scipy(d, bandwidth):
    rng = np.random.default_rng(d)
    syn, ref = population(700, d, rng), population(500, d, rng)
    test = population(200, d, rng) * 1.2  # some records in the tails
    got = domias_scores(test, syn, ref, bandwidth=bandwidth)
    want = ref_domias_kde(test, syn, ref, bandwidth)
    assert got.shape == (200,) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert spearmanr(got, want).statistic >= 0.999
    # each log density on its own, through the matmul path
    for data in (syn, ref):
        kde = GaussianKDE(torch.from_numpy(data), bandwidth=bandwidth)
        lp = kde.log_density(torch.from_numpy(test), method="matmul").numpy()
        np.testing.assert_allclose(lp, gaussian_kde(data.T, bandwidth).logpdf(test.T), atol=1e-9)


def test_matmul_log_density_equals_cdist_path_far_points_and_blocks(monkeypatch):
    rng = np.random.default_rng(5)
    data = torch.from_numpy(population(300, 4, rng))
    pts = torch.from_numpy(np.r_[population(50, 4, rng), population(5, 4, rng) + 1e3])
    kde = GaussianKDE(data)
    a = kde.log_density(pts)
    b = kde.log_density(pts, method="matmul")
    assert torch.isfinite(b).all() and (b[-5:] < -1e3).all()  # far rows: the log-sum-exp path
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-12, atol=1e-10)
    monkeypatch.setattr("privmon.estimators.density.BLOCK_ELEMENTS_CPU", 7 * 300)  # 7 rows
    c = GaussianKDE(data).log_density(pts, method="matmul")
    np.testing.assert_allclose(c.numpy(), b.numpy(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="method"):
        kde.log_density(pts, method="fft")


def test_far_away_test_records_give_finite_exact_scores():
    rng = np.random.default_rng(6)
    syn, ref = population(400, 3, rng), population(400, 3, rng)
    test = np.r_[population(10, 3, rng), population(4, 3, rng) + 1e3, [[1e6, -1e6, 1e6]]]
    got = domias_scores(test, syn, ref)
    assert np.all(np.isfinite(got))
    # scipy's logpdf is exact in log space as well (its own log-sum-exp)
    np.testing.assert_allclose(got, ref_domias_kde(test, syn, ref), rtol=1e-8, atol=1e-6)
    for scores in (
        domias_scores(test, syn, ref, density="gaussian"),
        eq1(test, syn),
        gan_leaks(test, syn),
        gan_leaks_cal(test, syn, ref),
        monte_carlo(test, syn),
        logan_d1(test, syn, ref, epochs=1),
    ):
        assert np.all(np.isfinite(scores))


def test_planted_overfitting_detected_and_beats_eq1():
    mem, non, syn, ref = planted()
    test = np.r_[mem, non]
    s = domias_scores(test, syn, ref)
    e = eq1(test, syn)
    a_domias = auc(s[: len(mem)], s[len(mem) :])
    a_eq1 = auc(e[: len(mem)], e[len(mem) :])
    assert a_domias > 0.75
    assert a_domias > a_eq1 + 0.05


def test_gaussian_prior_variant_equals_scipy():
    rng = np.random.default_rng(7)
    syn, ref, test = population(500, 3, rng), population(300, 3, rng), population(60, 3, rng)
    log_g = gaussian_kde(syn.T).logpdf(test.T)
    rv = multivariate_normal(ref.mean(0), np.diag(ref.std(0) ** 2))  # published normal_func_feat
    got = domias_scores(test, syn, ref, density="gaussian")
    np.testing.assert_allclose(got, log_g - rv.logpdf(test), atol=1e-8)
    # App. C: only the first feature's mean and standard deviation are known
    got0 = domias_scores(test, syn, ref, density="gaussian", prior_features=[0])
    want0 = log_g - norm(ref[:, 0].mean(), ref[:, 0].std()).logpdf(test[:, 0])
    np.testing.assert_allclose(got0, want0, atol=1e-8)
    # the prior needs no d + 1 reference records, just two per feature
    assert np.all(np.isfinite(domias_scores(test, syn, ref[:2], density="gaussian")))


def test_theorem_1_invertible_encoder_leaves_scores_unchanged():
    rng = np.random.default_rng(8)
    syn, ref, test = population(400, 3, rng), population(400, 3, rng), population(50, 3, rng)
    base = domias_scores(test, syn, ref)
    enc = torch.nn.Linear(3, 3, dtype=torch.float64)
    with torch.no_grad():
        enc.weight.copy_(torch.tensor([[2.0, 0.5, 0.0], [0.0, 1.0, -1.0], [0.3, 0.0, 3.0]]))
    enc.train()
    got = domias_scores(test, syn, ref, embed=enc)
    np.testing.assert_allclose(got, base, atol=1e-8)
    assert enc.training  # mode restored
    # a plain callable, and a full-rank PCA (a rotation): the ratio is invariant too
    got2 = domias_scores(test, syn, ref, embed=lambda t: t * torch.tensor([1.0, 10.0, 0.1]))
    np.testing.assert_allclose(got2, base, atol=1e-8)
    np.testing.assert_allclose(domias_scores(test, syn, ref, embed="pca"), base, atol=1e-8)


def test_pca_embedding_projects_on_reference_axes():
    rng = np.random.default_rng(9)
    syn, ref, test = population(300, 5, rng), population(300, 5, rng), population(40, 5, rng)
    got = domias_scores(test, syn, ref, embed="pca", embed_dim=2)
    c = ref - ref.mean(0)
    _, vecs = np.linalg.eigh(c.T @ c)
    axes = vecs[:, ::-1][:, :2]
    proj = [(z - ref.mean(0)) @ axes for z in (test, syn, ref)]
    np.testing.assert_allclose(got, ref_domias_kde(*proj), atol=1e-8)
    with pytest.raises(ValueError, match="embed_dim"):
        domias_scores(test, syn, ref, embed="pca", embed_dim=6)
    with pytest.raises(ValueError, match="embed"):
        domias_scores(test, syn, ref, embed="tsne")


def test_randomized_pca_for_wide_data_matches_exact(monkeypatch):
    rng = np.random.default_rng(18)
    n, d = 400, 40
    latent = rng.normal(size=(3 * n, 3)) * [5.0, 3.0, 2.0]  # a clear 3-d principal subspace
    data = latent @ rng.normal(size=(3, d)) + 0.1 * rng.normal(size=(3 * n, d))
    test, syn, ref = data[:n], data[n : 2 * n], data[2 * n :]
    exact = domias_scores(test[:50], syn, ref, embed="pca", embed_dim=3)
    monkeypatch.setattr("privmon.attacks.record_sets._EXACT_PCA_MAX_DIM", 8)
    state = torch.get_rng_state()
    randomized = domias_scores(test[:50], syn, ref, embed="pca", embed_dim=3)
    assert torch.equal(torch.get_rng_state(), state)
    np.testing.assert_allclose(randomized, exact, atol=1e-6)


def test_flow_hook_calls_fit_flow(monkeypatch):
    calls = []

    class Fitted:
        def __init__(self, mean):
            self.mean = mean

        def log_density(self, x):
            return -0.5 * ((x - self.mean) ** 2).sum(dim=1)

    def fit_flow(data, **kwargs):
        calls.append((data.shape, kwargs))
        return Fitted(data.mean(dim=0))

    fake = types.ModuleType("privmon.estimators.flow")
    fake.fit_flow = fit_flow
    monkeypatch.setitem(sys.modules, "privmon.estimators.flow", fake)
    rng = np.random.default_rng(10)
    syn, ref, test = population(100, 2, rng), population(80, 2, rng), population(20, 2, rng)
    got = domias_scores(test, syn, ref, density="flow", flow_kwargs={"seed": 3})
    want = -0.5 * ((test - syn.mean(0)) ** 2).sum(1) + 0.5 * ((test - ref.mean(0)) ** 2).sum(1)
    np.testing.assert_allclose(got, want, atol=1e-10)
    assert calls == [((100, 2), {"seed": 3}), ((80, 2), {"seed": 3})]
    monkeypatch.setitem(sys.modules, "privmon.estimators.flow", None)  # module missing
    with pytest.raises(ValueError, match="density"):
        domias_scores(test, syn, ref, density="flow")


def test_flow_density_with_the_bnaf_module():
    pytest.importorskip("privmon.estimators.flow")
    rng = np.random.default_rng(19)
    shift = np.array([0.5, 0.5])
    syn, ref = rng.normal(size=(300, 2)), rng.normal(size=(300, 2)) + shift
    test = rng.normal(size=(60, 2))
    small = {"epochs": 20, "seed": 0, "flows": 1, "hidden": 4, "layers": 1}
    got = domias_scores(test, syn, ref, density="flow", flow_kwargs=small)
    true = -0.5 * (test**2).sum(1) + 0.5 * ((test - shift) ** 2).sum(1)
    assert np.all(np.isfinite(got))
    assert spearmanr(got, true).statistic >= 0.9
    np.testing.assert_array_equal(
        got, domias_scores(test, syn, ref, density="flow", flow_kwargs=small)
    )


# --- baselines against the published per-record definitions -------------------------------------


def test_baselines_match_published_definitions():
    mem, non, syn, ref = planted(seed=11, n_mem=100)
    far = population(5, 3, np.random.default_rng(2)) + 1e4
    test = np.r_[mem, non, population(20, 3, np.random.default_rng(1)), far]
    gl, want_gl = gan_leaks(test, syn), ref_gan_leaks(test, syn)
    assert spearmanr(gl, want_gl).statistic >= 0.999
    np.testing.assert_allclose(np.exp(gl), want_gl, rtol=1e-9)  # the log of the published score
    glc, want_glc = gan_leaks_cal(test, syn, ref), ref_gan_leaks_cal(test, syn, ref)
    assert spearmanr(glc, want_glc).statistic >= 0.999
    np.testing.assert_allclose(np.exp(glc), want_glc, rtol=1e-9)
    mc, want_mc = monte_carlo(test, syn), ref_monte_carlo(test, syn)
    assert spearmanr(mc, want_mc).statistic >= 0.999
    np.testing.assert_array_equal(mc, want_mc)
    e, want_e = eq1(test, syn), gaussian_kde(syn.T).logpdf(test.T)
    assert spearmanr(e, want_e).statistic >= 0.999
    np.testing.assert_allclose(e, want_e, atol=1e-8)


def test_monte_carlo_ties_and_odd_even_median():
    syn = np.array([[0.0], [1.0], [3.0], [10.0]])
    # min squared distances: 0, 0.25, 1, 4 -> even count, eps = (0.25 + 1) / 2 = 0.625
    test = np.array([[0.0], [0.5], [4.0], [-2.0]])
    np.testing.assert_array_equal(monte_carlo(test, syn), ref_monte_carlo(test, syn))
    np.testing.assert_array_equal(monte_carlo(test, syn), [0.25, 0.5, 0.0, 0.0])
    # odd count: eps = the median record's own min distance, excluded by the strict "<"
    np.testing.assert_array_equal(monte_carlo(test[:3], syn), ref_monte_carlo(test[:3], syn))


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_monte_carlo_exact_on_a_grid_with_many_ties(offset):
    # integer coordinates: many distances equal eps exactly, so the float32 passes must defer to
    # the exact float64 recomputation; the offset makes float32 rounding large
    rng = np.random.default_rng(17)
    for _ in range(5):
        test = rng.integers(0, 4, size=(301, 3)) * 0.1 + offset
        syn = rng.integers(0, 4, size=(60, 3)) * 0.1 + offset
        np.testing.assert_array_equal(monte_carlo(test, syn), ref_monte_carlo(test, syn))
        gl = gan_leaks(test, syn)
        np.testing.assert_allclose(np.exp(gl), ref_gan_leaks(test, syn), rtol=1e-9)


def test_logan_d1_learns_the_bayes_log_ratio_seeded_and_rng_free():
    rng = np.random.default_rng(12)
    shift = np.array([0.8, -0.4])
    syn, ref = rng.normal(size=(800, 2)), rng.normal(size=(800, 2)) + shift
    test = rng.normal(size=(300, 2)) + shift / 2
    # Bayes log-odds of "synthetic" for N(0, I) vs N(shift, I): linear in x
    bayes = -(test @ shift) + 0.5 * shift @ shift
    torch.manual_seed(123)
    state = torch.get_rng_state()
    np_state = np.random.get_state()[1].copy()  # noqa: NPY002 (the global RNG)
    a = logan_d1(test, syn, ref, epochs=20, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    np.testing.assert_array_equal(np.random.get_state()[1], np_state)  # noqa: NPY002
    assert spearmanr(a, bayes).statistic >= 0.95
    np.testing.assert_array_equal(a, logan_d1(test, syn, ref, epochs=20, seed=0))
    assert not np.array_equal(a, logan_d1(test, syn, ref, epochs=20, seed=1))
    for bad in ({"epochs": 0}, {"hidden": 1.5}, {"lr": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            logan_d1(test, syn, ref, **bad)


def test_inputs_as_tensors_and_global_rng_untouched():
    mem, non, syn, ref = planted(seed=13, n_mem=50)
    test = np.r_[mem, non]
    torch.manual_seed(0)
    state = torch.get_rng_state()
    t32 = [torch.from_numpy(z).float() for z in (test, syn, ref)]
    got = domias_scores(*t32)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    want = ref_domias_kde(*[z.double().numpy() for z in t32])
    np.testing.assert_allclose(got, want, atol=1e-5)
    gan_leaks(t32[0], t32[1])
    monte_carlo(t32[0], t32[1])
    domias_scores(*t32, embed="pca", embed_dim=2)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    mem, non, syn, ref = planted(seed=14)
    test = np.r_[mem, non]
    cpu = domias_scores(test, syn, ref)
    dev = [torch.from_numpy(z).cuda() for z in (test, syn, ref)]
    np.testing.assert_allclose(domias_scores(*dev), cpu, atol=1e-8)
    np.testing.assert_allclose(gan_leaks(dev[0], dev[1]), gan_leaks(test, syn), atol=1e-9)
    np.testing.assert_array_equal(monte_carlo(dev[0], dev[1]), monte_carlo(test, syn))


# --- errors name the argument --------------------------------------------------------------------


def test_errors_name_the_argument():
    rng = np.random.default_rng(15)
    syn, ref, test = population(100, 3, rng), population(100, 3, rng), population(10, 3, rng)
    with pytest.raises(ValueError, match="synthetic"):
        domias_scores(test, syn[:, :2], ref)
    with pytest.raises(ValueError, match="reference"):
        domias_scores(test, syn, ref[:, :2])
    with pytest.raises(ValueError, match="reference"):
        gan_leaks_cal(test, syn, ref[:, :2])
    with pytest.raises(ValueError, match=r"reference.*d \+ 1 = 4"):
        domias_scores(test, syn, ref[:3])
    with pytest.raises(ValueError, match="synthetic"):
        domias_scores(test, syn[:3], ref)
    with pytest.raises(ValueError, match="synthetic"):
        eq1(test, syn[:2])
    collinear = np.c_[ref[:, 0], 2 * ref[:, 0], ref[:, 1]]
    with pytest.raises(ValueError, match=r"reference.*singular"):
        domias_scores(test, syn, collinear)
    with pytest.raises(ValueError, match="density"):
        domias_scores(test, syn, ref, density="bnaf")
    with pytest.raises(ValueError, match="bandwidth"):
        domias_scores(test, syn, ref, bandwidth="scot")
    bad = test.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="test"):
        domias_scores(bad, syn, ref)
    with pytest.raises(ValueError, match="test"):
        gan_leaks(bad, syn)
    with pytest.raises(ValueError, match="prior_features"):
        domias_scores(test, syn, ref, density="gaussian", prior_features=[3])
    with pytest.raises(ValueError, match="prior_features"):
        domias_scores(test, syn, ref, prior_features=[0])
    with pytest.raises(ValueError, match="reference"):
        domias_scores(test, syn, None)


def test_non_finite_synthetic_rows_dropped_with_warning():
    rng = np.random.default_rng(16)
    syn, ref, test = population(200, 2, rng), population(200, 2, rng), population(20, 2, rng)
    dirty = np.r_[syn, [[np.inf, 0.0], [np.nan, 1.0]]]
    with pytest.warns(RuntimeWarning, match="synthetic: dropped 2"):
        got = domias_scores(test, dirty, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(got, domias_scores(test, syn, ref), atol=1e-12)
    assert math.isfinite(float(got.sum()))
