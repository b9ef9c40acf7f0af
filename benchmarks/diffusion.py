"""Diffusion-model membership statistics: time per check against the forward-pass floor, and
the statistics' strength on an over-fit DDPM beside DOMIAS on the same model's samples.

``--section time``: one :class:`privmon.queries.DiffusionQuery` call (``prepare`` + one batch of
n images) against its floor, the bare ``model(x_t, t)`` calls the statistic needs, with the same
number of rows per call (pre-built inputs, no arithmetic), the two timed in turn ``--repeats``
times after a warm-up: medians of each and of the pairs' ratios. Two random-weight diffusers
``UNet2DModel``: the digits model of the example (1×8×8, channels 16/32, n = 256) and a
CIFAR-sized one (3×32×32, channels 32/64/64, n = 64; ``--models digits`` skips it). Goal: ≤ 1.2×
the floor.

``--section attacks``: ``examples/diffusion.py``'s DDPM (UNet2DModel 16/32, DDPMScheduler T =
1000, AdamW 1e-3, batches of 64) trained ``--steps`` steps on 200 digit images, then scored on
the 200 members and 800 held-out images: AUC, TPR at 1 % FPR and the optimal advantage
(histogram, debiased value and certified lower bound at δ = 0.05) per statistic and timestep;
the size PIAN normalises away, mean|ε_θ(x_0, 0)| (lower for members), as a statistic of its own;
DOMIAS (KDE on 10 PCA axes of a 400-image reference set) on ``--samples`` DDIM samples (50
steps) of the same model. Goals: every statistic's AUC > 0.5 (members more member-like); PIA's
advantage ≥ the loss's at the same timestep.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/diffusion.py                   # both (~6 minutes)
    OMP_WAIT_POLICY=PASSIVE python benchmarks/diffusion.py --section time --models digits \
        --repeats 15
    OMP_WAIT_POLICY=PASSIVE python benchmarks/diffusion.py --section attacks --steps 3000
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler, UNet2DModel

import privmon
from privmon.attacks import model_calls
from privmon.attacks.diffusion import MAX_BATCH_VALUES
from privmon.demo import digits_splits
from privmon.queries import DiffusionQuery, GeneratorQuery

CASES = [  # (statistic, timesteps)
    ("loss", 100),
    ("loss", [50, 100, 200]),
    ("pia", 100),
    ("pia", [50, 100, 200]),
    ("pian", 100),
    ("secmi", 100),
    ("sima", 100),
    ("sima", [50, 100, 200]),
]


def unet(channels: tuple[int, ...], in_channels: int, size: int) -> UNet2DModel:
    return UNet2DModel(
        sample_size=size,
        in_channels=in_channels,
        out_channels=in_channels,
        block_out_channels=channels,
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownBlock2D",) * len(channels),
        up_block_types=("UpBlock2D",) * len(channels),
    ).eval()


def call_rows(statistic: str, timesteps, n: int, max_batch: int, interval: int = 10) -> list[int]:
    """Rows of each model call the query makes: passes of n (or n·m) images in chunks."""
    m = 1 if isinstance(timesteps, int) else len(timesteps)
    if statistic in ("loss", "sima"):
        passes = [n * m]
    elif statistic in ("pia", "pian"):
        passes = [n, n * m]
    else:
        passes = [n] * model_calls("secmi", timesteps, interval=interval)
    return [min(max_batch, r - s) for r in passes for s in range(0, r, max_batch)]


def paired_seconds(check, floor, repeats: int) -> tuple[float, float, float]:
    """Medians of the check's and the floor's times and of their ratio, the two timed in turn
    (``repeats`` pairs after a warm-up of each), so that a load that comes and goes on a shared
    machine hits both sides alike."""
    check(), floor()
    pairs = []
    for _ in range(repeats):
        times = []
        for fn in (check, floor):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        pairs.append(times)
    q, f = (statistics.median(p[i] for p in pairs) for i in (0, 1))
    return q, f, statistics.median(a / b for a, b in pairs)


def section_time(repeats: int, models: str) -> None:
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    print(
        "| model | statistic | timesteps | ε_θ evals / image | model calls | query ms "
        "| floor ms | ratio |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for label, channels, shape, n in (
        ("digits 1×8×8 (16/32)", (16, 32), (1, 8, 8), 256),
        ("CIFAR-sized 3×32×32 (32/64/64)", (32, 64, 64), (3, 32, 32), 64),
    )[: 1 if models == "digits" else 2]:
        torch.manual_seed(0)
        model = unet(channels, shape[0], shape[1])
        images = torch.rand(n, *shape) * 2 - 1
        max_batch = max(1, MAX_BATCH_VALUES // math.prod(shape))
        for statistic, timesteps in CASES:
            query = DiffusionQuery(model, scheduler, statistic, timesteps=timesteps)
            rows = call_rows(statistic, timesteps, n, max_batch)
            inputs = [(torch.randn(r, *shape), torch.randint(0, 1000, (r,))) for r in rows]

            def check(query=query, images=images):
                query.prepare()
                query(images)
                query.release()

            def floor(inputs=inputs, model=model):
                with torch.no_grad():
                    for x, t in inputs:
                        model(x, t)

            q, f, ratio = paired_seconds(check, floor, repeats)
            ts = str(timesteps).replace(" ", "")
            evals = model_calls(statistic, timesteps)
            print(
                f"| {label} | {statistic} | {ts} | {evals} | {len(rows)} | {1e3 * q:.1f} "
                f"| {1e3 * f:.1f} | {ratio:.2f}× |"
            )


def train_ddpm(members: torch.Tensor, steps: int, seed: int) -> tuple[UNet2DModel, DDPMScheduler]:
    """The example's DDPM, trained ``steps`` steps on ``members`` (n, 1, 8, 8)."""
    torch.manual_seed(seed)
    model = unet((16, 32), 1, 8).train()
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x0 = members[torch.randint(0, len(members), (64,))]
        noise = torch.randn_like(x0)
        t = torch.randint(0, 1000, (len(x0),))
        loss = F.mse_loss(model(scheduler.add_noise(x0, noise, t), t).sample, noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), scheduler


