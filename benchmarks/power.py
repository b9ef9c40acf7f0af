"""What the certified lower bound can certify at real audit sizes, and that it stays valid.

Run from the repository root (one torch thread); the ``privmon`` on the path is measured, so an
older checkout gives the "before" tables::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/power.py                  # every table
    OMP_WAIT_POLICY=PASSIVE python benchmarks/power.py --section power --runs 100
    PYTHONPATH=/path/to/old/checkout python benchmarks/power.py --section power

Scores are 1-D Gaussians unless said: members N(μ, 1), non-members N(0, 1), whose optimal
advantage at prior p is p·(2·Φ(μ − x*) − 1) + (1 − p)·(2·Φ(x*) − 1), x* = μ/2 − log(p/(1−p))/μ
(the densities cross at x*); at p = 1/2, 2Φ(μ/2) − 1. Every figure is ``privmon.analyse``'s, the
monitor's call, at the δ the monitor gives a check: ``check_delta(k, delta=0.05,
planned_checks=15) / figures``, figures = 2 (one query, histogram + KDE, the monitor's default)
or 1 (one certified method per query). With fresh draws at every check the run-level figure at
the last check is one call at the last check's δ, which is what is simulated.

Tables (``--section``):

* ``null`` — nothing leaks (members and non-members from one distribution): the fraction of
  seeded calls certifying leakage (``lower`` > 0) at δ = 0.05 and 0.2 per call, for each rule and
  certificate path (1-D histogram and KDE, 2-D histogram, the learned rule at d = 3, and a
  discrete score with 5 values), and the fraction of 15-check monitor runs (fresh draws at each
  check) certifying at any check, with 95 % Clopper–Pearson intervals. Valid: at most δ.
* ``coverage`` — a known leak: the fraction of calls whose ``lower`` (δ = 0.05) exceeds the
  truth (valid: at most 0.05) and the mean ``lower``, at p = 1/2 and 0.3.
* ``power`` — the issue's goals: true advantage 0.3 at p = 1/2; at 500 + 500 the fraction of
  runs whose run-level ``lower`` at the last of 15 planned checks exceeds 0.1 (goal ≥ 80 %), at
  200 + 200 its mean (goal ≥ 0.093, what one call at δ = 0.05 gave before), for the histogram
  and the KDE, two and one certified figures per check, planned and unplanned spending.
* ``detect`` — :func:`privmon.detectable_advantage` (the smallest advantage certified in half
  the runs by a rule as good as the optimal one) per audit size and δ, and the fraction of
  seeded 1-D runs at that advantage that certify with the rule privmon learns (≈ 0.5 when the
  rule loses nothing); :func:`privmon.audit_records_needed` for a few advantages.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import numpy as np
import torch
from scipy.stats import beta, norm

import privmon
from privmon.estimators.spending import check_delta

DELTA = 0.05  # the run's interval_delta
CHECKS = 15


def truth(mu: float, prior: float) -> float:
    """Optimal advantage of N(μ, 1) against N(0, 1) at prior p (module docstring)."""
    cross = mu / 2 - math.log(prior / (1 - prior)) / mu
    return prior * (2 * norm.cdf(mu - cross) - 1) + (1 - prior) * (2 * norm.cdf(cross) - 1)


def shift_for(advantage: float) -> float:
    """μ with 2Φ(μ/2) − 1 = advantage (prior 1/2)."""
    return 2 * float(norm.ppf((1 + advantage) / 2))


def interval(k: int, n: int) -> str:
    lo = beta.ppf(0.025, k, n - k + 1) if k > 0 else 0.0
    hi = beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    return f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]"


def share(figures: int, *, planned: bool = True) -> float:
    """The δ of each figure at the last check of a 15-check run."""
    return check_delta(CHECKS, delta=DELTA, planned_checks=CHECKS if planned else None) / figures


def null_draws(path: str, rng: np.random.Generator, n: int):
    if path == "discrete (5 values)":
        return rng.integers(0, 5, n).astype(float), rng.integers(0, 5, n).astype(float)
    d = {"2-D histogram": 2, "3-D learned": 3}.get(path, 1)
    shape = (n, d) if d > 1 else (n,)
    return rng.normal(size=shape), rng.normal(size=shape)


def null(runs: int) -> None:
    print(f"\n### Null: nothing leaks, {runs} seeded calls per cell (runs: 15 checks each)\n")
    print(
        "| path | n per class | δ = 0.05 per call | δ = 0.2 per call | run of 15 checks, δ = 0.05 |"
    )
    print("|---|---:|---:|---:|---:|")
    paths = ("1-D histogram", "1-D kde", "2-D histogram", "3-D learned", "discrete (5 values)")
    for path in paths:
        method = "kde" if path == "1-D kde" else "histogram"
        for n in (200, 500):
            if path == "3-D learned" and n == 500:
                continue
            hits = {0.05: 0, 0.2: 0, "run": 0}
            calls = runs if path != "3-D learned" else runs // 2
            for seed in range(calls):
                rng = np.random.default_rng(seed)
                m, h = null_draws(path, rng, n)
                for delta in (0.05, 0.2):
                    est = privmon.optimal_advantage(m, h, method=method, delta=delta)
                    hits[delta] += est.lower > 0
                if path.startswith("1-D"):  # a monitor run: 15 checks, fresh draws each
                    run = any(
                        privmon.optimal_advantage(
                            *null_draws(path, rng, n), method=method, delta=share(2)
                        ).lower
                        > 0
                        for _ in range(CHECKS)
                    )
                    hits["run"] += run
            run_cell = interval(hits["run"], calls) if path.startswith("1-D") else "—"
            print(
                f"| {path} | {n} | {interval(hits[0.05], calls)} | {interval(hits[0.2], calls)} "
                f"| {run_cell} |"
            )


def coverage(runs: int) -> None:
    print(f"\n### Coverage at a known leak: δ = 0.05 per call, {runs} seeded calls per cell\n")
    print("| μ | prior | truth | n per class | method | lower > truth | mean lower | mean value |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for mu, prior in ((shift_for(0.3), 0.5), (0.3, 0.5), (1.5, 0.3)):
        t = truth(mu, prior)
        for n in (200, 500, 2000):
            for method in ("histogram", "kde"):
                misses, lowers, values = 0, [], []
                for seed in range(runs):
                    rng = np.random.default_rng(seed)
                    m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
                    est = privmon.optimal_advantage(m, h, prior=prior, method=method, delta=0.05)
                    misses += est.lower > t
                    lowers.append(est.lower)
                    values.append(est.value)
                print(
                    f"| {mu:.3f} | {prior} | {t:.3f} | {n} | {method} | {interval(misses, runs)} "
                    f"| {np.mean(lowers):.3f} | {np.mean(values):.3f} |"
                )


def power(runs: int) -> None:
    mu = shift_for(0.3)
    print(
        f"\n### Power: true advantage 0.3 (μ = {mu:.4f}), prior 1/2, the last of {CHECKS} checks "
        f"of a run at δ = {DELTA}, {runs} seeded runs\n"
    )
    print("| n per class | method | figures per check | spending | δ per figure "
          "| mean run-level lower | runs with lower > 0.1 |")  # fmt: skip
    print("|---:|---|---:|---|---:|---:|---:|")
    settings = [
        ("one call", None, None),
        ("planned", 2, True),
        ("planned", 1, True),
        ("unplanned", 2, False),
    ]
    for n in (200, 500):
        for method in ("histogram", "kde"):
            for spending, figures, planned in settings:
                delta = 0.05 if figures is None else share(figures, planned=bool(planned))
                lowers = []
                for seed in range(runs):
                    rng = np.random.default_rng(seed)
                    m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
                    res = privmon.analyse(m, h, methods=(method,), certify_delta=delta, top_k=0)
                    lowers.append(res.estimates[method].lower)
                v = np.asarray(lowers)
                print(
                    f"| {n} | {method} | {figures or '—'} | {spending} | {delta:.2e} "
                    f"| {v.mean():.3f} | {(v > 0.1).mean():.2f} |"
                )


def detect(runs: int) -> None:
    if not hasattr(privmon, "detectable_advantage"):
        print("\n(this privmon has no detectable_advantage)")
        return
    print(
        "\n### Smallest detectable advantage (certified > 0 in half the runs), prior 1/2; in "
        f"brackets the fraction of {runs} seeded 1-D Gaussian runs at that advantage that "
        "certify with privmon's learned histogram rule\n"
    )
    deltas = {
        "one call, δ = 0.05": 0.05,
        "run, 15 planned checks, 1 figure": share(1),
        "run, 15 planned checks, 2 figures": share(2),
    }
    print("| n per class | " + " | ".join(deltas) + " |")
    print("|---:|" + "---:|" * len(deltas))
    for n in (100, 200, 500, 1000, 2000, 5000, 20000):
        cells = []
        for delta in deltas.values():
            found = privmon.detectable_advantage(n, n, delta=delta)
            if n <= 2000 and math.isfinite(found):
                mu, hits = shift_for(found), 0
                for seed in range(runs):
                    rng = np.random.default_rng(seed)
                    m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
                    hits += privmon.optimal_advantage(m, h, delta=delta).lower > 0
                cells.append(f"{found:.3f} ({hits / runs:.2f})")
            else:
                cells.append(f"{found:.3f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n### Audit records needed per class, prior 1/2 (run: 15 planned checks, 2 figures)\n")
    print("| true advantage | certified > 0, half the runs | certified > 0, 80 % of runs "
          "| lower > 0.1, 80 % of runs |")  # fmt: skip
    print("|---:|---:|---:|---:|")
    for advantage in (0.05, 0.1, 0.2, 0.3, 0.5):
        needed = [
            privmon.audit_records_needed(advantage, delta=share(2)),
            privmon.audit_records_needed(advantage, delta=share(2), power=0.8),
            privmon.audit_records_needed(advantage, delta=share(2), power=0.8, threshold=0.1)
            if advantage > 0.1
            else None,
        ]
        print(
            f"| {advantage} | " + " | ".join("—" if v is None else f"{v:,}" for v in needed) + " |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument(
        "--section", choices=("null", "coverage", "power", "detect", "all"), default="all"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"privmon {privmon.__file__}, torch {torch.__version__}, 1 thread")
    t0 = time.perf_counter()
    for name, section in (
        ("power", power),
        ("detect", detect),
        ("coverage", coverage),
        ("null", null),
    ):
        if args.section in (name, "all"):
            section(args.runs)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
