"""Per-record risk as a check reports it: out of sample (cross-fitted) against in sample.

Prints two tables.

1. Nothing leaks: members and non-members identically distributed, 200 + 400 records (the
   demo's audit sizes), over ``--runs`` seeded sets. For the risks a check reports
   (``privmon.analyse(...).member_risk``: each record read off densities fitted without its fold)
   and for the in-sample risk the monitor reported before (``privmon.individual_risk(members,
   members, nonmembers)``: each record counted in its own cell): the mean fraction of members
   above risk 0.8 and the mean of the members' median risk. Scores: 1-D Gaussian, 1-D skewed
   (exp(2·N(0, 1)), a loss-like heavy tail) and 2-D Gaussian.
2. Calibration: members ~ N(μ, 1), non-members ~ N(0, 1), 1,000 + 1,000, prior 1/2, where the
   true posterior is φ(x − μ) / (φ(x − μ) + φ(x)): the RMSE of the reported posterior against
   it, mean over ``--runs`` seeds (at most 20).

    python benchmarks/record_risk.py [--runs 100]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from scipy.stats import norm

import privmon


def null_scores(kind: str, rng: np.random.Generator):
    dim = 2 if kind == "2-D Gaussian" else 1
    m, h = rng.normal(size=(200, dim)), rng.normal(size=(400, dim))
    if kind == "1-D skewed":
        m, h = np.exp(2 * m), np.exp(2 * h)
    return (m[:, 0], h[:, 0]) if dim == 1 else (m, h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"\nNothing leaks, 200 + 400 records, {args.runs} seeded sets")
    print("| scores | risk | members above 0.8 | median member risk |")
    print("|---|---|---:|---:|")
    for kind in ("1-D Gaussian", "1-D skewed", "2-D Gaussian"):
        figures = {"out of sample (now)": [], "in sample (before)": []}
        for seed in range(args.runs):
            m, h = null_scores(kind, np.random.default_rng(seed))
            out = privmon.analyse(m, h).member_risk
            inside = privmon.individual_risk(m, m, h).value
            for name, risk in (("out of sample (now)", out), ("in sample (before)", inside)):
                figures[name].append((np.mean(risk > 0.8), np.median(risk)))
        for name, rows in figures.items():
            above, median = np.mean(rows, axis=0)
            print(f"| {kind} | {name} | {above:.2%} | {median:.3f} |")
    runs = min(args.runs, 20)
    print(f"\nPosterior RMSE against the truth, 1,000 + 1,000 records, {runs} seeds")
    print("| μ | out of sample (now) | in sample (before) |")
    print("|---|---:|---:|")
    for mu in (0.5, 1.0, 2.0):
        rmse = {"out": [], "in": []}
        for seed in range(runs):
            rng = np.random.default_rng(seed)
            m, h = rng.normal(mu, 1.0, 1000), rng.normal(0.0, 1.0, 1000)
            x = np.concatenate([m, h])
            truth = norm.pdf(x - mu) / (norm.pdf(x - mu) + norm.pdf(x))
            res = privmon.analyse(m, h)
            out = np.concatenate([res.member_posterior, res.nonmember_posterior])
            inside = privmon.individual_risk(x, m, h).posterior
            rmse["out"].append(np.sqrt(np.mean((out - truth) ** 2)))
            rmse["in"].append(np.sqrt(np.mean((inside - truth) ** 2)))
        print(f"| {mu} | {np.mean(rmse['out']):.4f} | {np.mean(rmse['in']):.4f} |")


if __name__ == "__main__":
    main()
