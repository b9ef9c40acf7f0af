"""Train a classifier with DP-SGD (Opacus) and watch its membership leakage under the DP ceiling.

The task: scikit-learn's 8x8 handwritten digits with a small training split (the members) and a
wide MLP trained for many epochs, so that without DP it memorises its training records. Every
`--every` steps privmon measures how well the best attack on the per-record loss tells members
from held-out records, reads ε from the Opacus accountant and compares the two: under (ε, δ)-DP
no attack can beat the ceiling. Training stops early once the certified leak exceeds `--budget`.

    python examples/dp_classifier.py              # DP-SGD at ε = 1: the leak stays near 0
    python examples/dp_classifier.py --no-dp      # no DP: the leak grows, early stopping fires
                                                  # (at step 150 of 240; over seeds 0-9 it
                                                  # fires in 9, at steps 50-150)
    tensorboard --logdir runs/dp_classifier       # each run in its own runs/dp_classifier/version_N
    privmon report runs/dp_classifier --compare   # both runs side by side on one page

ε = 1 on 100 training records is strong privacy and costs most of the accuracy; compare
`--epsilon 8`.
"""

import argparse
import logging
import warnings

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privmon
from privmon.queries import LogitConfidenceQuery, LossQuery
from privmon.report import version_dir

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epsilon", type=float, default=1.0, help="target ε of DP-SGD")
parser.add_argument("--epochs", type=int, default=60)
parser.add_argument(
    "--budget", type=float, default=0.05, help="stop above this certified advantage"
)
parser.add_argument("--every", type=int, default=25, help="steps between privacy checks")
parser.add_argument(
    "--logdir", help="log directory (default: a fresh runs/dp_classifier/version_N per run)"
)
parser.add_argument("--no-dp", action="store_true", help="train without Opacus")
parser.add_argument("--n-train", type=int, default=100, help="training records (the members)")
parser.add_argument("--n-heldout", type=int, default=1000, help="held-out records (non-members)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
# each run in a fresh folder: TensorBoard shows the runs side by side, never mixed in one line
logdir = args.logdir or version_dir("runs/dp_classifier")
DELTA = 1e-5
# Opacus' advisory warnings (secure RNG off, accountant alpha range, backward hooks on a model
# whose inputs need no gradient) are expected here and would bury the table.
for message in ("Secure RNG", "Optimal order", "Full backward hook"):
    warnings.filterwarnings("ignore", message=message)

torch.manual_seed(args.seed)
# Members and non-members: disjoint splits of one shuffled pool, so they are exchangeable and
# any difference an attack finds is leakage (the DP ceiling assumes exactly this).
digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
order = torch.from_numpy(np.random.default_rng(args.seed).permutation(len(x)))
train_idx = order[: args.n_train]
heldout_idx = order[args.n_train : args.n_train + args.n_heldout]
train_set = TensorDataset(x[train_idx], y[train_idx])
heldout_set = TensorDataset(x[heldout_idx], y[heldout_idx])

model = nn.Sequential(
    nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
train_loader = DataLoader(train_set, batch_size=32, shuffle=True)

engine = None
if not args.no_dp:
    from opacus import PrivacyEngine

    # Opacus picks the noise so that `--epochs` passes over the data spend the target ε.
    engine = PrivacyEngine()
    model, optimizer, train_loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        target_epsilon=args.epsilon,
        target_delta=DELTA,
        epochs=args.epochs,
        max_grad_norm=1.0,
    )
    print(
        f"DP-SGD: noise multiplier {optimizer.noise_multiplier:.2f} for target ε = {args.epsilon}"
    )

# Audit sets: all training records vs. the held-out ones, in fixed, unshuffled batches
# (per-record risk refers to member indices in this order).
monitor = privmon.PrivacyMonitor(
    # Two views of one signal: the loss, and log(p / (1 - p)) of the true class (better scaled).
    [LossQuery(model), LogitConfidenceQuery(model)],
    DataLoader(train_set, batch_size=256),
    DataLoader(heldout_set, batch_size=256),
    every_n_steps=args.every,
    # The run's length is known: its checks, the last step's included, share δ evenly, and
    # certifying one method per query (the table's) leaves each figure a larger share.
    planned_checks=-(-args.epochs * len(train_loader) // args.every),
    methods=("histogram",),
    writer=logdir,  # TensorBoard event files go here
    accountant=engine,  # ε at DELTA is read at every check (None without DP)
    delta=DELTA,
    # Stop once the certified lower bound on the loss attack's advantage exceeds the budget.
    early_stopping=privmon.PrivacyEarlyStopping("loss/histogram", args.budget, use="lower"),
)
logging.getLogger("privmon").setLevel(logging.ERROR)  # we print the stop reason ourselves
warnings.simplefilter("always", privmon.PrivacyViolationWarning)  # never hide a DP violation


def row(report):
    """One table line: ε and its ceilings (DP only), then the attacks' figures."""
    s = report.scalars

    def fmt(tag, width):
        return f"{s[tag]:{width}.3f}" if tag in s else f"{'-':>{width}}"

    return " ".join(
        [f"{report.step:6d}"]
        + [
            fmt(f"privacy/{tag}", w)
            for tag, w in (
                ("epsilon", 7),
                ("ceiling/tanh", 7),
                ("ceiling/eps_delta", 9),
                ("loss/histogram/value", 7),
                ("loss/histogram/lower", 7),
                ("loss/auc", 6),
                ("logit_conf/histogram/value", 10),
            )
        ]
    )


# ε: spent so far; tanh / (ε,δ): the most advantage ε-DP / (ε, δ)-DP allow; adv: the loss
# attack's advantage (debiased), lower: its certified lower bound (95 %).
print(
    f"{'step':>6} {'ε':>7} {'tanh':>7} {'(ε,δ)':>9} {'adv':>7} {'lower':>7} {'AUC':>6} "
    f"{'adv(logit)':>10}"
)
loss_fn = nn.CrossEntropyLoss()
step, epoch, stopped = 0, 0, False
while epoch < args.epochs and not stopped:
    epoch += 1
    model.train()
    # With DP the loader samples each record independently (Poisson); a rare empty batch is
    # still a step (Opacus adds noise only), as the accountant assumes.
    for xb, yb in train_loader:
        step += 1
        optimizer.zero_grad()
        loss_fn(model(xb), yb).backward()
        optimizer.step()
        stopped = monitor.step(step)  # a check every `--every` steps; True: over budget
        if monitor.last_report is not None and monitor.last_report.step == step:
            print(row(monitor.last_report))
        if stopped:
            break

# Audit the final model too, unless the last step was a check.
if monitor.last_report is None or monitor.last_report.step != step:
    final = monitor.check(step)
    if final is not None:
        print(row(final))
monitor.close()

model.eval()
with torch.no_grad():
    for name, data in (("train", train_set), ("held-out", heldout_set)):
        acc = (model(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean().item()
        print(f"accuracy {name}: {acc:.3f}")
if engine is not None:
    print(f"final ε = {engine.get_epsilon(DELTA):.3f} (target {args.epsilon}, δ = {DELTA})")
if stopped:
    print(
        f"early stopping fired at step {step}, epoch {epoch} of {args.epochs}: "
        f"{monitor.early_stopping.reason}"
    )
else:
    print(f"early stopping did not fire: all {args.epochs} epochs trained ({step} steps)")
if any(r.dp_violation for r in monitor.history):
    print("DP VIOLATION: a certified lower bound exceeded the (ε, δ) ceiling")
print(f"open: tensorboard --logdir {args.logdir or 'runs/dp_classifier'}")
if not args.logdir:
    print("compare the runs: privmon report runs/dp_classifier --compare")
