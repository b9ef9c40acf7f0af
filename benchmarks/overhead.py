"""What a privacy check costs beside the forward passes, and whether memory stays flat.

For a small MLP and a small conv net, 2,000 member + 2,000 non-member audit records, a check is
timed as a whole and split into the query forward passes (``report.query_seconds``) and
everything else (estimators, per-record risk, ROC, sinks). Goal: everything but the forward
passes <= 20 % of the check on CPU. Then 200 checks in a row: peak RSS must stay flat.

    python benchmarks/overhead.py            # prints markdown tables (about 3 minutes)
    python benchmarks/overhead.py --quick    # fewer checks, one round (smoke test)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
from torch import nn

import privmon
from privmon.queries import LossQuery


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    )


def audit_sets(n: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (2 * n,), generator=g)
    split = [(x[i : i + batch], y[i : i + batch]) for i in range(0, 2 * n, batch)]
    half = len(split) // 2
    return split[:half], split[half:]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def time_checks(model: nn.Module, methods, n: int, checks: int) -> tuple[float, float]:
    """Median check time and median forward-pass time over ``checks`` checks of a new monitor."""
    members, nonmembers = audit_sets(n, 250, 0)
    mon = privmon.PrivacyMonitor(
        LossQuery(model), members, nonmembers, methods=methods, strict=True
    )
    mon.check(0)  # warm-up
    total, forward = [], []
    for step in range(1, checks + 1):
        rep = mon.check(step)
        total.append(rep.seconds)
        forward.append(rep.query_seconds)
    return statistics.median(total), statistics.median(forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=2000, help="audit records per side")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds over all settings (interleaved)"
    )
    args = parser.parse_args()
    checks = 5 if args.quick else 40
    rounds = 1 if args.quick else args.rounds
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"{args.n} + {args.n} audit records, LossQuery; each round times {checks} checks of a "
        f"new monitor per setting (medians), {rounds} rounds interleaved across settings\n"
    )
    settings = [
        (name, model, methods)
        for name, model in (("MLP 784-512-256-10", mlp()), ("conv net 2×conv+fc", convnet()))
        for methods in (("histogram",), ("histogram", "kde"))
    ]
    results: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(settings))}
    for _ in range(rounds):  # interleaved, so a slow spell of a shared machine hits every row
        for i, (_, model, methods) in enumerate(settings):
            results[i].append(time_checks(model, methods, args.n, checks))
    print(
        "| model | methods | check (ms) | forward passes (ms) | everything else (ms) | "
        "everything else / check, median (range over rounds) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for i, (name, _, methods) in enumerate(settings):
        totals = [t for t, _ in results[i]]
        fwds = [f for _, f in results[i]]
        ratios = sorted((t - f) / t for t, f in results[i])
        total, fwd = statistics.median(totals), statistics.median(fwds)
        print(
            f"| {name} | {'+'.join(methods)} | {total * 1e3:.1f} | {fwd * 1e3:.1f} | "
            f"{(total - fwd) * 1e3:.1f} | {statistics.median(ratios):.0%} "
            f"({ratios[0]:.0%}–{ratios[-1]:.0%}) |"
        )
    n_checks = 40 if args.quick else 200
    members, nonmembers = audit_sets(args.n, 250, 1)
    model = mlp()
    mon = privmon.PrivacyMonitor(LossQuery(model), members, nonmembers, strict=True)
    marks = {}
    start = time.perf_counter()
    for step in range(1, n_checks + 1):
        mon.check(step)
        if step in (10, n_checks // 4, n_checks // 2, n_checks):
            marks[step] = rss_mib()
    print(
        f"\nPeak RSS over {n_checks} checks (MLP, both methods, "
        f"{time.perf_counter() - start:.1f} s):\n"
    )
    print("| after check | " + " | ".join(str(k) for k in marks) + " |")
    print("|---|" + "---:|" * len(marks))
    print("| peak RSS (MiB) | " + " | ".join(f"{v:.1f}" for v in marks.values()) + " |")


if __name__ == "__main__":
    main()