def attack_row(name: str, member, nonmember, higher_is_member: bool) -> str:
    m, h = (member, nonmember) if higher_is_member else (-member, -nonmember)
    est = privmon.optimal_advantage(m, h, method="histogram", delta=0.05)
    tpr = privmon.tpr_at_fpr(m, h, fpr=0.01)[0.01]
    return f"| {name} | {privmon.auc(m, h):.3f} | {tpr:.3f} | {est.value:.3f} | {est.lower:.3f} |"


def section_attacks(steps: int, samples: int, seed: int) -> None:
    members, nonmembers, reference = digits_splits(
        seed, n_members=200, n_nonmembers=800, n_reference=400
    )
    members, nonmembers = members.view(-1, 1, 8, 8), nonmembers.view(-1, 1, 8, 8)
    t0 = time.perf_counter()
    model, scheduler = train_ddpm(members, steps, seed)
    print(f"trained {steps} steps in {time.perf_counter() - t0:.0f} s\n")
    print("| statistic | AUC | TPR @ 1 % FPR | advantage | certified lower |")
    print("|---|---:|---:|---:|---:|")
    for statistic, timesteps in (
        ("loss", [50, 100, 200]),
        ("pia", [50, 100, 200]),
        ("pian", [50, 100, 200]),
        ("secmi", [50, 100, 200]),
        ("sima", [50, 100, 200]),
    ):
        query = DiffusionQuery(model, scheduler, statistic, timesteps=timesteps)
        query.prepare()
        a, b = query(members), query(nonmembers)
        for j, t in enumerate(timesteps):
            print(attack_row(f"{statistic} @ t = {t}", a[:, j], b[:, j], query.higher_is_member))
    with torch.no_grad():  # PIAN's normaliser: the size of ε̂ = ε_θ(x_0, 0) that PIAN divides out
        size_m, size_h = (
            model(x, torch.zeros(len(x), dtype=torch.long)).sample.abs().flatten(1).mean(1)
            for x in (members, nonmembers)
        )
    print(attack_row("mean\\|ε̂\\| (PIAN's normaliser)", size_m, size_h, False))

    sampler = DDIMScheduler.from_config(scheduler.config)

    @torch.no_grad()
    def generate(n: int, device: torch.device) -> torch.Tensor:
        x = torch.randn((n, 1, 8, 8), generator=torch.Generator().manual_seed(seed)).to(device)
        sampler.set_timesteps(50)
        for t in sampler.timesteps:
            x = sampler.step(model(x, t).sample, t, x).prev_sample
        return x.clamp(-1, 1).reshape(n, -1)

    domias = GeneratorQuery(model, reference, sample_fn=generate, n_samples=samples, embed="pca")
    domias.prepare()
    a, b = domias(members.reshape(len(members), -1)), domias(nonmembers.reshape(-1, 64))
    domias.release()
    print(attack_row(f"DOMIAS ({samples} DDIM samples)", a, b, domias.higher_is_member))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=("time", "attacks", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", choices=("digits", "both"), default="both")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.section in ("time", "all"):
        section_time(args.repeats, args.models)
        print()
    if args.section in ("attacks", "all"):
        section_attacks(args.steps, args.samples, args.seed)


if __name__ == "__main__":
    main()
