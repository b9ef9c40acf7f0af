"""The cost of a monitor recording the training loop's per-sample losses
(``PrivacyMonitor.record_losses``), on the digits MLP of ``benchmarks/loss_traces.py``
(64 → 256 → 10, Adam, batches of 64, 898 training records).

Two paired measurements, so that both sides meet the same machine state:

1. within each step: the training step (forward, backward, optimizer step) and the
   ``record_losses`` call after it, timed apart; the cost is the recording's total time over
   an epoch divided by the training's over the same epoch (a total, not a median: the batches
   kept are added together now and then, and that step's share counts; the last epoch's holds
   the adding of the batches still kept at the end, which a check would do), the median over
   epochs;
2. whole runs with and without recording, alternated (ABBA), seconds per step: the median of
   the paired relative differences (noisier: it holds the machine's drift within a pair).

It also checks that the weights after training with recording equal, bit for bit, those after
the same seeded training without it.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/loss_traces_cost.py --epochs 20 --pairs 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from privmon import PrivacyMonitor
from privmon.callbacks import LossTracing
from privmon.queries import LossQuery

BATCH = 64


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    d = load_digits()
    return torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target)


def run(x, y, *, epochs: int, record: bool, seed: int = 5):
    """One seeded training of the MLP on the even-indexed records; per epoch, the seconds in
    the training steps and in ``record_losses``; the steps and the trained weights."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = PrivacyMonitor(
        LossQuery(model), [(x[1::2][:200], y[1::2][:200])], [(x[1::2][200:400], y[1::2][200:400])],
        every_n_steps=10**9, loss_traces=LossTracing(x.shape[0]),
    )  # fmt: skip
    rows = torch.arange(0, x.shape[0], 2)
    g = torch.Generator().manual_seed(seed)
    train, recording, step = [], [], 0
    for _ in range(epochs):
        t_train = t_record = 0.0
        for b in torch.randperm(rows.numel(), generator=g).split(BATCH):
            idx = rows[b]
            t0 = time.perf_counter()
            losses = F.cross_entropy(model(x[idx]), y[idx], reduction="none")
            opt.zero_grad(set_to_none=True)
            losses.mean().backward()
            opt.step()
            t1 = time.perf_counter()
            if record:
                monitor.record_losses(idx, losses, step=step)
            t_train += t1 - t0
            t_record += time.perf_counter() - t1
            step += 1
        train.append(t_train)
        recording.append(t_record)
    if record:  # the batches still kept are added as the next check would
        t0 = time.perf_counter()
        monitor.loss_traces.loop  # noqa: B018 (the property adds them)
        recording[-1] += time.perf_counter() - t0
    weights = [p.detach().clone() for p in model.parameters()]
    return train, recording, step, weights, monitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=6, help="ABBA pairs of whole runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = digits()
    run(x, y, epochs=2, record=True)  # warm-up
    train, recording, steps, traced_weights, monitor = run(x, y, epochs=args.epochs, record=True)
    within = statistics.median(r / t for r, t in zip(recording, train, strict=True))
    total = sum(recording) / sum(train)
    per_step = {True: [], False: []}
    weights = {}
    for pair in range(args.pairs):
        for record in (False, True) if pair % 2 == 0 else (True, False):
            t, r, n, w, _ = run(x, y, epochs=args.epochs, record=record)
            per_step[record].append((sum(t) + sum(r)) / n)
            weights[record] = w
    paired = statistics.median(
        a / b - 1 for a, b in zip(per_step[True], per_step[False], strict=True)
    )
    same = all(
        torch.equal(a, b) for a, b in zip(weights[True], weights[False], strict=True)
    ) and all(torch.equal(a, b) for a, b in zip(weights[True], traced_weights, strict=True))
    tracing = monitor.loss_traces
    step_s = statistics.median(train) * args.epochs / steps
    rows = [
        ("training step, median over epochs", f"{1e3 * step_s:.3f} ms"),
        ("record_losses, mean per call", f"{1e6 * sum(recording) / steps:.1f} µs"),
        ("recording / training, within steps: all epochs' totals", f"{100 * total:.2f} %"),
        ("recording / training, within steps: median over epochs", f"{100 * within:.2f} %"),
        (f"recording, whole runs paired ABBA ({args.pairs} pairs)", f"{100 * paired:+.2f} %"),
        ("weights bit-identical with and without recording", str(same)),
        (f"state per traced record; total ({tracing.loop.records.numel()} records)",
         f"{tracing.bytes_per_record} B; {tracing.nbytes / 1e3:.0f} kB"),
    ]  # fmt: skip
    print(f"digits MLP 64-256-10, batch {BATCH}, {steps} steps ({args.epochs} epochs), CPU\n")
    print("| measure | figure |\n|---|---:|")
    for name, figure in rows:
        print(f"| {name} | {figure} |")


if __name__ == "__main__":
    main()
