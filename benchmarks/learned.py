"""High-dimensional queries: ``privmon.optimal_advantage`` above 2-D against the analytic truth.

Run from the repository root (one torch thread); the ``privmon`` on the path is measured, so an
older checkout gives the "before" tables::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/learned.py
    PYTHONPATH=/path/to/old/checkout python benchmarks/learned.py
    python benchmarks/learned.py --seeds 2 --runs 20      # quicker

All cases have 2,000 members + 2,000 non-members at prior 1/2 and report the mean over seeds of
``value`` and of the certified ``lower`` (δ = 0.05) of ``optimal_advantage(method="histogram")``
(above 2-D both methods measure the same learned rule; they differ only in the plug-in).

Leaking cases (``--seeds`` each), members N(μ, I) or N(0, s²·I) against non-members N(0, I):

* shift d: μ = 0.1·1 (all d coordinates); truth 2Φ(‖μ‖/2) − 1.
* few 64: μ = 0.4 on 4 of 64 coordinates (the same ‖μ‖ = 0.8 as shift 64, so the same truth).
* weak 64 / weak few 64: μ = 0.03·1, or 0.12 on 4 of 64 coordinates; truth 0.096.
* scale 16: s = 1.25; truth F(r²) − F(r²/s²), F the χ²₁₆ CDF, r² = d·log(s²) / (1 − 1/s²) the
  radius where the two densities cross.

Columns: the truth, mean value and lower, the median seconds per call (measured under whatever
load the machine has), how many seeds put the value within 0.03 of the truth, above 0.03, and
the certified lower bound above 0 and at most the truth.

The null block (``--runs`` seeds each) draws members and non-members from one distribution at
d = 64: N(0, I), and the 64-unit hidden layer of a fixed random ReLU network (32 → 128 → 64,
Student-t₃ inputs, so heavy tails; 8 units dead and about half of the rest zero on a record).
It reads the learned rule's counts (``learned_rule``, what ``optimal_advantage`` reads above
2-D) to report the raw value tp/n1 − fp/n2 before ``optimal_advantage`` floors it at 0:
its mean and standard deviation against the bound sqrt((1/n1 + 1/n2) / 4) that a rule fixed in
advance has (most cross-fitted rules keep no block under the null and add exactly 0, so the value
spreads far less, :mod:`privmon.estimators.learned`), the fraction of runs with value > 0.03, and
the fraction with a certified lower bound (δ = 0.05) > 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from scipy.stats import chi2, norm

import privmon
from privmon.estimators.in_memory import learned_rule

N = 2000
DELTA = 0.05
BOUND = math.sqrt((1 / N + 1 / N) / 4)


def draw(case: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    *kind, d = case.split()
    d = int(d)
    m = torch.randn(N, d, generator=gen, dtype=torch.float64)
    h = torch.randn(N, d, generator=gen, dtype=torch.float64)
    shift = {"shift": 0.1, "few": 0.4, "weak": 0.03, "weak few": 0.12}.get(" ".join(kind), 0.0)
    if "few" in kind:
        m[:, :4] += shift
    else:
        m += shift
    if kind == ["scale"]:
        m *= 1.25
    return m, h


def relu_layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Members and non-members: independent Student-t₃ inputs through one random network."""
    net = torch.Generator().manual_seed(12)
    w1 = torch.randn(32, 128, generator=net, dtype=torch.float64) / math.sqrt(32)
    w2 = torch.randn(128, 64, generator=net, dtype=torch.float64) / math.sqrt(128)
    b2 = torch.randn(64, generator=net, dtype=torch.float64) - 0.5
    b2[:8] = -50.0  # dead units: exact zeros on every record
    gen = torch.Generator().manual_seed(seed)

    def layer() -> torch.Tensor:
        z = torch.randn(N, 32, generator=gen, dtype=torch.float64)
        chi2_3 = torch.randn(N, 3, generator=gen, dtype=torch.float64).pow(2).sum(1, keepdim=True)
        return torch.relu(torch.relu(z / torch.sqrt(chi2_3 / 3)) @ w1 @ w2 + b2)

    return layer(), layer()


def truth(case: str) -> float:
    *kind, d = case.split()
    d = int(d)
    if kind == ["scale"]:
        s2 = 1.25**2
        r2 = d * math.log(s2) / (1 - 1 / s2)
        return float(chi2.cdf(r2, d) - chi2.cdf(r2 / s2, d))
    norms = {"shift": 0.1 * math.sqrt(d), "few": 0.8, "weak": 0.03 * math.sqrt(d), "weak few": 0.24}
    return float(2 * norm.cdf(norms.get(" ".join(kind), 0.0) / 2) - 1)


def measure(m: torch.Tensor, h: torch.Tensor) -> tuple[float, float, float]:
    start = time.perf_counter()
    est = privmon.optimal_advantage(m, h, method="histogram", delta=DELTA)
    return est.value, est.lower, time.perf_counter() - start


def measure_null(m: torch.Tensor, h: torch.Tensor) -> tuple[float, float, float]:
    """The raw (unfloored) value, the certified lower bound and the seconds of one null run."""
    start = time.perf_counter()
    tp, fp, lower, _ = learned_rule(m, h, prior=0.5, folds=4, deltas=(DELTA, DELTA))
    return tp / N - fp / N, float(lower), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds per leaking case")
    parser.add_argument("--runs", type=int, default=240, help="seeded runs per null case")
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure(*draw("shift 64", 10**6))  # warm-up
    print(f"privmon {privmon.__file__}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, n = {N} + {N}")
    print()
    print(
        "| case | truth | value | lower | seconds | value within 0.03 | value > 0.03 "
        "| 0 < lower ≤ truth |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cases = ("shift 16", "scale 16", "shift 64", "few 64", "weak 64", "weak few 64")
    for case in cases:
        rows = [measure(*draw(case, seed)) for seed in range(args.seeds)]
        value, lower = (statistics.mean(r[i] for r in rows) for i in range(2))
        seconds = statistics.median(r[2] for r in rows)
        t = truth(case)
        print(
            f"| {case} | {t:.3f} | {value:.3f} | {lower:.3f} | {seconds:.2f} | "
            f"{sum(abs(r[0] - t) <= 0.03 for r in rows)}/{args.seeds} | "
            f"{sum(r[0] > 0.03 for r in rows)}/{args.seeds} | "
            f"{sum(0 < r[1] <= t for r in rows)}/{args.seeds} |"
        )
    print()
    print(
        f"| null, d = 64 | runs | mean value | sd of value (bound {BOUND:.4f}) | value > 0.03 "
        "| lower > 0 | seconds |"
    )
    print("|---|---|---|---|---|---|---|")
    nulls = {
        "identical N(0, I)": lambda seed: draw("null 64", 1000 + seed),
        "ReLU hidden layer": relu_layer,
    }
    for name, make in nulls.items():
        rows = [measure_null(*make(seed)) for seed in range(args.runs)]
        values = [r[0] for r in rows]
        print(
            f"| {name} | {args.runs} | {statistics.mean(values):+.4f} | "
            f"{statistics.stdev(values):.4f} | {sum(v > 0.03 for v in values) / args.runs:.1%} | "
            f"{sum(r[1] > 0 for r in rows) / args.runs:.1%} | "
            f"{statistics.median(r[2] for r in rows):.2f} |"
        )


if __name__ == "__main__":
    main()
