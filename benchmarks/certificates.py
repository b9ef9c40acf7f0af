"""What the monitor's certificates mean over a run, and what that costs: prints two tables.

1. Null runs (nothing leaks): a monitor with two queries whose member and non-member scores are
   identically distributed (one Gaussian, one skewed loss-like), 300 + 300 records, histogram +
   KDE, 40 checks with fresh draws each (independent checks, the union bound's worst case), a
   real Opacus accountant at a tiny ε. The fraction of runs with any certified leakage (any
   ``…/lower`` above 0) and with any DP-violation alarm, at ``interval_delta`` = 0.05, with a 95 %
   Clopper–Pearson interval. ``lower_check`` (the per-check bound) is shown beside ``lower`` where
   the installed privmon reports it.
2. Power: a real leak, true advantage 2Φ(0.4) − 1 = 0.311 (members N(0.8, 1), non-members
   N(0, 1)), 300 + 300 records, two queries × two methods, 10 checks. The mean over runs of the
   run's best certified lower bound under each way of spending δ.
3. Power on a growing leak: 40 checks, the members' shift growing linearly from 0 to 0.8, so the
   leak reaches 0.311 only at the last check (a model memorising as it trains).

    python benchmarks/certificates.py                 # both tables, 200 runs each
    python benchmarks/certificates.py --runs 50 --section null
    PYTHONPATH=/path/to/old/checkout python benchmarks/certificates.py --section null

Runs on one torch thread (tiny tensors: OpenMP threads only spin on a shared machine).
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import numpy as np
import torch
from opacus.accountants import RDPAccountant
from scipy.stats import beta

import privmon
from privmon.queries import CallableQuery

N, DELTA = 300, 0.05


class Draws:
    """Fresh scores at every call: members (batch of ones) ~ N(shift, 1), non-members (zeros)
    ~ N(0, 1); ``skewed``: exp(2·score), a heavy right tail like per-record losses."""

    def __init__(self, seed: int, shift: float = 0.0, skewed: bool = False):
        self.rng = np.random.default_rng(seed)
        self.shift, self.skewed = shift, skewed

    def __call__(self, batch):
        scores = self.rng.normal(size=len(batch)) + self.shift * batch
        return torch.from_numpy(np.exp(2 * scores) if self.skewed else scores)


def _interval(k: int, n: int) -> str:
    lo = beta.ppf(0.025, k, n - k + 1) if k > 0 else 0.0
    hi = beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    return f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]"


def null_runs(runs: int, checks: int) -> None:
    counts = {"lower": 0, "lower_check": 0, "alarm": 0}
    has_check = False
    t0 = time.perf_counter()
    for seed in range(runs):
        acc = RDPAccountant()
        acc.history = [(40.0, 0.01, 100)]  # ε ≈ 0.02 at δ = 1e-5: a ceiling near 0
        mon = privmon.PrivacyMonitor(
            [
                CallableQuery(Draws(seed), name="gauss"),
                CallableQuery(Draws(10_000 + seed, skewed=True), name="loss"),
            ],
            [np.ones(N)],
            [np.zeros(N)],
            strict=True,
            interval_delta=DELTA,
            accountant=acc,
        )
        hit = dict.fromkeys(counts, False)
        for k in range(1, checks + 1):
            rep = mon.check(k)
            for tag, v in rep.scalars.items():
                field = tag.rsplit("/", 1)[-1]
                if field in ("lower", "lower_check") and v > 1e-12:
                    hit[field] = True
            has_check = has_check or any(t.endswith("/lower_check") for t in rep.scalars)
            hit["alarm"] = hit["alarm"] or rep.dp_violation
        for key in counts:
            counts[key] += hit[key]
    print(
        f"\nNull runs: {runs} runs × {checks} checks × 2 queries × 2 methods, {N} + {N} records, "
        f"interval_delta = {DELTA} ({time.perf_counter() - t0:.0f} s)"
    )
    print("| figure | runs with any certified leakage / alarm (95 % CI) |")
    print("|---|---|")
    print(f"| `lower` | {_interval(counts['lower'], runs)} |")
    if has_check:
        print(f"| `lower_check` (per check) | {_interval(counts['lower_check'], runs)} |")
    print(f"| DP-violation alarm | {_interval(counts['alarm'], runs)} |")


def power(runs: int, checks: int, *, growing: bool = False) -> None:
    """Mean best certified lower bound. ``growing``: the leak grows linearly over the run, from
    nothing at the first check to 0.311 at the last (as a model memorises), instead of 0.311
    throughout."""
    from privmon.estimators.spending import check_delta

    figures = 4  # 2 queries × 2 methods
    schemes = {
        "per check (`lower_check`, not valid over the run)": lambda k: DELTA,
        "union bound, 6δ/(π²k²) (reference)": lambda k: 6 * DELTA / (math.pi**2 * k**2) / figures,
        "privmon default (unknown run length)": lambda k: check_delta(k, delta=DELTA) / figures,
        f"privmon, planned_checks={checks}": lambda k: (
            check_delta(k, delta=DELTA, planned_checks=checks) / figures
        ),
    }
    best = {name: [] for name in schemes}
    t0 = time.perf_counter()
    for seed in range(runs):
        queries = [Draws(seed, shift=0.8), Draws(10_000 + seed, shift=0.8)]
        run_best = dict.fromkeys(schemes, 0.0)
        for k in range(1, checks + 1):
            for q in queries:
                if growing:
                    q.shift = 0.8 * (k - 1) / (checks - 1)
                mem, non = q(np.ones(N)), q(np.zeros(N))
                for name, share in schemes.items():
                    res = privmon.analyse(mem, non, delta=DELTA, certify_delta=share(k))
                    top = max(e.lower for e in res.estimates.values())
                    run_best[name] = max(run_best[name], top)
        for name in schemes:
            best[name].append(run_best[name])
    leak = "growing from 0 to 0.311 at the last check" if growing else "0.311 at every check"
    print(
        f"\nPower: true advantage {leak}, {N} + {N} records, {checks} checks × 2 queries × 2 "
        f"methods, {runs} runs ({time.perf_counter() - t0:.0f} s)"
    )
    print("| spending | mean best certified lower bound | runs certifying leakage |")
    print("|---|---:|---:|")
    for name, values in best.items():
        v = np.asarray(values)
        print(f"| {name} | {v.mean():.3f} | {(v > 0).mean():.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--section", choices=("null", "power", "growing", "all"), default="all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the null runs' DP warnings, opacus' alpha range notes
    if args.section in ("null", "all"):
        null_runs(args.runs, checks=40)
    if args.section in ("power", "all"):
        power(args.runs, checks=10)
    if args.section in ("growing", "all"):
        power(args.runs, checks=40, growing=True)


if __name__ == "__main__":
    main()
