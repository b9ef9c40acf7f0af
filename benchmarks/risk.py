"""Benchmark Song & Mittal's metric attacks and privacy risk score: speed, and calibration on
records the score was not fitted on.

Run from the repository root::

    python benchmarks/risk.py                 # the three tables (minutes on 2 CPU cores)
    python benchmarks/risk.py --resolution    # table 3 only
    python benchmarks/risk.py --quick         # 10^4 records only, fewer repeats
    python benchmarks/risk.py --device cuda   # time on a GPU (inputs as CUDA tensors)
    python benchmarks/risk.py --threads 1     # torch intra-op threads (see below)

It prints the machine, then three markdown tables (progress goes to stderr).

**Table 1 — time.** A synthetic 10-class classifier output: for members the true-class
probability p_y ~ Beta(a_y, 1) with a_y from 2 (class 0) to 8 (class 9), for non-members
Beta(2, 1); the remaining mass is spread over the other classes by a flat Dirichlet. ``n`` is
the number of fitting records (n/2 members + n/2 non-members) and also the number of records
scored. Each cell is the median of several calls after one warm-up call, inputs already on the
device as float64 tensors: ``MetricAttack`` fit / evaluate (modified entropy, class-dependent
thresholds), ``PrivacyRiskScore`` fit / score (modified entropy, class-conditional, histogram).
The GPU timings synchronize before reading the clock.

**Table 2 — calibration** (§4.2.1): the score is fitted on one half of the members and of the
non-members and evaluated on the other halves: ``rmse`` is :func:`privmon.attacks.risk_score.
calibration`'s count-weighted RMSE over 10 bins, ``auc`` the held-out AUC of the score, and for
the synthetic rows, where the posterior given (p_y, y) is known, ``vs truth`` is the RMSE of the
confidence-based score against it. The digits rows train an MLP (64-128-10, tanh, Adam, 200
full-batch epochs) on half of sklearn's load_digits, with clean labels (a weak leak, test
accuracy ~97 %) or 10 % of the labels flipped (memorized on members: a strong leak).

**Table 3 — resolution** (``--resolution`` prints only this one): one score per cell
(``interpolate=False``, the default) against ``interpolate=True``. Gaussian rows: a two-class
output whose true-class probability is sigmoid(s), s ~ N(1, 1) for members and N(0, 1) for
non-members, so the true posterior is known; n + n fitting records, 10,000 + 10,000 held-out,
mean over 20 seeds. Digits rows: the 10 %-flipped MLP above, mean over 4 seeds (~900 held-out
records). ``distinct`` counts the distinct held-out scores; ``rmse`` is :func:`calibration`'s;
``excess`` removes its binomial sampling noise, sqrt(max(rmse² − Σ_b n_b·o_b(1 − o_b)/(n_b − 1)
/ N, 0)), which a score spread over more calibration bins pays more of.

**Shared machines.** torch's CPU backend is OpenMP; on a busy machine its spinning threads can
make small calls many times slower. ``--threads 1`` (or ``OMP_WAIT_POLICY=PASSIVE``) avoids it;
the first output line shows the setting and the load average.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import privmon
from privmon.attacks.metric import MetricAttack
from privmon.attacks.risk_score import PrivacyRiskScore, calibration

N_CLASSES = 10
A_MEMBER = np.linspace(2.0, 8.0, N_CLASSES)
A_NONMEMBER = 2.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- data ------------------------------------------------------------------------------------------
def synthetic(n: int, member: bool, rng: np.random.Generator):
    """(probs, labels, p_y) of n records of the 10-class synthetic classifier."""
    y = rng.integers(0, N_CLASSES, n)
    a = A_MEMBER[y] if member else np.full(n, A_NONMEMBER)
    py = rng.beta(a, 1.0)
    rest = rng.dirichlet(np.ones(N_CLASSES - 1), n) * (1 - py)[:, None]
    probs = np.empty((n, N_CLASSES))
    cols = np.arange(N_CLASSES)[None, :]
    other = cols != y[:, None]
    probs[other] = rest.reshape(-1)
    probs[np.arange(n), y] = py
    return probs, y, py


def true_posterior(py: np.ndarray, y: np.ndarray, prior: float = 0.5) -> np.ndarray:
    """P(member | p_y, y): the rest of the vector is distributed alike for both groups."""
    a1 = A_MEMBER[y]
    f1 = a1 * py ** (a1 - 1)
    f0 = A_NONMEMBER * py ** (A_NONMEMBER - 1)
    return prior * f1 / (prior * f1 + (1 - prior) * f0)


def split_sets(n: int, seed: int):
    """Fitting sets (n/2 members, n/2 non-members) and held-out sets of the same sizes."""
    rng = np.random.default_rng(seed)
    half = n // 2
    fit = (*synthetic(half, True, rng)[:2], *synthetic(half, False, rng)[:2])
    mp, my, mpy = synthetic(half, True, rng)
    hp, hy, hpy = synthetic(half, False, rng)
    return fit, (mp, my, mpy), (hp, hy, hpy)


def digits_outputs(label_noise: float, seed: int = 0):
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    rng = np.random.default_rng(seed)
    flip = rng.random(len(y)) < label_noise
    y = np.where(flip, rng.integers(0, 10, len(y)), y)
    member = np.zeros(len(y), bool)
    member[rng.permutation(len(y))[: len(y) // 2]] = True
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    for _ in range(200):
        opt.zero_grad()
        F.cross_entropy(model(xt[member]), yt[member]).backward()
        opt.step()
    with torch.no_grad():
        probs = F.softmax(model(xt).double(), 1).numpy()
    fit = rng.random(len(y)) < 0.5
    return probs, y, member, fit


# -- timing ----------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def time_size(n: int, device: torch.device, reps: int) -> str:
    log(f"timing n = {n:,} on {device}")
    (pm, ym, ph, yh), (mp, my, _), (hp, hy, _) = split_sets(n, seed=1)
    t = [torch.as_tensor(a, device=device) for a in (pm, ym, ph, yh, mp, my, hp, hy)]
    fit_args, held_args = t[:4], t[4:]
    xs, ys = torch.cat([t[4], t[6]]), torch.cat([t[5], t[7]])
    att = MetricAttack("mentr").fit(*fit_args)
    prs = PrivacyRiskScore().fit(*fit_args)
    t_af = timed(lambda: MetricAttack("mentr").fit(*fit_args), device, reps)
    t_ae = timed(lambda: att.evaluate(*held_args), device, reps)
    t_rf = timed(lambda: PrivacyRiskScore().fit(*fit_args), device, reps)
    t_rs = timed(lambda: prs.score(xs, ys), device, reps)
    t_tot = timed(lambda: PrivacyRiskScore().fit(*fit_args).score(xs, ys), device, reps)
    return (
        f"| {n:,} + {n:,} | {fmt_ms(t_af)} | {fmt_ms(t_ae)} | {fmt_ms(t_rf)} "
        f"| {fmt_ms(t_rs)} | {fmt_ms(t_tot)} |"
    )


def table_time(sizes, device: torch.device, reps: int) -> list[str]:
    rows = [
        "| n (fit) + n (scored) | MetricAttack fit | MetricAttack evaluate "
        "| PrivacyRiskScore fit | PrivacyRiskScore score | risk score fit + score |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        rows.append(time_size(n, device, reps))
    return rows


# -- calibration -----------------------------------------------------------------------------------
def table_calibration(n_synth: int) -> list[str]:
    rows = [
        "| setting | metric | class-conditional | fit records | held-out records "
        "| rmse | auc | vs truth |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    log(f"calibration: synthetic n = {n_synth:,}")
    fit, (mp, my, mpy), (hp, hy, hpy) = split_sets(n_synth, seed=2)
    x, y = np.concatenate([mp, hp]), np.concatenate([my, hy])
    member = np.r_[np.ones(len(my), bool), np.zeros(len(hy), bool)]
    truth = true_posterior(np.concatenate([mpy, hpy]), y)
    for metric in ("mentr", "confidence"):
        for cc in (True, False):
            s = PrivacyRiskScore(metric=metric, class_conditional=cc).fit(*fit).score(x, y)
            cal = calibration(s, member)
            auc = privmon.auc(s[member], s[~member])
            vs = f"{np.sqrt(np.mean((s - truth) ** 2)):.4f}" if metric == "confidence" else "–"
            rows.append(
                f"| synthetic, 10 classes | {metric} | {cc} | {n_synth:,} | {len(y):,} "
                f"| {cal.rmse:.4f} | {auc:.3f} | {vs} |"
            )
    for noise in (0.0, 0.1):
        log(f"calibration: digits MLP, label noise {noise}")
        probs, y, member, fit = digits_outputs(noise)
        args = (probs[fit & member], y[fit & member], probs[fit & ~member], y[fit & ~member])
        held = member[~fit]
        for metric in ("mentr", "confidence"):
            s = PrivacyRiskScore(metric=metric).fit(*args).score(probs[~fit], y[~fit])
            cal = calibration(s, held)
            auc = privmon.auc(s[held], s[~held])
            name = "digits MLP" + (f", {noise:.0%} labels flipped" if noise else ", clean")
            rows.append(
                f"| {name} | {metric} | True | {int(fit.sum()):,} | {int((~fit).sum()):,} "
                f"| {cal.rmse:.4f} | {auc:.3f} | – |"
            )
    return rows


def excess_miscalibration(cal) -> float:
    """Calibration RMSE with the binomial noise of each bin's member fraction removed."""
    ok = cal.counts > 1
    n, o = cal.counts[ok], cal.observed[ok]
    noise = float(np.sum(n * o * (1 - o) / (n - 1)) / cal.counts.sum())
    return math.sqrt(max(cal.rmse**2 - noise, 0.0))


