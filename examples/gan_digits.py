"""Monitor a GAN's membership leakage while it trains (the `privmon demo` GAN as a plain script).

A small MLP GAN learns scikit-learn's 8x8 digits from a deliberately small training set (200
records), so it overfits and starts to leak which records it was trained on. Every `--every`
steps privmon asks three attackers what they can tell apart between the training records
(members) and held-out records (non-members): the discriminator's output, the distance to the
nearest generated sample, and both together. The figures go to TensorBoard.

    python examples/gan_digits.py --steps 3000   # logs in a fresh runs/gan_digits/version_N
    tensorboard --logdir runs/gan_digits         # every run, each a line of its own
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privmon
from privmon.demo import digits_splits, make_gan
from privmon.queries import DiscriminatorQuery, HybridQuery, NearestGeneratedQuery
from privmon.report import version_dir

LATENT = 16  # generator input size (make_gan's default)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=3000, help="training steps")
parser.add_argument(
    "--logdir", help="log directory (default: a fresh runs/gan_digits/version_N per run)"
)
parser.add_argument("--every", type=int, default=100, help="steps between privacy checks")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
# each run in a fresh folder: TensorBoard shows the runs side by side, never mixed in one line
logdir = args.logdir or version_dir("runs/gan_digits")

torch.manual_seed(args.seed)
# Disjoint splits of one shuffled pool, so members and non-members come from the same
# distribution: any difference the attackers find is leakage, not a shifted held-out set.
members, nonmembers, _ = digits_splits(args.seed, n_members=200, n_nonmembers=400, n_reference=400)
generator, discriminator = make_gan(dim=members.shape[1], latent=LATENT)
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
loader = DataLoader(TensorDataset(members), batch_size=64, shuffle=True, drop_last=True)

# What an attacker observes about a record x: D(x) (MACE eq. 20), the distance from x to the
# nearest of 1000 generated samples (eq. 19), and the pair of both (eq. 21).
disc_q = DiscriminatorQuery(discriminator)  # reported as "disc"
near_q = NearestGeneratedQuery(generator, n_samples=1000, latent_dim=LATENT)  # "nn_dist"
hybrid_q = HybridQuery(disc_q, near_q)  # "hybrid"

monitor = privmon.PrivacyMonitor(
    [disc_q, near_q, hybrid_q],
    # Audit sets: fixed batches in a fixed order (per-record risk refers to member indices).
    [members[i : i + 256] for i in range(0, len(members), 256)],
    [nonmembers[i : i + 256] for i in range(0, len(nonmembers), 256)],
    every_n_steps=args.every,
    writer=logdir,  # TensorBoard event files go here
)

bce = nn.BCEWithLogitsLoss()
step = 0
while step < args.steps:
    for (real,) in loader:
        step += 1
        fake = generator(torch.randn(real.shape[0], LATENT))

        # Discriminator step: real records are labelled 1, generated ones 0. `detach` keeps
        # this loss from reaching the generator.
        logits = discriminator(torch.cat([real, fake.detach()])).squeeze(1)
        labels = torch.cat([torch.ones(real.shape[0]), torch.zeros(real.shape[0])])
        opt_d.zero_grad()
        bce(logits, labels).backward()
        opt_d.step()

        # Generator step (non-saturating loss): make D call the fakes real. This also leaves
        # gradients on D's parameters; opt_d.zero_grad() discards them before D's next step.
        opt_g.zero_grad()
        bce(discriminator(fake).squeeze(1), torch.ones(real.shape[0])).backward()
        opt_g.step()

        # A check every `--every` steps. It puts the models in eval mode and restores every
        # mode and RNG afterwards, so training is bit-identical with or without the monitor.
        monitor.step(step)
        if step >= args.steps:
            break

# Make sure the final model is audited, whether or not --steps is a multiple of --every.
if monitor.last_report is None or monitor.last_report.step != step:
    monitor.check(step)
monitor.close()  # flush the event files

report = monitor.last_report
print(f"after {step} steps ({len(monitor.history)} checks):")
print(f"{'query/method':<18} {'advantage':>9} {'lower':>7} {'AUC':>6}")
for name, result in report.queries.items():
    auc = report.scalars.get(f"privacy/{name}/auc")  # only for scalar queries
    for method, est in result.estimates.items():
        # value: debiased estimate of the best attack's advantage (0 = nothing leaks, 1 = all);
        # lower: certified lower bound (holds with probability >= 95 %).
        auc_text = "" if auc is None else f"{auc:.3f}"
        print(f"{name + '/' + method:<18} {est.value:9.3f} {est.lower:7.3f} {auc_text:>6}")
print(f"most exposed training records (disc): {list(report.queries['disc'].top_records[:5])}")
print(f"\nopen: tensorboard --logdir {args.logdir or 'runs/gan_digits'}")
