"""Compare the check overhead of two privmon checkouts in one process, check by check.

Timing whole checks on a shared machine moves by ±20 % from minute to minute, far more than one
change to the estimators moves them. Here both versions are imported into one process, and their
monitors check the same MLP on the same 2,000 + 2,000 audit records in alternation (ABBA order).
So every pair of checks meets the same machine state. The median of the paired differences of
"everything but the forward passes" is the figure to read.

    python benchmarks/overhead_paired.py OLD_CHECKOUT NEW_CHECKOUT [--checks 150]

(a checkout: a directory that holds the ``privmon`` package, e.g. from ``git worktree add``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import audit_sets, mlp


def load(checkout: str):
    """The privmon package of ``checkout``, imported beside any other loaded one."""
    for name in [m for m in sys.modules if m == "privmon" or m.startswith("privmon.")]:
        del sys.modules[name]
    sys.path.insert(0, checkout)
    try:
        package = importlib.import_module("privmon")
        queries = importlib.import_module("privmon.queries")
    finally:
        sys.path.remove(checkout)
    if not str(Path(package.__file__).resolve()).startswith(str(Path(checkout).resolve())):
        raise SystemExit(f"{checkout} holds no privmon package (imported {package.__file__})")
    return package, queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--checks", type=int, default=150)
    args = parser.parse_args()
    members, nonmembers = audit_sets(2000, 250, 0)
    model = mlp()
    monitors = {}
    for tag, checkout in (("old", args.old), ("new", args.new)):
        package, queries = load(checkout)
        monitors[tag] = package.PrivacyMonitor(
            queries.LossQuery(model), members, nonmembers, strict=True
        )
    other = {}
    for step in range(args.checks + 10):
        for tag in ("old", "new") if step % 2 == 0 else ("new", "old"):
            start = time.perf_counter()
            report = monitors[tag].check(step)
            if step >= 10:  # the first checks warm up
                other.setdefault(tag, []).append(time.perf_counter() - start - report.query_seconds)
    paired = [a - b for a, b in zip(other["old"], other["new"], strict=True)]
    print(f"{args.checks} checks each, alternating; everything but the forward passes:\n")
    print("| version | median (ms) |")
    print("|---|---:|")
    for tag in ("old", "new"):
        print(f"| {tag} | {statistics.median(other[tag]) * 1e3:.2f} |")
    print(f"| old − new, paired | {statistics.median(paired) * 1e3:+.2f} |")


if __name__ == "__main__":
    main()
