"""What a monitor reports it can certify (``privacy/<query>/detectable``), planned and unplanned,
beside the certified lower bounds it then reaches — issue #25's motivating case.

Run from the repository root (``PYTHONPATH=.``: this checkout's privmon)::

    PYTHONPATH=. OMP_WAIT_POLICY=PASSIVE python benchmarks/monitor_detectable.py  # 200+200, 15
    PYTHONPATH=. OMP_WAIT_POLICY=PASSIVE python benchmarks/monitor_detectable.py --n 500

A real :class:`privmon.PrivacyMonitor` (default methods: histogram and KDE, two certified figures
per check) audits ``n`` members and ``n`` non-members at 15 checks; its query draws fresh 1-D
scores at every check, members N(μ, 1) and non-members N(0, 1) with μ = 2·Φ⁻¹((1 + A)/2), so the
true optimal advantage is A (default 0.3). "planned": ``monitor.plan(total_steps=15)`` as the
framework adapters call it; "unplanned": the sequence for runs of unknown length. Per check the
table prints the reported ``detectable`` (the same in every run: it depends on the audit sizes
and the check's δ only) and the mean over seeded runs of the larger method's certified ``lower``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from scipy.stats import norm

import privmon
from privmon.queries import CallableQuery


def _run(
    n: int, shift: float, checks: int, *, planned: bool, seed: int
) -> list[tuple[float, float]]:
    """(detectable, max over methods of lower) at each check of one monitored run."""
    g = torch.Generator().manual_seed(seed)

    def scores(batch):
        flag = batch[1]
        return torch.randn(len(flag), generator=g) + shift * flag

    members = [(torch.arange(n), torch.ones(n))]
    nonmembers = [(torch.arange(n, 2 * n), torch.zeros(n))]
    monitor = privmon.PrivacyMonitor(
        CallableQuery(scores, name="s"), members, nonmembers, every_n_steps=1
    )
    if planned:
        monitor.plan(total_steps=checks)
    out = []
    for step in range(1, checks + 1):
        report = monitor.check(step)
        assert report is not None
        s = report.scalars
        lower = max(s["privacy/s/histogram/lower"], s["privacy/s/kde/lower"])
        out.append((s["privacy/s/detectable"], lower))
    return out


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="members (= non-members)")
    parser.add_argument("--advantage", type=float, default=0.3, help="true optimal advantage")
    parser.add_argument("--checks", type=int, default=15)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shift = 2 * norm.ppf((1 + args.advantage) / 2)
    table = {}
    for planned in (True, False):
        runs = [
            _run(args.n, shift, args.checks, planned=planned, seed=seed)
            for seed in range(args.runs)
        ]
        figures = np.asarray(runs)  # (runs, checks, 2)
        assert np.all(figures[:, :, 0] == figures[0, :, 0])  # sizes and δ only
        table[planned] = (figures[0, :, 0], figures[:, :, 1].mean(axis=0))
    print(
        f"{args.n} + {args.n} records, true advantage {args.advantage}, {args.checks} checks, "
        f"{args.runs} seeded runs, interval_delta 0.05, histogram + KDE"
    )
    print("| check | detectable, planned | detectable, unplanned | mean lower, planned | "
          "mean lower, unplanned |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for k in range(args.checks):
        print(
            f"| {k + 1} | {table[True][0][k]:.3f} | {table[False][0][k]:.3f} | "
            f"{table[True][1][k]:.3f} | {table[False][1][k]:.3f} |"
        )


if __name__ == "__main__":
    main()
