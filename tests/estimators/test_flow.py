"""Tests for privmon.estimators.flow: the BNAF density estimator (DOMIAS's density model).

The fits use small architectures and few epochs so the whole file runs in seconds on a CPU; the
properties checked (normalization, exact log-determinants, invertibility) hold for any weights.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal, norm

from privmon.estimators.flow import FlowDensity, fit_flow

SMALL = {"hidden": 8, "layers": 1, "flows": 3}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- data and fitted flows


def gaussian_3d():
    a = np.array([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [-0.5, 0.3, 0.4]]) * [2.0, 1.0, 0.5]
    mu = np.array([1.0, -2.0, 5.0])
    rng = np.random.default_rng(0)
    train = rng.normal(size=(3000, 3)) @ a.T + mu
    test = rng.normal(size=(5000, 3)) @ a.T + mu
    return train, test, multivariate_normal(mu, a @ a.T)


def mixture_2d(n: int, seed: int = 0) -> np.ndarray:
    """Two correlated Gaussian blobs, then very different scales and offsets per column."""
    rng = np.random.default_rng(seed)
    first = rng.random(n) < 0.4
    blob1 = rng.normal(size=(n, 2)) * [0.5, 0.3] + [-1.0, 1.0]
    blob2 = rng.normal(size=(n, 2)) @ np.array([[1.0, 0.6], [0.0, 0.5]]) + [1.0, -0.5]
    x = np.where(first[:, None], blob1, blob2)
    return x * [10.0, 0.1] + [100.0, -3.0]


def mixture_1d_pdf(x: np.ndarray) -> np.ndarray:
    return 0.3 * norm.pdf(x, -2.0, 0.5) + 0.7 * norm.pdf(x, 1.0, 1.0)


@pytest.fixture(scope="module")
def gauss_fit():
    train, test, truth = gaussian_3d()
    return fit_flow(train, epochs=40, batch_size=256, lr=2e-2, **SMALL), train, test, truth


@pytest.fixture(scope="module")
def mix2_fit():
    x = mixture_2d(2000)
    return fit_flow(x, epochs=20, batch_size=256, **SMALL), x


@pytest.fixture(scope="module")
def mix1_fit():
    rng = np.random.default_rng(1)
    n = 3000
    x = np.where(rng.random(n) < 0.3, rng.normal(-2.0, 0.5, n), rng.normal(1.0, 1.0, n))
    return fit_flow(x[:, None], epochs=60, batch_size=256, lr=2e-2, **SMALL), x


# ---------------------------------------------------------------- exact likelihood


def test_gaussian_heldout_loglik_close_to_truth(gauss_fit):
    """On N(mu, Sigma) in 3-D, the held-out mean log density is within 0.1 nats of the true
    Gaussian's. The gap estimates KL(p || p_hat) >= 0 (up to held-out noise: 5000 points, the
    per-point log-ratio sd is ~0.2, so noise ~0.003 nats); a few thousand training points and a
    small flow give ~0.02-0.03."""
    flow, _, test, truth = gauss_fit
    lp = flow.log_density(test).double().numpy()
    gap = truth.logpdf(test).mean() - lp.mean()
    assert np.isfinite(lp).all()
    assert -0.02 < gap < 0.1, gap


def test_gaussian_samples_match_moments(gauss_fit):
    flow, train, _, _ = gauss_fit
    x = flow.sample(4000, generator=torch.Generator().manual_seed(3)).numpy()
    sd = train.std(0)
    assert np.all(np.abs(x.mean(0) - train.mean(0)) < 0.1 * sd)
    assert np.allclose(np.cov(x.T), np.cov(train.T), atol=0.05 * np.outer(sd, sd).max())


def test_grid_integral_2d_is_one(mix2_fit):
    """∫ exp(log p) over a grid in data units ≈ 1. The grid spans ±12 standardized units (data
    span ~±4; the flow's tails are Gaussian-like, sampled mass beyond ±8 is 0 in 4000 draws) with
    the midpoint rule at h = 0.06 sd: doubling the resolution changes the sum by < 1e-5 and
    widening to ±20 by < 1e-4, so 3e-3 leaves an order-of-magnitude margin. The columns' scales
    differ 100x, so this also checks the standardization's Jacobian."""
    flow, _ = mix2_fit
    m, s = flow.mean.numpy(), flow.std.numpy()
    k, half = 400, 12.0
    u = (np.arange(k) + 0.5) / k * 2 * half - half
    z = np.stack(np.meshgrid(u, u, indexing="ij"), -1).reshape(-1, 2)
    p = flow.density(torch.from_numpy(z * s + m)).double().numpy()
    total = p.sum() * (2 * half / k) ** 2 * s.prod()
    assert abs(total - 1.0) < 3e-3, total
    tail = np.abs(flow.sample(2000, generator=torch.Generator().manual_seed(0)).numpy() - m) / s
    assert (tail.max(1) > 8).mean() < 3e-3


def test_density_1d_matches_truth_and_histogram(mix1_fit):
    """1-D bimodal mixture: the flow integrates to 1, is close to the true density in L1, and
    its bin probabilities match the histogram of the data. Loose: a small flow trained briefly
    reaches L1 ~0.09 and bin errors ~0.02, and the histogram itself is ~0.012 off the truth."""
    flow, x = mix1_fit
    grid = np.linspace(-12.0, 12.0, 24001)
    h = grid[1] - grid[0]
    p = flow.density(torch.from_numpy(grid)).double().numpy()
    assert abs(p.sum() * h - 1.0) < 2e-3
    l1 = np.abs(p - mixture_1d_pdf(grid)).sum() * h
    assert l1 < 0.15, l1
    edges = np.linspace(-4.0, 4.5, 18)
    counts, _ = np.histogram(x, bins=edges)
    cdf = np.concatenate([[0.0], np.cumsum(p) * h])
    bin_prob = np.diff(np.interp(edges, grid - h / 2, cdf[:-1]))
    assert np.abs(bin_prob - counts / x.size).max() < 0.035
    both_modes = p[np.searchsorted(grid, [-2.0, 1.0])]
    assert both_modes.min() > 2 * p[np.searchsorted(grid, -1.0)]  # the dip between modes


def _random_flow(dim: int, seed: int = 0, dtype=torch.float64) -> FlowDensity:
    flow = FlowDensity(dim, hidden=4, layers=2, flows=3, dtype=dtype)
    flow.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        flow.mean.copy_(torch.linspace(-3.0, 3.0, dim, dtype=torch.float64))
        flow.std.copy_(torch.linspace(0.5, 4.0, dim, dtype=torch.float64))
    return flow


def test_blocks_are_triangular_with_exact_logdet():
    """Each BNAF block's Jacobian is lower triangular with a positive diagonal, and the block's
    log-determinant equals autograd's slogdet (float64)."""
    flow = _random_flow(4)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    for block in flow.blocks:
        _, logdet = block(x)
        jac = torch.autograd.functional.jacobian(lambda v, b=block: b(v)[0], x)
        for i in range(x.shape[0]):
            j = jac[i, :, i, :]
            assert torch.count_nonzero(torch.triu(j, 1)) == 0
            assert bool((torch.diagonal(j) > 0).all())
            assert torch.allclose(torch.linalg.slogdet(j)[1], logdet[i].detach(), atol=1e-10)
        assert torch.count_nonzero(jac[0, :, 1, :]) == 0  # rows do not interact


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_logdet_matches_autograd(dtype):
    """log_density = log N(u; 0, I) + log|det du/dx| with du/dx from autograd, in data units."""
    flow = _random_flow(3, seed=2, dtype=dtype)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 3
    u, logdet = flow.transform(x)
    lp = flow.log_density(x).double()
    base = torch.distributions.Normal(0.0, 1.0).log_prob(u.double()).sum(-1)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert torch.allclose(lp, base + logdet.double(), atol=tol)

    def to_latent(v):  # x -> u with autograd (standardize() is the same map, without grad)
        return flow._latent(((v - flow.mean) / flow.std).to(dtype))[0]

    for i in range(x.shape[0]):
        j = torch.autograd.functional.jacobian(to_latent, x[i : i + 1])[0, :, 0, :].double()
        assert math.isclose(
            float(torch.linalg.slogdet(j)[1]), float(logdet[i]), rel_tol=0, abs_tol=tol * 10
        )


def test_inverse_roundtrip(gauss_fit):
    flow, _, test, _ = gauss_fit
    x = torch.from_numpy(test[:300])
    u, _ = flow.transform(x)
    back = flow.inverse(u)
    assert torch.allclose(back, x, atol=1e-4 * float(flow.std.max()), rtol=1e-4)
    f64 = _random_flow(2, seed=5)
    z = torch.randn(50, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.allclose(f64.transform(f64.inverse(z))[0], z, atol=1e-9)


def test_monotone_in_each_coordinate_and_unbounded():
    """A block's i-th output is strictly increasing in x_i and unbounded (the gated residual),
    so each block is a bijection of R^d: the density integrates to 1, not less."""
    block = _random_flow(2, seed=7).blocks[0]
    t = torch.linspace(-1e4, 1e4, 2001, dtype=torch.float64)
    x = torch.stack([torch.full_like(t, 0.3), t], 1)
    with torch.no_grad():
        y, _ = block(x)
    assert bool((y[:, 1].diff() > 0).all())
    assert float(y[0, 1]) < -100 and float(y[-1, 1]) > 100


# ---------------------------------------------------------------- robustness


def test_far_points_finite(gauss_fit, mix1_fit):
    flow, train, _, _ = gauss_fit
    m, s = train.mean(0), train.std(0)
    far = np.concatenate(
        [m + k * s * sign for k in (10.0, 1e3, 1e6, 1e12, 1e100) for sign in (1.0, -1.0)]
    ).reshape(-1, 3)
    far = np.vstack([far, [[1e300, -1e300, 0.0], [np.finfo(np.float64).max, 0.0, 0.0]]])
    lp = flow.log_density(far)
    assert bool(torch.isfinite(lp).all()), lp
    lp32 = flow.log_density(torch.tensor(far[:8], dtype=torch.float32))
    assert bool(torch.isfinite(lp32).all())
    near = float(flow.log_density(m[None]).max())
    assert float(lp[:2].max()) < near - 10  # 10 sd out is far less likely than the mean
    assert float(lp[2:4].max()) < float(lp[:2].min())  # and decreasing further out
    flow1, _ = mix1_fit
    assert bool(torch.isfinite(flow1.log_density(np.array([-1e200, -1e5, 1e5, 1e200]))).all())


def test_global_rng_untouched_and_reproducible(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the global RNG must not be seeded")

    monkeypatch.setattr(torch, "manual_seed", forbidden)
    monkeypatch.setattr(torch.random, "manual_seed", forbidden)
    monkeypatch.setattr(torch, "seed", forbidden)
    x = mixture_2d(300, seed=3)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()  # noqa: NPY002
    a = fit_flow(x, epochs=3, seed=11, **SMALL)
    a.sample(5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], np_state[1])  # noqa: NPY002
    b = fit_flow(x, epochs=3, seed=11, **SMALL)
    c = fit_flow(x, epochs=3, seed=12, **SMALL)
    assert torch.equal(a.log_density(x), b.log_density(x))
    assert torch.equal(a.history["val_index"], b.history["val_index"])
    assert not torch.equal(a.log_density(x), c.log_density(x))


def test_early_stopping_restores_best_validation_epoch():
    x = mixture_2d(200, seed=4)
    flow = fit_flow(x, epochs=300, patience=3, batch_size=16, lr=3e-2, **SMALL)
    h = flow.history
    assert h["n_val"] == 20 and h["n_train"] == 180
    assert h["epochs_run"] < 300  # stopped early (180 points overfit quickly)
    assert h["best_epoch"] == int(np.argmin(h["val_nll"])) + 1
    assert h["epochs_run"] - h["best_epoch"] == 3
    val = torch.from_numpy(x)[h["val_index"]]
    nll = -(flow.log_density(val).double() + torch.log(flow.std).sum()).mean()
    assert math.isclose(float(nll), min(h["val_nll"]), rel_tol=1e-4)


def test_float64_training_and_dtype():
    x = mixture_2d(300, seed=5)
    flow = fit_flow(torch.from_numpy(x), epochs=2, dtype=torch.float64, **SMALL)
    assert flow.dtype == torch.float64 and flow.log_density(x).dtype == torch.float64
    assert fit_flow(x, epochs=1, **SMALL).log_density(x).dtype == torch.float32


def test_state_dict_roundtrip(mix2_fit):
    flow, x = mix2_fit
    expected = flow.log_density(x)
    buf = io.BytesIO()
    torch.save(flow.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert torch.equal(FlowDensity.from_state_dict(state).log_density(x), expected)
    fresh = FlowDensity(2, **SMALL)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.log_density(x), expected)
    assert fresh.dim == 2
    with pytest.raises((ValueError, RuntimeError)):
        FlowDensity(2, hidden=8, layers=1, flows=4).load_state_dict(state)
    with pytest.raises((ValueError, RuntimeError)):
        FlowDensity(2, hidden=4, layers=1, flows=3).load_state_dict(state)


def test_input_validation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 2))
    with pytest.raises(ValueError, match="constant"):
        fit_flow(np.c_[x, np.ones(50)], epochs=1)
    with pytest.raises(ValueError, match="NaN"):
        fit_flow(np.r_[x, [[np.nan, 0.0]]], epochs=1)
    with pytest.raises(ValueError, match="shape"):
        fit_flow(np.ones((1, 2)), epochs=1)
    flow = fit_flow(x, epochs=1, **SMALL)
    with pytest.raises(ValueError, match="shape"):
        flow.log_density(np.ones((3, 3)))
    assert flow.log_density(x[0:1]).shape == (1,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fits_on_the_data_device():
    x = torch.from_numpy(mixture_2d(300, seed=6))
    cpu = fit_flow(x, epochs=2, **SMALL)
    gpu = fit_flow(x.cuda(), epochs=2, **SMALL)
    assert gpu.device.type == "cuda" and gpu.log_density(x).device.type == "cuda"
    assert torch.equal(cpu.history["val_index"], gpu.history["val_index"])  # same split
    assert torch.allclose(gpu.log_density(x).cpu(), cpu.log_density(x), atol=1e-3)


def test_defaults_are_domias_table_3():
    import inspect

    from privmon.estimators.flow import FAST_CPU

    params = inspect.signature(fit_flow).parameters
    table3 = {"batch_size": 50, "layers": 3, "hidden": 32, "flows": 5, "lr": 0.01, "epochs": 50}
    assert {k: params[k].default for k in table3} == table3
    assert FAST_CPU == {"hidden": 16, "layers": 2, "batch_size": 128}


def test_masked_weights_equal_the_dense_formula():
    # BNAF eq. 8-9 written densely: exp(W) on the diagonal blocks, W below, 0 above, each row
    # rescaled to norm exp(s); the log diagonal blocks are log of those entries
    flow = FlowDensity(3, hidden=4, layers=2, flows=1, dtype=torch.float64)
    flow.reset_parameters(torch.Generator().manual_seed(0))
    for lin in flow.blocks[0].linears:
        w, logw = lin.weights()
        dim, a, b = lin.dim, lin.a, lin.b
        rows = torch.arange(dim).repeat_interleave(b)[:, None]
        cols = torch.arange(dim).repeat_interleave(a)[None, :]
        v = torch.where(rows == cols, lin.weight.exp(), torch.where(rows > cols, lin.weight, 0.0))
        dense = lin.log_scale.exp() * v / v.norm(dim=1, keepdim=True)
        torch.testing.assert_close(w, dense, rtol=1e-12, atol=0)
        for i in range(dim):
            block = dense[i * b : (i + 1) * b, i * a : (i + 1) * a]
            torch.testing.assert_close(logw[i], block.log(), rtol=1e-12, atol=1e-12)