def gaussian_outputs(n: int, rng: np.random.Generator):
    """Two-class outputs of n members and n non-members (true-class probability sigmoid(s))."""
    s = np.r_[rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n)]
    p = 1 / (1 + np.exp(-s))
    member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    truth = 1 / (1 + np.exp(-(s - 0.5)))  # N(1,1) vs N(0,1): log-likelihood ratio s − 1/2
    return np.stack([p, 1 - p], 1), np.zeros(2 * n, np.int64), member, truth


def table_resolution() -> list[str]:
    rows = [
        "| setting | fit records | interpolate | distinct scores | rmse | excess | vs truth |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for n in (400, 5000):
        log(f"resolution: Gaussian, {n} + {n}")
        stats: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
        for seed in range(20):
            rng = np.random.default_rng(seed)
            pf, yf, mf, _ = gaussian_outputs(n, rng)
            px, yx, mx, truth = gaussian_outputs(10_000, rng)
            for interp in (False, True):
                r = PrivacyRiskScore(metric="confidence", interpolate=interp)
                s = r.fit(pf[mf], yf[mf], pf[~mf], yf[~mf]).score(px, yx)
                cal = calibration(s, mx)
                err = float(np.sqrt(np.mean((s - truth) ** 2)))
                stats[interp].append((len(np.unique(s)), cal.rmse, excess_miscalibration(cal), err))
        for interp in (False, True):
            d, rmse, ex, err = np.mean(stats[interp], axis=0)
            rows.append(
                f"| Gaussian, N(1,1) vs N(0,1) | {n:,} + {n:,} | {interp} | {d:.0f} "
                f"| {rmse:.4f} | {ex:.4f} | {err:.4f} |"
            )
    log("resolution: digits MLP, 10 % labels flipped")
    stats = {False: [], True: []}
    for seed in range(4):
        probs, y, member, fit = digits_outputs(0.1, seed)
        args = (probs[fit & member], y[fit & member], probs[fit & ~member], y[fit & ~member])
        for interp in (False, True):
            s = PrivacyRiskScore(interpolate=interp).fit(*args).score(probs[~fit], y[~fit])
            cal = calibration(s, member[~fit])
            stats[interp].append((len(np.unique(s)), cal.rmse, excess_miscalibration(cal)))
    for interp in (False, True):
        d, rmse, ex = np.mean(stats[interp], axis=0)
        rows.append(
            f"| digits MLP, 10 % labels flipped, mentr | {int(fit.sum()):,} | {interp} "
            f"| {d:.0f} | {rmse:.4f} | {ex:.4f} | – |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^4 records, fewer repeats")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--sizes", default=None, help="comma-separated n, e.g. 1e4,1e5")
    ap.add_argument("--resolution", action="store_true", help="table 3 only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = (
        [int(float(s)) for s in args.sizes.split(",")]
        if args.sizes
        else ([10_000] if args.quick else [10_000, 100_000])
    )
    reps = 3 if args.quick else 5
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "–"
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
        f"load {os.getloadavg()[0]:.1f}, device {device} {gpu}\n"
    )
    if not args.resolution:
        print("\n".join(table_time(sizes, device, reps)))
        print()
        print("\n".join(table_calibration(20_000 if args.quick else 100_000)))
        print()
    print("\n".join(table_resolution()))


if __name__ == "__main__":
    main()
