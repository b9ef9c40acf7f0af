"""Tests for privmon.estimators.density: the torch Gaussian KDE in scipy's convention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from scipy.stats import gaussian_kde

from privmon.estimators.density import GaussianKDE, bandwidth_factor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_data(d: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mix = np.eye(d) + 0.3 * rng.normal(size=(d, d))  # well-conditioned, correlated
    return rng.normal(size=(n, d)) @ mix.T + np.arange(d)


def exact_log_kde(data: np.ndarray, points: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """Direct log-sum-exp of Gaussian kernels with covariance ``cov`` (no squared-norm tricks)."""
    diff = points[:, None, :] - data[None, :, :]
    q = np.einsum("mni,ij,mnj->mn", diff, np.linalg.inv(cov), diff)
    _, logdet = np.linalg.slogdet(2 * math.pi * cov)
    return logsumexp(-0.5 * q, axis=1) - math.log(len(data)) - 0.5 * logdet


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("bandwidth", ["scott", "silverman", 0.35])
def test_log_density_equals_scipy(d, bandwidth):
    data = make_data(d, 300, seed=d)
    pts = make_data(d, 3000, seed=100 + d)[:2500:50] * 1.3  # 50 points, some in the tails
    kde = GaussianKDE(torch.from_numpy(data), bandwidth=bandwidth)
    ref = gaussian_kde(data.T, bw_method=bandwidth)
    assert kde.factor == pytest.approx(ref.factor, rel=1e-14)
    np.testing.assert_allclose(kde.covariance.numpy(), ref.covariance, rtol=1e-12, atol=1e-14)
    got = kde.log_density(torch.from_numpy(pts)).numpy()
    np.testing.assert_allclose(got, ref.logpdf(pts.T), atol=1e-10, rtol=0)
    np.testing.assert_allclose(kde.density(torch.from_numpy(pts)).numpy(), ref(pts.T), rtol=1e-9)


@pytest.mark.parametrize("d", [1, 2, 4])
def test_log_density_far_points_finite_and_exact(d):
    data = make_data(d, 200, seed=7)
    kde = GaussianKDE(torch.from_numpy(data))
    far = data[:5] + 1e3
    got = kde.log_density(torch.from_numpy(far)).numpy()
    assert np.all(np.isfinite(got))  # no log 0 = -inf
    assert np.all(got < -1e3)
    ref = exact_log_kde(data, far, gaussian_kde(data.T).covariance)
    np.testing.assert_allclose(got, ref, rtol=1e-9)


def test_chunking_does_not_change_the_result():
    data = torch.from_numpy(make_data(2, 150, seed=8))
    pts = torch.from_numpy(make_data(2, 77, seed=9))
    a = GaussianKDE(data).log_density(pts)
    b = GaussianKDE(data, chunk=10).log_density(pts)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-12)


def test_float32_points_evaluated_in_data_dtype():
    data = torch.from_numpy(make_data(1, 100, seed=10))
    pts = torch.linspace(-2, 2, 9, dtype=torch.float32)[:, None]
    out = GaussianKDE(data).log_density(pts)
    assert out.dtype == torch.float64
    ref = gaussian_kde(data.numpy().T).logpdf(pts.double().numpy().T)
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-10)


@pytest.mark.parametrize("d", [1, 3])
@pytest.mark.parametrize("bandwidth", ["scott", 0.5])
def test_sample_moments(d, bandwidth):
    data = make_data(d, 400, seed=11)
    kde = GaussianKDE(torch.from_numpy(data), bandwidth=bandwidth)
    x = kde.sample(100_000, generator=torch.Generator().manual_seed(0)).numpy()
    assert x.shape == (100_000, d)
    cov = np.cov(data.T).reshape(d, d)
    sd = np.sqrt(np.diag(cov))
    np.testing.assert_allclose(x.mean(0), data.mean(0), atol=0.02 * sd.max())
    # a random data point plus kernel noise: covariance ≈ cov·(1 + factor²)
    target = cov * (1 + kde.factor**2)
    scale = np.sqrt(np.outer(np.diag(target), np.diag(target)))
    assert np.all(np.abs(np.cov(x.T).reshape(d, d) - target) <= 0.03 * scale)


def test_sample_reproducible_and_uses_only_the_generator():
    data = torch.from_numpy(make_data(2, 50, seed=12))
    kde = GaussianKDE(data)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    a = kde.sample(64, generator=torch.Generator().manual_seed(3))
    b = kde.sample(64, generator=torch.Generator().manual_seed(3))
    c = kde.sample(64, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)


def test_bandwidth_factor_formulas():
    assert bandwidth_factor("scott", n=1000, d=2) == pytest.approx(1000 ** (-1 / 6))
    assert bandwidth_factor("silverman", n=1000, d=2) == pytest.approx((1000 * 4 / 4) ** (-1 / 6))
    assert bandwidth_factor("silverman", n=500, d=3) == pytest.approx((500 * 5 / 4) ** (-1 / 7))
    assert bandwidth_factor(0.7, n=10, d=5) == 0.7
    data = torch.from_numpy(make_data(2, 64, seed=13))
    kde = GaussianKDE(data, bandwidth=0.5)
    np.testing.assert_allclose(kde.covariance.numpy(), np.cov(data.numpy().T) * 0.25, rtol=1e-12)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "scot", "Scott"])
def test_bad_bandwidth(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        bandwidth_factor(bad, n=10, d=1)
    with pytest.raises(ValueError, match="bandwidth"):
        GaussianKDE(torch.randn(10, 1, dtype=torch.float64), bandwidth=bad)


def test_degenerate_data_rejected():
    with pytest.raises(ValueError, match="n >= 2"):
        GaussianKDE(torch.zeros(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        GaussianKDE(torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="singular"):
        GaussianKDE(torch.ones(10, 2, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 1, dtype=torch.float64, generator=g)
    with pytest.raises(ValueError, match="singular"):
        GaussianKDE(torch.cat([x, 2 * x], dim=1))  # collinear: Cholesky happens to fail here


# regression: a ~1e-17 Cholesky pivot let collinear data through about half the time
def test_collinear_data_always_rejected():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(20, 1, dtype=torch.float64, generator=g)
        with pytest.raises(ValueError, match="singular"):
            GaussianKDE(torch.cat([x, 2 * x], dim=1))


def test_axes_on_very_different_scales_accepted():
    rng = np.random.default_rng(16)
    data = np.c_[rng.normal(0, 1, 300), rng.normal(0, 1e-7, 300)]
    kde = GaussianKDE(torch.from_numpy(data))
    ref = gaussian_kde(data.T).logpdf(data[:20].T)
    np.testing.assert_allclose(kde.log_density(torch.from_numpy(data[:20])).numpy(), ref, atol=1e-8)


def test_ridge_added_to_kernel_covariance():
    data = make_data(2, 80, seed=17)
    plain = GaussianKDE(torch.from_numpy(data))
    ridged = GaussianKDE(torch.from_numpy(data), ridge=0.01)
    np.testing.assert_allclose(
        ridged.covariance.numpy(), plain.covariance.numpy() + 0.01 * np.eye(2), rtol=1e-12
    )
    # a point mass has a KDE once a ridge is given: an isotropic Gaussian of variance ridge
    point = GaussianKDE(torch.zeros(5, 2, dtype=torch.float64), ridge=0.25)
    x = torch.tensor([[0.0, 0.0], [1.0, 0.5]], dtype=torch.float64)
    expected = -np.log(2 * np.pi * 0.25) - np.array([0.0, 1.25]) / (2 * 0.25)
    np.testing.assert_allclose(point.log_density(x).numpy(), expected, rtol=1e-12)
