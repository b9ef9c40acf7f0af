"""High-dimensional queries: ``privmon.optimal_advantage`` above 2-D against the analytic truth.

Run from the repository root (one torch thread); the ``privmon`` on the path is measured, so an
older checkout gives the "before" table (its rule above 2-D was a Gaussian KDE)::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/learned.py
    PYTHONPATH=/path/to/old/checkout python benchmarks/learned.py
    python benchmarks/learned.py --seeds 1 --runs 5      # quicker

Cases, 2,000 members + 2,000 non-members at prior 1/2:

* shift d: members N(0.1·1, I), non-members N(0, I); truth 2Φ(‖μ‖/2) − 1.
* scale 16: members N(0, 1.25²·I) (×1.25 on the standard deviation), non-members N(0, I); truth
  F(r²) − F(r²/s²), F the χ²₁₆ CDF, s² = 1.25², r² = d·log(s²) / (1 − 1/s²) the radius where
  the two densities cross.

Per case: the truth, the mean over seeds of ``value`` and of the certified ``lower`` (δ = 0.05)
of ``optimal_advantage(method="histogram")`` (above 2-D both methods measure the same rule;
they differ only in the plug-in), the median seconds per call, and how many seeds put the value
within 0.03 of the truth. The null block runs d = 64 with identical distributions over
``--runs`` seeds: mean value, the fraction of runs with value > 0.03, and the fraction with a
certified lower bound > 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from scipy.stats import chi2, norm

import privmon

N = 2000
DELTA = 0.05


def draw(case: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kind, d = case.split()
    m = torch.randn(N, int(d), generator=gen, dtype=torch.float64)
    h = torch.randn(N, int(d), generator=gen, dtype=torch.float64)
    if kind == "shift":
        m += 0.1
    elif kind == "scale":
        m *= 1.25
    return m, h


def truth(case: str) -> float:
    kind, d = case.split()
    d = int(d)
    if kind == "shift":
        return 2 * norm.cdf(0.1 * math.sqrt(d) / 2) - 1
    if kind == "scale":
        s2 = 1.25**2
        r2 = d * math.log(s2) / (1 - 1 / s2)
        return float(chi2.cdf(r2, d) - chi2.cdf(r2 / s2, d))
    return 0.0


def measure(m: torch.Tensor, h: torch.Tensor) -> tuple[float, float, float]:
    start = time.perf_counter()
    est = privmon.optimal_advantage(m, h, method="histogram", delta=DELTA)
    return est.value, est.lower, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per leaking case")
    parser.add_argument("--runs", type=int, default=40, help="seeded runs of the null block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure(*draw("shift 64", 10**6))  # warm-up
    print(f"privmon {privmon.__file__}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, n = {N} + {N}")
    print("| case | truth | value | lower | seconds | value within 0.03 |")
    print("|---|---|---|---|---|---|")
    for case in ("shift 16", "shift 64", "scale 16"):
        rows = [measure(*draw(case, seed)) for seed in range(args.seeds)]
        value, lower = (statistics.mean(r[i] for r in rows) for i in range(2))
        seconds = statistics.median(r[2] for r in rows)
        hits = sum(abs(r[0] - truth(case)) <= 0.03 for r in rows)
        print(
            f"| {case} | {truth(case):.3f} | {value:.3f} | {lower:.3f} | {seconds:.2f} | "
            f"{hits}/{args.seeds} |"
        )
    null = [measure(*draw("null 64", 1000 + seed)) for seed in range(args.runs)]
    print()
    print("| null, d = 64 | runs | mean value | value > 0.03 | lower > 0 | seconds |")
    print("|---|---|---|---|---|---|")
    print(
        f"| identical N(0, I) | {args.runs} | {statistics.mean(r[0] for r in null):+.4f} | "
        f"{sum(r[0] > 0.03 for r in null) / args.runs:.1%} | "
        f"{sum(r[1] > 0 for r in null) / args.runs:.1%} | "
        f"{statistics.median(r[2] for r in null):.2f} |"
    )


if __name__ == "__main__":
    main()
