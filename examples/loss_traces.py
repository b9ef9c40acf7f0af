"""Which training records are at risk, from the training run itself: loss traces (LT-IQR) and
the loss tail (LOSS TNR), with no reference model trained.

An MLP trains on half of scikit-learn's digits. The loop hands each batch's record indices and
the per-sample losses it computed anyway to ``monitor.record_losses`` (no extra forward); every
``--every`` steps a check reports the membership advantage, its certified lower bound and
LOSS TNR (an estimate of LiRA's TPR at FPR 0.1 % and 1 %, not a bound). At the end: the records
of highest LT-IQR (the training set's indices) beside the most exposed members by the
out-of-sample posterior, and the traces' memory.

    python examples/loss_traces.py --epochs 30 --every 100 --logdir runs/loss_traces
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon import PrivacyMonitor
from privmon.callbacks import LossTracing
from privmon.queries import LossQuery
from privmon.report import tags
from privmon.sinks import JsonlSink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--every", type=int, default=100, help="a check every N steps")
    parser.add_argument("--logdir", default="runs/loss_traces")
    args = parser.parse_args()
    torch.manual_seed(0)
    d = load_digits()
    x, y = torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, held_out = perm[:898], perm[898:]
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # the training set yields each record's index (0..897) with it: the traces key on it
    loader = DataLoader(TensorDataset(torch.arange(898), x[train], y[train]), batch_size=64,
                        shuffle=True, generator=torch.Generator().manual_seed(1))  # fmt: skip
    os.makedirs(args.logdir, exist_ok=True)
    monitor = PrivacyMonitor(
        LossQuery(model),
        [(x[train[:400]], y[train[:400]])],  # audit members: training records 0..399
        [(x[held_out[:400]], y[held_out[:400]])],
        every_n_steps=args.every,
        methods=("histogram",),
        writer=args.logdir,
        sinks=JsonlSink(os.path.join(args.logdir, "checks.jsonl")),
        loss_traces=LossTracing(898, top_k=5),
    )
    print("  step  advantage  certified lower  LOSS TNR@0.1%  LOSS TNR@1%")
    step = 0
    for _ in range(args.epochs):
        for idx, xb, yb in loader:
            step += 1
            losses = F.cross_entropy(model(xb), yb, reduction="none")
            opt.zero_grad()
            losses.mean().backward()
            opt.step()
            monitor.record_losses(idx, losses, step=step)  # what the loop computed anyway
            monitor.step(step)  # a check every --every steps
            if monitor.last_report is not None and monitor.last_report.step == step:
                s = monitor.last_report.scalars
                print(
                    f"{step:6d}  {s[tags.value('loss', 'histogram')]:9.3f}  "
                    f"{s[tags.lower('loss', 'histogram')]:15.3f}  "
                    f"{s[tags.loss_tnr('loss', 0.001)]:13.3f}  "
                    f"{s[tags.loss_tnr('loss', 0.01)]:11.3f}"
                )
    monitor.close()
    report = monitor.last_report
    loop = report.vulnerable[tags.TRAINING_LOOP]
    print("\nmost vulnerable by LT-IQR (training-set index: LT-IQR):")
    print("  " + ", ".join(f"{i}: {v:.3f}" for i, v in zip(loop.records, loop.scores, strict=True)))
    print("most exposed by the out-of-sample posterior (member index: posterior):")
    print("  " + ", ".join(f"{i}: {p:.3f}" for i, p in monitor.top_records(5)))
    tracing = monitor.loss_traces
    print(
        f"loss traces: {tracing.bytes_per_record} bytes per record, "
        f"{tracing.nbytes / 1e3:.0f} kB for {tracing.loop.records.numel()} records"
    )


if __name__ == "__main__":
    main()
