"""The monitor on reference-model attacks: advantage of the LiRA queries against the loss query.

Run from the repository root (one torch thread)::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/reference_query.py                  # 10 seeds
    OMP_WAIT_POLICY=PASSIVE python benchmarks/reference_query.py --references 64

Carlini et al.'s setup on a real over-fit model, as ``tests/queries/test_reference_query.py`` builds
it for one seed: per seed s, 300 digits (a permutation seeded s), the target MLP 64-32-10 trained
full batch with Adam (lr 1e-2, 150 epochs) on a random half (the 150 members; the other 150 are the
non-members), ``--references`` MLPs trained the same way on random halves of all 300
(:func:`privmon.audit.train_ensemble`). One ``PrivacyMonitor.check`` reads three queries on the
members against the non-members: ``ReferenceModelQuery`` online (``reference_data`` = the 300
records, so each reference's masks are known: Carlini et al. eq. 4), the same query offline
(out references only, one-sided) and ``LossQuery``. The table shows, per seed, each query's
advantage estimate (histogram and KDE plug-ins) and each LiRA query's margin over the loss
query; the summary counts the seeds where the margin is >= 0 and its mean and smallest value.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import privmon
from privmon.queries import LossQuery, ReferenceModelQuery

# the setup of tests/queries/test_reference_query.py (its online-LiRA-against-the-loss test: seed 0)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "queries"))
from test_reference_query import N, _halves

METHODS = ("histogram", "kde")
QUERIES = ("lira_online", "lira", "loss")


def one_seed(seed: int, n_references: int) -> dict[tuple[str, str], float]:
    """Each query's advantage estimate by each method on seed ``seed``'s setup."""
    w = _halves(
        n_references, pick=seed, member=seed, target=100 + seed, halves=1000 + seed, refs=200 + seed
    )
    model, references, x, y, member = (w[k] for k in ("target", "refs", "x", "y", "member"))
    queries = [
        ReferenceModelQuery(model, references, online=True, reference_data=(x, y)),
        ReferenceModelQuery(model, references, reference_data=(x, y)),
        LossQuery(model),
    ]
    monitor = privmon.PrivacyMonitor(
        queries,
        [(x[member], y[member])],
        [(x[~member], y[~member])],
        every_n_steps=1,
        strict=True,
    )
    report = monitor.check(1)
    monitor.close()
    return {
        (q, m): float(report.scalars[f"privacy/{q}/{m}/value"]) for q in QUERIES for m in METHODS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--references", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(
        f"{args.seeds} seeds; {N} members vs {N} non-members of 300 digits, target MLP 64-32-10 "
        f"on a random half, {args.references} references on random halves of all 300"
    )
    print()
    header = " | ".join(f"{q} {m[:4]}" for q in QUERIES for m in METHODS)
    print(f"| seed | {header} | online − loss (hist / kde) | offline − loss (hist / kde) | s |")
    print("|---:|" + "---:|" * (len(QUERIES) * len(METHODS) + 3))
    margins: dict[tuple[str, str], list[float]] = {
        (q, m): [] for q in ("lira_online", "lira") for m in METHODS
    }
    for seed in range(args.seeds):
        start = time.perf_counter()
        value = one_seed(seed, args.references)
        seconds = time.perf_counter() - start
        for q, m in margins:  # estimates are counts over 150: a float-noise margin is a tie
            margins[q, m].append(round(value[q, m] - value["loss", m], 12))
        cells = " | ".join(f"{value[q, m]:.3f}" for q in QUERIES for m in METHODS)
        online = " / ".join(f"{margins['lira_online', m][-1]:+.3f}" for m in METHODS)
        offline = " / ".join(f"{margins['lira', m][-1]:+.3f}" for m in METHODS)
        print(f"| {seed} | {cells} | {online} | {offline} | {seconds:.1f} |")
    print()
    for (q, m), values in margins.items():
        held = sum(v >= 0 for v in values)
        print(
            f"{q:12s} {m:9s}: >= loss in {held}/{len(values)} seeds, margin mean "
            f"{statistics.mean(values):+.3f}, smallest {min(values):+.3f}"
        )


if __name__ == "__main__":
    main()
