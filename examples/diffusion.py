"""Monitor a diffusion model's membership leakage while it trains, and stop it early.

A small DDPM (a diffusers `UNet2DModel` with a `DDPMScheduler`, T = 1000) learns scikit-learn's
8x8 digits from a deliberately small training set (200 images), so it over-fits and starts to
leak which images it was trained on. Every `--every` steps privmon scores the training images
(members) and held-out images (non-members) with three statistics of the model's noise
prediction (the loss at t = 100, PIA at t = 100 and SecMI at t = 100, stride 10), and with
DOMIAS on images the model generates (DDIM, `--sample-steps` steps). Training stops once the
certified lower bound on PIA's advantage exceeds `--budget`. Figures go to TensorBoard.

    python examples/diffusion.py                  # about 2 minutes on a laptop CPU
    tensorboard --logdir runs/diffusion           # each run in its own runs/diffusion/version_N
"""

import argparse
import logging
import time

import torch
import torch.nn.functional as F

try:
    from diffusers import DDIMScheduler, DDPMScheduler, UNet2DModel
except ImportError as err:
    raise SystemExit(
        f"this example needs diffusers: pip install 'privmon[diffusion]' ({err})"
    ) from None

import privmon
from privmon.demo import digits_splits
from privmon.queries import DiffusionQuery, GeneratorQuery
from privmon.report import tags, version_dir

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=2000, help="training steps (batches of 64)")
parser.add_argument("--every", type=int, default=250, help="steps between privacy checks")
parser.add_argument("--budget", type=float, default=0.5, help="certified advantage to stop at")
parser.add_argument("--samples", type=int, default=500, help="generated images per check")
parser.add_argument("--sample-steps", type=int, default=20, help="DDIM steps per sample")
parser.add_argument(
    "--logdir", help="log directory (default: a fresh runs/diffusion/version_N per run)"
)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
torch.set_num_threads(1)  # a small UNet on 8x8 images: one thread is fastest on a small CPU
t_start = time.perf_counter()

torch.manual_seed(args.seed)
# Disjoint splits of one shuffled pool (members, non-members, DOMIAS' reference set), in [-1, 1]
members, nonmembers, reference = digits_splits(
    args.seed, n_members=200, n_nonmembers=200, n_reference=400
)
members, nonmembers = members.view(-1, 1, 8, 8), nonmembers.view(-1, 1, 8, 8)

unet = UNet2DModel(
    sample_size=8,
    in_channels=1,
    out_channels=1,
    block_out_channels=(16, 32),
    layers_per_block=1,
    norm_num_groups=8,
    down_block_types=("DownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "UpBlock2D"),
)
scheduler = DDPMScheduler(num_train_timesteps=1000)
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
sampler = DDIMScheduler.from_config(scheduler.config)  # for generating; the query reads ᾱ only


@torch.no_grad()
def generate(n: int, device: torch.device) -> torch.Tensor:
    """n images by deterministic DDIM from noise of a fixed seed (the same noise every check,
    drawn from an own generator: the training's RNG is not touched), flattened to (n, 64)."""
    x = torch.randn((n, 1, 8, 8), generator=torch.Generator().manual_seed(args.seed)).to(device)
    sampler.set_timesteps(args.sample_steps)
    for t in sampler.timesteps:
        x = sampler.step(unet(x, t).sample, t, x).prev_sample
    return x.clamp(-1, 1).reshape(n, -1)


queries = [
    DiffusionQuery(unet, scheduler, "loss", timesteps=100),  # ‖ε − ε_θ(x_t, t)‖², fixed ε
    DiffusionQuery(unet, scheduler, "pia", timesteps=100),  # Kong et al.: 2 calls
    DiffusionQuery(unet, scheduler, "secmi", timesteps=100, interval=10),  # Duan et al.: 12
    # DOMIAS: p_G(x) / p_R(x) from the generated images (needs no access to the model)
    GeneratorQuery(unet, reference, sample_fn=generate, n_samples=args.samples, embed="pca"),
]
early_stopping = privmon.PrivacyEarlyStopping("pia/histogram", args.budget, use="lower")
monitor = privmon.PrivacyMonitor(
    queries,
    [members],  # audit sets: fixed batches in a fixed order
    [nonmembers],
    every_n_steps=args.every,
    methods=("histogram",),
    planned_checks=args.steps // args.every,
    writer=args.logdir or version_dir("runs/diffusion"),  # TensorBoard event files
    early_stopping=early_stopping,
)
logging.getLogger("privmon").setLevel(logging.ERROR)  # the table below says what matters

names = [q.name for q in queries]
print(f"members {len(members)}, non-members {len(nonmembers)}, reference {len(reference)}")
print(f"{'step':>5} {'loss':>6} " + " ".join(f"{n + ' AUC':>11}" for n in names) + "  pia lower")
step = 0
while step < args.steps and not monitor.should_stop:
    idx = torch.randint(0, len(members), (64,))
    x0 = members[idx]
    noise = torch.randn_like(x0)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (len(x0),))
    loss = F.mse_loss(unet(scheduler.add_noise(x0, noise, t), t).sample, noise)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % args.every == 0:
        report = monitor.check(step)  # None when the check failed (logged)
        if report is not None:
            s = report.scalars
            aucs = " ".join(f"{s[tags.auc(n)]:11.3f}" for n in names)
            print(f"{step:5d} {loss.item():6.3f} {aucs}  {s[tags.lower('pia', 'histogram')]:9.3f}")
monitor.close()

if early_stopping.stopped_step is not None:
    print(
        f"stopped at step {early_stopping.stopped_step}: PIA's certified advantage > {args.budget}"
    )
else:
    print(f"trained {step} steps; PIA's certified advantage stayed <= {args.budget}")
print(f"wall time {time.perf_counter() - t_start:.0f} s")
