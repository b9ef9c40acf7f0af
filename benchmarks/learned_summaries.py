"""High-dimensional queries against their own 1-D summaries: the learned rule's null and power.

Run from the repository root (one torch thread); the ``privmon`` on the path is measured, so an
older checkout gives the "before" tables::

    PYTHONPATH=. OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/learned_summaries.py
    PYTHONPATH=/path/to/old/checkout python benchmarks/learned_summaries.py
    PYTHONPATH=. python benchmarks/learned_summaries.py --runs 40 --seeds 5      # quicker

Every case has 200 members + 200 non-members (what real audits use) and 10-d scores; the default
run takes about 7 minutes on one thread.

Null (``--runs`` seeded runs each; members and non-members exchangeable): ``privmon.analyse`` on
the scores at δ = 0.05 for one call (``certify_delta`` = δ: the strictest reading, far above a
monitor's share), the rate of runs whose certified ``lower`` is above 0, with its 95 %
Clopper–Pearson interval (goal: at most δ), and of runs whose value exceeds 0.03.

* digits MLP, unseen records: a 64-256-10 MLP trained to memorise 200 of sklearn's digits (300
  full-batch Adam steps), its logits on 400 other records split at random into "members" and
  "non-members", neither trained on; a new model and split per run.
* Student-t₂ logits: 4·t₂ draws, one distribution for both sets (heavy tails: rows far out).
* N(0, I): identical Gaussian draws.

Power (``--seeds`` models): the digits MLP, its 200 members against 200 held-out records, read
by one ``PrivacyMonitor`` check with two queries, ``HiddenLayerQuery`` on its 10 logits and
``EntropyQuery`` (so each ``…/lower`` is at that check's share of the run's δ = 0.05, as a monitor
certifies it). Columns: the mean histogram value and certified lower bound of each query, how
many models put the 10-d figure at or above the entropy's, and how many certify anything.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
from scipy.stats import binomtest
from sklearn.datasets import load_digits
from torch import nn

import privmon
from privmon.queries import EntropyQuery, HiddenLayerQuery

N = 200
DELTA = 0.05


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def memorising_mlp(x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
    """A 64-256-10 MLP trained to memorise (x, y): 300 full-batch Adam steps at lr 1e-3."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(300):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def split(seed: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def unseen_logits(data, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A model memorising 200 records; its logits on 200 + 200 further records it never saw."""
    x, y = data
    order = split(seed, len(x))
    model = memorising_mlp(x[order[:N]], y[order[:N]], seed)
    with torch.no_grad():
        logits = model(x[order[N : 3 * N]]).double()
    return logits[:N], logits[N:]


def student_logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    spread = -torch.rand(2 * N, 1, generator=gen, dtype=torch.float64).log()  # χ²₂ / 2
    x = 4 * torch.randn(2 * N, 10, generator=gen, dtype=torch.float64) / spread.sqrt()
    return x[:N], x[N:]


def gaussian(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * N, 10, generator=gen, dtype=torch.float64)
    return x[:N], x[N:]


def null_row(name: str, draws) -> str:
    runs = len(draws)
    figures = [
        privmon.analyse(m, h, methods=["histogram"], delta=DELTA, top_k=0).estimates["histogram"]
        for m, h in draws
    ]
    certified = sum(e.lower > 0 for e in figures)
    low, high = binomtest(certified, runs).proportion_ci(method="exact")
    return (
        f"| {name} | {runs} | {certified} ({certified / runs:.1%}) | [{low:.1%}, {high:.1%}] | "
        f"{sum(e.value > 0.03 for e in figures) / runs:.1%} | "
        f"{statistics.mean(e.value for e in figures):.3f} |"
    )


def power_rows(data, seeds: int) -> list[str]:
    x, y = data
    logits, entropy = [], []
    for seed in range(seeds):
        order = split(seed, len(x))
        members, held_out = order[:N], order[N : 2 * N]
        model = memorising_mlp(x[members], y[members], seed)
        queries = [HiddenLayerQuery(model, "2", name="logits"), EntropyQuery(model)]
        monitor = privmon.PrivacyMonitor(
            queries, [(x[members], y[members])], [(x[held_out], y[held_out])]
        )
        scalars = monitor.check(1).scalars
        monitor.close()
        for name, out in (("logits", logits), ("entropy", entropy)):
            out.append(tuple(scalars[f"privacy/{name}/histogram/{f}"] for f in ("value", "lower")))
    rows = []
    for i, figure in enumerate(("value", "lower")):
        ours = [r[i] for r in logits]
        alone = [r[i] for r in entropy]
        rows.append(
            f"| {figure} | {statistics.mean(ours):.3f} | {statistics.mean(alone):.3f} | "
            f"{sum(a >= b for a, b in zip(ours, alone, strict=True))}/{seeds} | "
            f"{sum(a > 0 for a in ours)}/{seeds} | {sum(b > 0 for b in alone)}/{seeds} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=500, help="seeded runs per null case")
    parser.add_argument("--seeds", type=int, default=40, help="models in the power case")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the monitor's advice on audit sizes, said every run
    data = digits()
    print(f"privmon {privmon.__file__}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, n = {N} + {N}, d = 10")
    print()
    print(f"| null (δ = {DELTA}) | runs | lower > 0 | 95 % CP | value > 0.03 | mean value |")
    print("|---|---:|---:|---:|---:|---:|")
    runs = range(args.runs)
    print(null_row("digits MLP, unseen records", [unseen_logits(data, 1000 + s) for s in runs]))
    print(null_row("Student-t₂ logits", [student_logits(2000 + s) for s in runs]))
    print(null_row("N(0, I)", [gaussian(3000 + s) for s in runs]))
    print()
    print(
        "| digits MLP, first check | 10-d logits | entropy | 10-d ≥ entropy "
        "| 10-d > 0 | entropy > 0 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in power_rows(data, args.seeds):
        print(row)


if __name__ == "__main__":
    main()
