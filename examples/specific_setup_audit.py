"""Audit per-record membership risk in the specific setup and compare it with the average setup.

The question an auditor asks before releasing a model: which records of *this* training set does
*this* model leak? The usual (average) evaluation answers another question: it retrains on
datasets resampled from a larger pool, so a record's risk is averaged over datasets in which it is
sometimes an outlier and sometimes not. The specific setup keeps the training set fixed and only
varies the training seed (Krčo et al., "Lost in the Averages", papers/specific-setup-mia-
evaluation.txt, §3.2-3.4).

Here: scikit-learn's 8x8 handwritten digits, a training set of `--n-train` records, a small MLP
trained full-batch. `--targets` records of the training set are audited with `--models` models
in each setup (the models are shared by all targets: the cost does not grow with the number of
targets). The attack is the loss attack (higher score = lower loss = member). The script prints
the riskiest records with their risk in both setups and the §3.4 comparison: miss rate (records
high-risk in the specific setup that the average setup calls low-risk), RMSE, Pearson.

    python examples/specific_setup_audit.py                  # 64 models, 40 targets
    python examples/specific_setup_audit.py --models 32 --targets 20 --seed 1
"""

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from privmon.audit import average, compare, specific

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--models", type=int, default=64, help="evaluation models per setup")
parser.add_argument("--targets", type=int, default=40, help="training records to audit")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--n-train", type=int, default=250, help="size of the fixed training set")
parser.add_argument("--epochs", type=int, default=150, help="full-batch epochs per model")
parser.add_argument("--hidden", type=int, default=32, help="hidden units of the MLP")
parser.add_argument("--top", type=int, default=15, help="rows of the risk table")
parser.add_argument("--progress", action="store_true", help="progress bars on stderr")
args = parser.parse_args()
torch.set_num_threads(1)  # tiny full-batch models: one thread is fastest

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
# The pool is every digit; the released model's training set D is a fixed random part of it.
# Reference records (swapped in for a target when it is out) come from the rest of the pool.
rng = np.random.default_rng(args.seed)
order = rng.permutation(len(x))
train_idx, rest_idx = order[: args.n_train], order[args.n_train :]
if not 2 <= args.targets <= args.n_train // 4:
    parser.error(f"--targets must lie in [2, n_train / 4 = {args.n_train // 4}]")
target_pos = np.sort(rng.choice(args.n_train, size=args.targets, replace=False))


def train(xs: torch.Tensor, ys: torch.Tensor, seed: int) -> nn.Module:
    """A fresh MLP trained on (xs, ys); the seed fixes the initialisation (privmon restores the
    global RNG afterwards)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(args.epochs):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
    return model


start = time.perf_counter()
spec = specific(
    train,
    (x[train_idx], y[train_idx]),
    target_pos,
    n_models=args.models,
    seed=args.seed,
    reference=(x[rest_idx], y[rest_idx]),
    progress=args.progress,
)
avg = average(
    train,
    (x, y),
    train_idx[target_pos],  # the same records, as indices into the pool
    n_models=args.models,
    seed=args.seed,
    dataset_size=args.n_train,
    progress=args.progress,
)
elapsed = time.perf_counter() - start

print(
    f"digits: training set of {args.n_train} records, {args.targets} targets, "
    f"{args.models} models per setup (seed {args.seed})"
)
print(f"specific setup: {spec.elapsed_s:.1f}s, average setup: {avg.elapsed_s:.1f}s")
print()
t_auc, t_tpr = 0.8, 0.6
print(
    f"riskiest records in the specific setup (AUC and TPR at FPR {spec.fpr:g}; "
    f"'missed' = AUC >= {t_auc} specific, < {t_auc} average)"
)
print(
    f"{'rank':>4} {'record':>6} {'label':>5} {'AUC spec':>8} {'AUC avg':>8} "
    f"{'TPR spec':>8} {'TPR avg':>8}"
)
for rank, j in enumerate(spec.ranking("auc")[: args.top], start=1):
    record = int(train_idx[target_pos[j]])
    missed = spec.auc[j] >= t_auc and avg.auc[j] < t_auc
    print(
        f"{rank:>4} {record:>6} {int(y[record]):>5} {spec.auc[j]:>8.3f} {avg.auc[j]:>8.3f} "
        f"{spec.tpr[j]:>8.3f} {avg.tpr[j]:>8.3f}{'  missed' if missed else ''}"
    )
print()
print("specific vs average setup (§3.4)")
for metric, threshold in (("auc", t_auc), ("tpr", t_tpr)):
    c = compare(spec, avg, metric=metric, threshold=threshold)
    rate = "n/a" if c.n_high_risk == 0 else f"{c.miss_rate:.3f}"
    print(
        f"{metric:>4}: miss rate {rate} ({c.n_missed}/{c.n_high_risk} high-risk records missed), "
        f"RMSE {c.rmse:.3f}, Pearson {c.pearson:.3f} "
        f"(Theorem 1: sqrt var ratio {c.std_ratio:.3f}), "
        f"mean {c.mean_specific:.3f} vs {c.mean_average:.3f}"
    )
print(f"total {elapsed:.1f}s")
