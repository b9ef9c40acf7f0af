"""The monitor's swapped-sets warning: its false-alarm rate under the null and its power.

The monitor warns ("are members and nonmembers swapped?") when a query that knows its
direction ranks members below non-members far beyond chance:
:func:`privmon.callbacks.traps.swapped_sets_alarm`, AUC < ½ − 4·sqrt((n₁ + n₂ + 1) / (12 n₁ n₂)).

Null: members and non-members drawn from one distribution (exchangeable sets, no leak), with
continuous scores and with discrete ones (ties: the variance the rule assumes is then too large,
so the rule is conservative). Power: the sets swapped for a query whose true AUC (the right way
round) is 0.6, 0.7 or 0.8 (normal scores shifted by √2·Φ⁻¹(AUC)). Each run's AUC is the
Mann–Whitney statistic from midranks, checked equal to :func:`privmon.auc` on the first runs
of every setting; the alarm is the monitor's own function.

    python benchmarks/swapped_sets.py [--runs 100000]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from scipy.stats import beta, norm, rankdata

import privmon
from privmon.callbacks.traps import SWAP_Z, swapped_sets_alarm

SIZES = [(50, 50), (200, 200), (1000, 1000), (100, 1000)]


def aucs(members: np.ndarray, nonmembers: np.ndarray) -> np.ndarray:
    """P(member > non-member) + ½ P(tie) per run (rows), from midranks."""
    n1, n2 = members.shape[1], nonmembers.shape[1]
    ranks = rankdata(np.concatenate([members, nonmembers], axis=1), axis=1)
    u = ranks[:, :n1].sum(axis=1) - n1 * (n1 + 1) / 2
    return u / (n1 * n2)


def alarm_rate(members: np.ndarray, nonmembers: np.ndarray) -> tuple[int, int]:
    """Alarms over runs, the AUC of the first runs checked against privmon.auc."""
    a = aucs(members, nonmembers)
    for i in range(min(20, len(a))):
        assert abs(a[i] - privmon.auc(members[i], nonmembers[i])) < 1e-12
    n1, n2 = members.shape[1], nonmembers.shape[1]
    return sum(swapped_sets_alarm(float(v), n1, n2) for v in a), len(a)


def upper95(k: int, n: int) -> float:
    """Clopper–Pearson one-sided 95 % upper bound on a rate seen k times in n."""
    return 1.0 if k == n else float(beta.ppf(0.95, k + 1, n - k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100_000, help="null runs per setting")
    parser.add_argument("--power-runs", type=int, default=2_000, help="runs per power setting")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"rule: AUC < 0.5 - {SWAP_Z:g} sd; normal tail {norm.sf(SWAP_Z):.1e} per check\n")
    print(f"{'null':<12} {'n1':>5} {'n2':>5} {'runs':>8} {'alarms':>7} {'rate':>9} {'95% up':>9}")
    chunk = 5_000
    for kind in ("continuous", "discrete"):
        for n1, n2 in SIZES:
            alarms = runs = 0
            while runs < args.runs:
                r = min(chunk, args.runs - runs)
                if kind == "continuous":
                    m, h = rng.normal(size=(r, n1)), rng.normal(size=(r, n2))
                else:  # a correctness-like score: 0 / 1, many ties
                    m = (rng.random((r, n1)) < 0.7).astype(float)
                    h = (rng.random((r, n2)) < 0.7).astype(float)
                k, n = alarm_rate(m, h)
                alarms, runs = alarms + k, runs + n
            print(
                f"{kind:<12} {n1:>5} {n2:>5} {runs:>8} {alarms:>7} {alarms / runs:>9.1e} "
                f"{upper95(alarms, runs):>9.1e}"
            )
    print(f"\n{'power':<12} {'n1':>5} {'n2':>5} {'AUC':>5} {'swapped':>8} {'alarm rate':>11}")
    for n1, n2 in SIZES:
        for true_auc in (0.6, 0.7, 0.8):
            shift = math.sqrt(2) * norm.ppf(true_auc)
            r = args.power_runs
            # swapped: the "members" are the held-out records, the "non-members" the trained
            m, h = rng.normal(size=(r, n1)), rng.normal(shift, 1.0, size=(r, n2))
            k, n = alarm_rate(m, h)
            print(
                f"{'normal':<12} {n1:>5} {n2:>5} {true_auc:>5} {1 - true_auc:>8.1f} {k / n:>11.3f}"
            )


if __name__ == "__main__":
    main()
