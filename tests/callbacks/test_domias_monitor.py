"""DOMIAS in the monitor: subgroup risk (DOMIAS §5.3) and GeneratorQuery.

Reference values: privmon.auc / privmon.top_q_precision on hand-split data, the functional attacks
(domias_scores, eq1, gan_leaks, gan_leaks_cal) on the same synthetic sample drawn by hand, and a
numpy loop for the Monte Carlo counts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import privmon
from privmon.attacks.baselines import eq1, gan_leaks, gan_leaks_cal
from privmon.attacks.domias import domias_scores
from privmon.attacks.generator import ATTACKS
from privmon.attacks.subgroups import subgroup_risk
from privmon.queries import GeneratorQuery
from privmon.sinks import JsonlSink

Q = (0.01, 0.05, 0.1, 0.2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- subgroup_risk -------------------------------------------------------------------------------


def test_subgroup_risk_equals_per_group_auc_and_top_q():
    rng = np.random.default_rng(0)
    mem, non = rng.normal(0.5, 1, 300), rng.normal(0, 1, 500)
    mem[:40] = np.round(mem[:40], 1)  # some ties
    non[:40] = np.round(non[:40], 1)
    g_mem = rng.choice(["a", "b", "c"], 300, p=[0.6, 0.3, 0.1])
    g_non = rng.choice(["a", "b", "c"], 500, p=[0.5, 0.3, 0.2])
    out = subgroup_risk(mem, non, g_mem, g_non, q=Q)
    assert list(out) == ["a", "b", "c"]
    for g, r in out.items():
        m, n = mem[g_mem == g], non[g_non == g]
        assert r["auc"] == privmon.auc(m, n)
        want = privmon.top_q_precision(m, n, q=Q)
        assert list(r["top_q_precision"]) == list(Q)
        np.testing.assert_array_equal(list(r["top_q_precision"].values()), want)
        assert (r["n_members"], r["n_nonmembers"], r["n_dropped"]) == (len(m), len(n), 0)
        assert r["member_fraction"] == len(m) / (len(m) + len(n))
    # torch inputs and integer labels give the same figures; keys are Python ints
    codes = {"a": 0, "b": 1, "c": 2}
    out_t = subgroup_risk(
        torch.from_numpy(mem),
        torch.from_numpy(non),
        torch.tensor([codes[g] for g in g_mem]),
        np.array([codes[g] for g in g_non]),
        q=Q,
    )
    assert list(out_t) == [0, 1, 2] and all(type(k) is int for k in out_t)
    for g, k in codes.items():
        assert out_t[k]["auc"] == out[g]["auc"]


def test_subgroup_risk_empty_side_gives_nan_with_counts_and_drops_nan_scores():
    mem = np.array([3.0, 2.0, np.nan, 1.0, 5.0])
    non = np.array([0.0, 1.5, np.inf, 4.0])
    g_mem = [1, 1, 1, 2, 3]
    g_non = [1, 1, 2, 4]
    out = subgroup_risk(mem, non, g_mem, g_non, q=0.5)
    assert out[1]["auc"] == privmon.auc([3.0, 2.0], [0.0, 1.5]) == 1.0
    assert out[1]["n_dropped"] == 1 and out[1]["n_members"] == 2
    # group 2: one member, its only non-member is inf (dropped) -> no non-members -> NaN
    assert out[2]["n_members"] == 1 and out[2]["n_nonmembers"] == 0 and out[2]["n_dropped"] == 1
    assert math.isnan(out[2]["auc"]) and math.isnan(out[2]["top_q_precision"][0.5])
    assert out[2]["member_fraction"] == 1.0
    assert math.isnan(out[3]["auc"]) and out[3]["n_nonmembers"] == 0  # members only
    assert math.isnan(out[4]["auc"]) and out[4]["n_members"] == 0  # non-members only
    assert out[4]["member_fraction"] == 0.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1.0, 2.0], [0.0], [0, 0], [0, 1]), "nonmember_groups has 2 labels but nonmember_scores"),
        (([1.0, 2.0], [0.0], [0], [0]), "member_groups has 1 labels but member_scores has 2"),
        ((np.ones((3, 2)), [0.0], [0, 0, 0], [0]), "member_scores must be one score per record"),
        (([1.0], [0.0], [[0, 1]], [0]), "member_groups must be one group label per record"),
        (([1.0], [0.0], [0], ["a"]), "different kinds"),
    ],
)
def test_subgroup_risk_errors_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        subgroup_risk(*args)


def test_subgroup_risk_bad_q():
    with pytest.raises(ValueError, match="q must be in the half-open interval"):
        subgroup_risk([1.0], [0.0], [0], [0], q=(0.1, 1.5))


def test_planted_leaky_subgroup_has_clearly_higher_domias_auc():
    """Group 1's members are copied into the synthetic set; group 0's are not (DOMIAS §5.3)."""
    rng = np.random.default_rng(1)
    d = 3

    def population(n):
        g = (rng.random(n) < 0.2).astype(int)  # a minority group, shifted
        return rng.normal(size=(n, d)) + 3.0 * g[:, None], g

    mem, g_mem = population(400)
    non, g_non = population(400)
    ref, _ = population(2000)
    fresh, g_fresh = population(2500)  # a generator that learned the majority well...
    leaked = mem[g_mem == 1]  # ...and memorised the minority's members instead of its density
    copies = np.repeat(leaked, 5, axis=0) + 0.05 * rng.normal(size=(5 * len(leaked), d))
    syn = np.r_[fresh[g_fresh == 0], copies]
    s = domias_scores(np.r_[mem, non], syn, ref)
    out = subgroup_risk(s[:400], s[400:], g_mem, g_non)
    assert out[1]["auc"] > 0.8  # 0.843
    assert abs(out[0]["auc"] - 0.5) < 0.05  # 0.491
    assert out[1]["auc"] > out[0]["auc"] + 0.3
    assert out[1]["top_q_precision"][0.05] > 0.85 > out[1]["member_fraction"] + 0.3
    # the global AUC hides most of it
    assert privmon.auc(s[:400], s[400:]) < out[1]["auc"] - 0.2


# --- GeneratorQuery ------------------------------------------------------------------------------

D, LATENT = 6, 4


def population(n, rng):
    mix = np.eye(D) + 0.4 * np.random.default_rng(7).normal(size=(D, D))
    return (rng.normal(size=(n, D)) @ mix.T).astype(np.float32)


def make_generator(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(LATENT, 32), nn.Tanh(), nn.Linear(32, D))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    mem, non, ref = population(60, rng), population(90, rng), population(300, rng)
    return torch.from_numpy(mem), torch.from_numpy(non), torch.from_numpy(ref)


def draw_by_hand(generator, n, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        return generator(torch.randn(n, LATENT)).double()


def run_check(q, batches, seed):
    torch.manual_seed(seed)
    q.prepare()
    try:
        return torch.cat([q(b) for b in batches])
    finally:
        q.release()


@pytest.mark.parametrize("embed", [None, "pca"])
def test_generator_query_equals_the_functional_attacks(data, embed):
    mem, non, ref = data
    gen = make_generator()
    test = torch.cat([mem, non])
    batches = [mem[:25], mem[25:], non]
    syn = draw_by_hand(gen, 500, seed=11)
    kw = {"embed": embed, "embed_dim": 3 if embed else None}
    expected = {"domias": domias_scores(test, syn, ref, **kw)}
    if embed is None:  # the baselines fit their PCA on the synthetic set without a reference
        expected["eq1"] = eq1(test, syn)
        expected["gan_leaks"] = gan_leaks(test, syn)
    expected["gan_leaks_cal"] = gan_leaks_cal(test, syn, ref, **kw)
    for attack, want in expected.items():
        q = GeneratorQuery(gen, ref, attack=attack, n_samples=500, latent_dim=LATENT, **kw)
        got = run_check(q, batches, seed=11).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=attack)
        assert q.name == attack and q.higher_is_member is True


def test_monte_carlo_uses_an_eps_from_the_reference_set(data):
    mem, non, ref = data
    gen = make_generator()
    q = GeneratorQuery(gen, ref, attack="monte_carlo", n_samples=400, latent_dim=LATENT)
    assert q.discrete
    got = run_check(q, [mem, non], seed=5).numpy()
    syn = draw_by_hand(gen, 400, seed=5).numpy()
    r = ref.double().numpy()
    eps = np.median([np.min(np.sum((x - syn) ** 2, axis=1)) for x in r])
    test = torch.cat([mem, non]).double().numpy()
    want = np.array([np.sum(np.sum((x - syn) ** 2, axis=1) < eps) for x in test]) / 400
    np.testing.assert_array_equal(got, want)


def test_cache_is_hit_on_the_second_check_and_invalidated_by_new_content(data):
    mem, non, ref = data
    gen = make_generator()
    q = GeneratorQuery(gen, ref, n_samples=300, latent_dim=LATENT, embed="pca", embed_dim=4)
    plain = GeneratorQuery(
        gen, ref, n_samples=300, latent_dim=LATENT, embed="pca", embed_dim=4, cache=False
    )
    batches = [mem, non[:50], non[50:]]
    first = run_check(q, batches, seed=1)
    assert q.n_reference_evaluations == 150
    assert (q.cache_hits, q.cache_misses, q.cache_size) == (0, 3, 150)
    second = run_check(q, batches, seed=2)
    assert q.n_reference_evaluations == 150  # log p_R was not evaluated again
    assert (q.cache_hits, q.cache_misses) == (3, 3)
    torch.testing.assert_close(second, run_check(plain, batches, seed=2), rtol=0, atol=0)
    assert not torch.equal(first, second)  # a new synthetic sample per check
    # the same records in a new tensor still hit; changed content misses
    run_check(q, [mem.clone(), non[:50].clone(), non[50:]], seed=2)
    assert q.n_reference_evaluations == 150 and q.cache_hits == 6
    changed = non[50:].clone()
    changed[3, 0] += 1e-3
    out = run_check(q, [mem, non[:50], changed], seed=2)
    assert q.n_reference_evaluations == 190 and q.cache_misses == 4
    torch.testing.assert_close(out, run_check(plain, [mem, non[:50], changed], seed=2))
    # reordered records are other content too
    run_check(q, [mem.flip(0), non[:50], changed], seed=2)
    assert q.n_reference_evaluations == 250
    # bounded: only the last check's entries survive release()
    assert q.cache_size == 150
    for k in range(5):
        run_check(q, [mem + k, non], seed=3)
        assert q.cache_size == 150
    q.clear_cache()
    assert q.cache_size == 0


def test_cache_false_evaluates_every_call(data):
    mem, non, ref = data
    q = GeneratorQuery(make_generator(), ref, n_samples=300, latent_dim=LATENT, cache=False)
    for seed in (1, 2):
        run_check(q, [mem, non], seed=seed)
    assert q.n_reference_evaluations == 300 and q.cache_size == 0


def test_monitor_writes_domias_auc_equal_to_privmon_auc(data, tmp_path):
    mem, non, ref = data
    gen = make_generator()
    q = GeneratorQuery(gen, ref, n_samples=400, latent_dim=LATENT, embed="pca", name="domias")
    monitor = privmon.PrivacyMonitor(
        q,
        [mem[:30], mem[30:]],
        [non[:45], non[45:]],
        every_n_steps=1,
        sinks=[JsonlSink(str(tmp_path / "checks.jsonl"))],
        strict=True,
    )
    torch.manual_seed(123)
    state = torch.get_rng_state()
    report = monitor.check(1)
    monitor.close()
    assert torch.equal(torch.get_rng_state(), state)  # the check restored the RNG
    # the same synthetic sample by hand: the check drew from this very RNG state
    scores_m = run_check(q, [mem[:30], mem[30:]], seed=123)
    scores_n = run_check(q, [non[:45], non[45:]], seed=123)
    want = privmon.auc(scores_m, scores_n)
    assert report.scalars["privacy/domias/auc"] == want
    with open(tmp_path / "checks.jsonl", encoding="utf-8") as f:
        line = json.loads(f.readline())
    assert line["scalars"]["privacy/domias/auc"] == want
    for key in ("histogram/value", "histogram/lower", "kde/value", "accuracy_at_median"):
        assert f"privacy/domias/{key}" in line["scalars"]
    assert report.queries["domias"].dim == 1


def test_training_with_the_monitor_is_bit_identical(data):
    mem, non, ref = data

    def train(with_monitor):
        gen = make_generator(seed=5)
        disc = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 1))
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
        monitor = None
        if with_monitor:
            q = GeneratorQuery(gen, ref, n_samples=200, latent_dim=LATENT, embed="pca")
            monitor = privmon.PrivacyMonitor(q, [mem], [non], every_n_steps=2, strict=True)
        bce = nn.BCEWithLogitsLoss()
        labels = torch.cat([torch.ones(32), torch.zeros(32)])
        for step in range(1, 7):
            fake = gen(torch.randn(32, LATENT))
            real = mem[torch.randint(len(mem), (32,))]
            loss_d = bce(disc(torch.cat([real, fake.detach()])).squeeze(1), labels)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake).squeeze(1), torch.ones(32)).backward()
            opt_g.step()
            if monitor is not None:
                monitor.step(step)
        if monitor is not None:
            assert len(monitor.history) == 3 and monitor.n_failed == 0
        return gen.state_dict(), gen.training

    torch.manual_seed(0)
    plain, mode_plain = train(False)
    torch.manual_seed(0)
    monitored, mode_monitored = train(True)
    assert mode_plain is mode_monitored is True
    for k in plain:
        assert torch.equal(plain[k], monitored[k]), k


def test_sample_fn_nan_records_and_images(data):
    mem, non, ref = data
    syn = draw_by_hand(make_generator(), 300, seed=0).float()
    q = GeneratorQuery(None, ref.reshape(-1, 2, 3), sample_fn=lambda n, dev: syn[:n], n_samples=300)
    assert q.modules == ()
    q.prepare()
    x = torch.cat([mem, non]).reshape(-1, 2, 3).clone()  # image-like records are flattened
    x[4, 1, 2] = float("nan")
    s = q(x)
    q.release()
    assert math.isnan(s[4]) and int(torch.isfinite(s).sum()) == len(x) - 1
    want = domias_scores(torch.cat([x[:4], x[5:]]).reshape(-1, D), syn, ref)
    np.testing.assert_allclose(torch.cat([s[:4], s[5:]]).numpy(), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attack": "logan"}, "attack must be one of"),
        ({"bandwidth": -1.0}, "bandwidth must be"),
        ({"embed": "umap"}, "embed must be None, 'pca' or a callable"),
        ({"embed": "pca", "embed_dim": 7}, r"embed_dim must be an integer in \[1, d = 6\]"),
        ({"embed_dim": 3}, "embed_dim is only used with embed='pca'"),
        ({"n_samples": 5}, "n_samples must be >= 7"),
        ({"latent_dim": None}, "latent_dim is required"),
        ({"cache": 1}, "cache must be True or False"),
        ({"name": ""}, "name must be a non-empty string"),
    ],
)
def test_bad_configuration_fails_at_construction(data, kwargs, message):
    _, _, ref = data
    args = {"latent_dim": LATENT, **kwargs}
    with pytest.raises(ValueError, match=message):
        GeneratorQuery(make_generator(), ref, **args)


def test_singular_reference_and_wrong_dimensions(data):
    mem, _, ref = data
    flat = ref.clone()
    flat[:, 2] = 1.0
    with pytest.raises(ValueError, match="reference: the data covariance is singular"):
        GeneratorQuery(make_generator(), flat, latent_dim=LATENT)
    q = GeneratorQuery(make_generator(), ref, latent_dim=LATENT, n_samples=100)
    with pytest.raises(RuntimeError, match="prepare"):
        q(mem)
    q.prepare()
    with pytest.raises(ValueError, match="input has 5 values per record but reference has 6"):
        q(mem[:, :5])
    q.release()
    assert q.synthetic is None
    assert set(ATTACKS) == {"domias", "eq1", "gan_leaks", "gan_leaks_cal", "monte_carlo", "dcr"}


def test_callable_encoder_is_applied_once_to_the_reference(data):
    mem, non, ref = data
    torch.manual_seed(4)
    encoder = nn.Sequential(nn.Linear(D, 3)).double()
    encoder.train()
    gen = make_generator()
    q = GeneratorQuery(gen, ref, n_samples=300, latent_dim=LATENT, embed=encoder)
    assert encoder in q.modules and q.embed_dim is None
    got = run_check(q, [mem, non], seed=9)
    assert q.embed_dim == 3 and encoder.training  # mode restored
    syn = draw_by_hand(gen, 300, seed=9)
    want = domias_scores(torch.cat([mem, non]), syn, ref, embed=encoder)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-10)
    run_check(q, [mem, non], seed=10)
    assert q.n_reference_evaluations == 150 and q.cache_hits == 2


def test_tabular_example_runs(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    root = Path(__file__).resolve().parents[2]
    png = tmp_path / "fig3.png"
    args = ["--sizes", "25,100", "--fixed-epochs", "40", "--epochs", "5,40"]
    args += ["--fixed-size", "50", "--seeds", "1", "--no-logan", "--n-synthetic", "500"]
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "domias_tabular.py"), *args, "--plot", str(png)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=root,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit() and len(cells) == 6:
            rows.setdefault(int(cells[0]), []).append([float(c) for c in cells[1:]])
    assert set(rows) == {5, 25, 40, 100}, proc.stdout
    assert all(0.0 <= v <= 1.0 for r in rows.values() for vals in r for v in vals)
    assert "(c) AUC per subgroup (class)" in proc.stdout
    assert png.stat().st_size > 10_000
