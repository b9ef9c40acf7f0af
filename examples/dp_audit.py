"""Audit DP-SGD in one training run: canaries give an ε lower bound to set beside the accountant's.

The task: scikit-learn's 8x8 digits, an MLP 64-256-10 trained with Opacus (noise multiplier 2.5,
clipping bound 1, Poisson batches of 60 from 600 records, SGD lr 0.5, 400 steps); the
accountant reports ε ≈ 3.7 at δ = 1e-5. Two kinds of canaries ride along:

* 100,000 Dirac gradient canaries (white box) in a parameter block the model never uses: each
  is included with probability ½, sampled like a record and added before the optimizer's noise.
  A ``PrivacyMonitor(canaries=...)`` turns their updates into an ε lower bound at every check
  (one-run audit, Steinke et al. and f-DP, certified over the run): it must stay under the
  accountant's ε. An optimizer that silently adds less noise than the accountant assumes
  (``--noise-factor 0``: none at all) raises the alarm: the audited ε exceeds it
  (``dp_violation``, a ``PrivacyViolationWarning``).
* 200 mislabelled digits (black box), of which half join the training set (among the 600),
  scored by their loss: far weaker, but they need nothing from the training code.

    python examples/dp_audit.py                   # correct noise: audited ε < accountant ε
    python examples/dp_audit.py --noise-factor 0  # the silent bug: audited ε > accountant ε
    python examples/dp_audit.py --logdir runs/dp  # also TensorBoard and privmon report files
"""

import argparse
import math
import warnings

import numpy as np
import torch
from opacus import PrivacyEngine
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

from privmon import PrivacyMonitor, PrivacyViolationWarning
from privmon.audit import GradientCanaries, InputCanaries, one_run_epsilon
from privmon.queries import LossQuery
from privmon.sinks import JsonlSink

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--canaries", type=int, default=100_000, help="gradient canaries")
parser.add_argument("--input-canaries", type=int, default=200, help="mislabelled records (>= 2)")
parser.add_argument(
    "--noise-factor",
    type=float,
    default=1.0,
    help="simulate a bug: the optimizer adds this fraction of the noise it reports",
)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--no-plan", action="store_true", help="leave planned_checks unset (δ shares shrink per check)"
)
parser.add_argument("--logdir", default=None, help="TensorBoard events and checks.jsonl here")
args = parser.parse_args()
DELTA, SIGMA = 1e-5, 2.5
for message in ("Secure RNG", "Optimal order", "Full backward hook"):
    warnings.filterwarnings("ignore", message=message)
warnings.simplefilter("ignore", PrivacyViolationWarning)  # printed below, once
torch.set_num_threads(1)  # a small MLP: more threads only add overhead
torch.manual_seed(args.seed)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
order = torch.from_numpy(np.random.default_rng(args.seed).permutation(len(x)))
canary_idx, rest = order[: args.input_canaries], order[args.input_canaries :]
# Input canaries: held-out digits with a wrong label (shifted by 1 to 9 classes).
shift = torch.randint(1, 10, (len(canary_idx),), generator=torch.Generator().manual_seed(1))
input_canaries = InputCanaries(
    TensorDataset(x[canary_idx], (y[canary_idx] + shift) % 10), seed=args.seed
)
# 600 training records in all: the included canaries and clean digits.
n_clean = 600 - len(input_canaries.training_records)
train_idx, test_idx = rest[:n_clean], rest[n_clean:]
train_set = ConcatDataset(
    [TensorDataset(x[train_idx], y[train_idx]), input_canaries.training_records]
)

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
engine = PrivacyEngine()
model, optimizer, loader = engine.make_private(
    module=model,
    optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
    data_loader=DataLoader(train_set, batch_size=60),
    noise_multiplier=SIGMA,
    max_grad_norm=1.0,
)
if args.noise_factor != 1.0:
    # The bug: add_noise runs with a smaller noise multiplier, restored before the accountant's
    # step hook reads it, so the accountant keeps reporting ε for σ = 2.5.
    noisy = optimizer.add_noise

    def add_noise() -> None:
        optimizer.noise_multiplier = SIGMA * args.noise_factor
        try:
            noisy()
        finally:
            optimizer.noise_multiplier = SIGMA

    optimizer.add_noise = add_noise

canaries = GradientCanaries(optimizer, args.canaries, seed=args.seed)
# The monitor: a loss query on 200 training / 200 held-out digits, the accountant, and the
# canaries, checked every 50 steps.
held_out = test_idx[:200]
monitor = PrivacyMonitor(
    LossQuery(model),
    [(x[train_idx[:200]], y[train_idx[:200]])],
    [(x[held_out], y[held_out])],
    every_n_steps=50,
    methods=("histogram",),
    accountant=engine,
    canaries=canaries,
    planned_checks=None if args.no_plan else args.steps // 50,
    writer=args.logdir,
    sinks=[JsonlSink(f"{args.logdir}/checks.jsonl")] if args.logdir else (),
)
loss_fn = nn.CrossEntropyLoss()
step = 0
while step < args.steps:
    for xb, yb in loader:
        optimizer.zero_grad()
        loss_fn(model(xb), yb).backward()
        optimizer.step()
        step += 1
        monitor.step(step)
        if step == args.steps:
            break
monitor.close()
canaries.detach()
for r in monitor.history:  # each check's audited ε (certified over the run) beside the accountant's
    s = r.scalars
    print(
        f"check at step {r.step}: accountant ε {s['privacy/epsilon']:.3f}, audited ε >= "
        f"{s.get('privacy/canaries/steinke/epsilon_lower_bound', math.nan):.3f} (Steinke), "
        f"{s.get('privacy/canaries/fdp/epsilon_lower_bound', math.nan):.3f} (f-DP)"
    )

model.eval()
with torch.no_grad():
    accuracy = float((model(x[test_idx]).argmax(1) == y[test_idx]).float().mean())
accountant = engine.get_epsilon(DELTA)
print(f"steps {step}, noise factor {args.noise_factor}, test accuracy {accuracy:.3f}")
print(f"accountant ε = {accountant:.3f} at δ = {DELTA:g}")
report = monitor.last_report
alarms = [r.step for r in monitor.history if r.dp_violation]
print(
    f"monitor: {len(monitor.history)} checks, DP alarm at steps {alarms}"
    if alarms
    else f"monitor: {len(monitor.history)} checks, no DP alarm"
)
n = args.canaries
for method in ("steinke", "fdp"):
    eps = report.scalars[f"privacy/canaries/{method}/epsilon_lower_bound"]
    verdict = (
        "EXCEEDS the accountant: the run is not as private as claimed"
        if eps > accountant
        else "consistent with the accountant"
    )
    print(f"gradient canaries ({n}) {method:8s} audited ε >= {eps:.3f}  {verdict}")
# The input canaries, audited once after training (a single test at 95 %).
scores = input_canaries.scores(LossQuery(model))
for method in ("steinke", "fdp"):
    eps = float(one_run_epsilon(*scores, delta=DELTA, method=method))
    verdict = "EXCEEDS the accountant" if eps > accountant else "consistent with the accountant"
    n = len(scores[0]) + len(scores[1])
    print(f"input canaries ({n}) {method:8s} audited ε >= {eps:.3f}  {verdict}")
