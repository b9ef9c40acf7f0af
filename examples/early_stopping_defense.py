"""Early stopping as a membership-inference defense: where privmon would stop, and what it costs.

Song & Mittal (papers/song-mittal-systematic-privacy-risks.txt, §3.2.1) propose early stopping as
the baseline every defense must beat: as training goes on, test accuracy saturates while the model
keeps memorising its training records, so stopping earlier trades a little accuracy for less
leakage. This script shows that trade-off on one model.

The task: scikit-learn's 8x8 handwritten digits, a small training split (the members) and a wide
MLP trained without DP for many epochs, so that it overfits. After every epoch privmon measures how
well the best attack on the model's logit-scaled confidence (and on its loss) tells the training
records from a disjoint held-out split, and the test accuracy is measured on a third split.
A `PrivacyEarlyStopping` on the certified lower bound records the epoch at which training WOULD
stop once the leak is proven to exceed `--budget`; training continues to the end anyway, so the
whole curve is visible.

    python examples/early_stopping_defense.py
    python examples/early_stopping_defense.py --budget 0.3 --plot tradeoff.png
    tensorboard --logdir runs/early_stopping_defense   # each run in a fresh version_N folder
"""

import argparse
import logging
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privmon
from privmon.queries import LogitConfidenceQuery, LossQuery
from privmon.report import version_dir

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument("--budget", type=float, default=0.15, help="advantage budget (certified)")
parser.add_argument(
    "--query",
    choices=("logit_conf", "loss"),
    default="logit_conf",
    help="the attack whose advantage is tabulated and watched by early stopping",
)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--plot", metavar="PATH", help="save the trade-off curve as a PNG")
parser.add_argument(
    "--logdir",
    help="log directory (default: a fresh runs/early_stopping_defense/version_N per run)",
)
parser.add_argument("--n-train", type=int, default=150, help="training records (the members)")
parser.add_argument("--n-heldout", type=int, default=800, help="held-out records (non-members)")
args = parser.parse_args()
# each run in a fresh folder: TensorBoard shows the runs side by side, never mixed in one line
logdir = args.logdir or version_dir("runs/early_stopping_defense")
torch.set_num_threads(1)  # a small MLP: one thread is fastest on a small CPU
t_start = time.perf_counter()

torch.manual_seed(args.seed)
# Three disjoint splits of one shuffled pool: members, non-members (the audit's held-out set;
# exchangeable with the members, so any difference an attack finds is leakage) and a test split
# for the accuracy.
digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
order = torch.from_numpy(np.random.default_rng(args.seed).permutation(len(x)))
n_audit = args.n_train + args.n_heldout
if n_audit >= len(x):
    parser.error(f"--n-train + --n-heldout must leave test records (< {len(x)})")
train_set = TensorDataset(x[order[: args.n_train]], y[order[: args.n_train]])
heldout_set = TensorDataset(x[order[args.n_train : n_audit]], y[order[args.n_train : n_audit]])
test_set = TensorDataset(x[order[n_audit:]], y[order[n_audit:]])

model = nn.Sequential(
    nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
train_loader = DataLoader(train_set, batch_size=32, shuffle=True)

early_stopping = privmon.PrivacyEarlyStopping(f"{args.query}/histogram", args.budget, use="lower")
monitor = privmon.PrivacyMonitor(
    # The loss and log(p / (1 - p)) of the true class: Song & Mittal's metric-based attacks.
    [LogitConfidenceQuery(model), LossQuery(model)],
    DataLoader(train_set, batch_size=256),  # audit sets: fixed, unshuffled
    DataLoader(heldout_set, batch_size=512),
    methods=("histogram",),  # one estimator keeps a check cheap next to an epoch of a small model
    # one check per epoch, known in advance: the run's δ is spent evenly over them, the
    # tightest certificates that still hold over the whole run
    planned_checks=args.epochs + 1,
    writer=logdir,
    early_stopping=early_stopping,
)
logging.getLogger("privmon").setLevel(logging.ERROR)  # we print the stop epoch ourselves


def accuracy(data: TensorDataset) -> float:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = (model(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean().item()
    model.train(was_training)
    return acc


# adv: the attack's optimal advantage (debiased estimate), lower: its certified lower bound (95 %
# over the whole run: every epoch's bound of both queries holds together),
# AUC: the threshold attack on the raw score. Epoch 0 is the untrained model.
print(f"members {len(train_set)}, non-members {len(heldout_set)}, test {len(test_set)}")
print(f"attack: {args.query}, budget {args.budget} on the certified lower bound")
print(f"{'epoch':>5} {'train':>6} {'test':>6} {'adv':>6} {'lower':>6} {'AUC':>6}")
loss_fn = nn.CrossEntropyLoss()
curve = []  # (epoch, train acc, test acc, adv, lower, auc)
stop_epoch = None
for epoch in range(args.epochs + 1):
    if epoch > 0:
        model.train()
        for xb, yb in train_loader:
            optimizer.zero_grad()
            loss_fn(model(xb), yb).backward()
            optimizer.step()
    report = monitor.check(epoch)  # the epoch is the step of the report
    if report is None:  # a failed check is logged and skipped
        continue
    s = report.scalars
    row = (
        epoch,
        accuracy(train_set),
        accuracy(test_set),
        s[f"privacy/{args.query}/histogram/value"],
        s[f"privacy/{args.query}/histogram/lower"],
        s[f"privacy/{args.query}/auc"],
    )
    curve.append(row)
    mark = ""
    if stop_epoch is None and early_stopping.stopped_step is not None:
        stop_epoch = early_stopping.stopped_step
        mark = "  <- would stop here"
    print(f"{row[0]:5d} " + " ".join(f"{v:6.3f}" for v in row[1:]) + mark)
monitor.close()

final = curve[-1]
best = max(curve, key=lambda r: r[2])
print(
    f"final (epoch {final[0]}): test accuracy {final[2]:.3f}, advantage {final[3]:.3f} "
    f"(certified >= {final[4]:.3f}); best test accuracy {best[2]:.3f} at epoch {best[0]}"
)
if stop_epoch is not None:
    at = next(r for r in curve if r[0] == stop_epoch)
    print(f"stop epoch: {stop_epoch}")
    print(
        f"early stopping at epoch {stop_epoch} would keep test accuracy {at[2]:.3f} "
        f"({at[2] - final[2]:+.3f} vs. the final model) at advantage {at[3]:.3f} "
        f"({at[3] - final[3]:+.3f})"
    )
else:
    print("stop epoch: none (the certified lower bound never exceeded the budget)")

if args.plot:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    ep, _, test_acc, adv, lower, _ = (np.array(c) for c in zip(*curve, strict=True))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ep, adv, color="C3", label=f"advantage ({args.query}, estimate)")
    ax.plot(ep, lower, color="C3", linestyle="--", label="advantage, certified lower bound")
    ax.plot(ep, test_acc, color="C0", label="test accuracy")
    ax.axhline(args.budget, color="grey", linestyle=":", label=f"budget {args.budget}")
    if stop_epoch is not None:
        ax.axvline(stop_epoch, color="k", linewidth=1, label=f"would stop (epoch {stop_epoch})")
    ax.set_xlabel("epoch")
    ax.set_ylim(0, 1.02)
    ax.set_title("Early stopping as a membership-inference defense (digits, no DP)")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)
    print(f"plot saved to {args.plot}")
print(f"open: tensorboard --logdir {args.logdir or 'runs/early_stopping_defense'}")
print(f"wall time {time.perf_counter() - t_start:.1f} s")
