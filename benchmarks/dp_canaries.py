"""Dirac gradient canaries catch a DP-SGD run whose optimizer adds less noise than its accountant
assumes: a one-run audit (ε lower bound) beside the accountant's ε.

The case: scikit-learn's digits, 600 training records, an MLP 64-256-10, Opacus
``make_private(noise_multiplier=2.5, max_grad_norm=1.0)``, Poisson batches of 60 (q = 0.1), SGD
lr 0.5, 400 steps, δ = 1e-5: the accountant reports ε ≈ 3.67. A silent bug is simulated by
wrapping the optimizer instance's ``add_noise`` so that it runs with ``noise_multiplier`` scaled
by a factor (0: no noise, 0.5: half the noise) and restores it before the accountant's step hook
reads it: the accountant keeps reporting ε for σ = 2.5 while the gradients get less noise.
The canaries are attached after the bug, so they pass through the buggy ``add_noise``.

For seeds 0-4 × {correct, half, no noise} × {no canaries, 1e3, 1e5 canaries}: the audited ε
lower bound by both methods of ``privmon.audit.one_run_epsilon`` (Steinke et al.; f-DP,
Mahloujifar et al.; its default selection of guesses), whether it exceeds the accountant's ε
(the alarm), the test accuracy, and the CPU time per step.

Then the alarm's level and power over many seeded runs of a small model (the block's scores do
not depend on the model under SGD, so a small one gives the same mechanism, faster): the
fraction of runs whose audited ε exceeds the accountant's ε with the correct noise (a false
alarm; at most the significance, 5 %) and with half the noise (power).

    python benchmarks/dp_canaries.py            # markdown tables (9 CPU minutes, one thread)
    python benchmarks/dp_canaries.py --quick    # 1 seed, 100 steps, 10 null runs (smoke test)
    python benchmarks/dp_canaries.py --parts audit --peer-python /work/venv-jaxprivacy/bin/python
                                                # the audit beside jax_privacy on the same scores
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from opacus import PrivacyEngine
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon.audit import GradientCanaries
from privmon.audit.one_run import one_run_epsilon

DELTA = 1e-5
SIGMA, CLIP, LR = 2.5, 1.0, 0.5
N_TRAIN, BATCH = 600, 60
METHODS = ("steinke", "fdp")
NOISE = {"correct": 1.0, "half": 0.5, "none": 0.0}
CANARIES: dict[str, int | None] = {"no canaries": None, "1e3": 1_000, "1e5": 100_000}
for message in ("Secure RNG", "Optimal order", "Full backward hook", "invalid value"):
    warnings.filterwarnings("ignore", message=message)


def with_noise_factor(optimizer: Any, factor: float) -> None:
    """The silent bug: ``add_noise`` runs with σ · factor; σ is restored before the accountant's
    hook reads it (Opacus' ``pre_step``: add_noise → scale_grad → step hook)."""
    if factor == 1.0:
        return
    original = optimizer.add_noise

    def add_noise() -> None:
        sigma = optimizer.noise_multiplier
        optimizer.noise_multiplier = sigma * factor
        try:
            original()
        finally:
            optimizer.noise_multiplier = sigma

    optimizer.add_noise = add_noise


def digits(seed: int) -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x)))
    train, test = order[:N_TRAIN], order[N_TRAIN:]
    return TensorDataset(x[train], y[train]), x[test], y[test]


def run(
    seed: int,
    factor: float,
    canaries: int | None,
    *,
    steps: int,
    model_fn: Callable[[], nn.Module],
    data: tuple[TensorDataset, torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    """One training run: accountant ε, canary scores, test accuracy, CPU ms per step."""
    torch.manual_seed(seed)
    train, x_test, y_test = data
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(train, batch_size=BATCH),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
    )
    with_noise_factor(optimizer, factor)
    audit = None
    if canaries is not None:
        audit = GradientCanaries(optimizer, canaries, seed=seed)
    loss_fn = nn.CrossEntropyLoss()
    done, start = 0, time.process_time()  # CPU time: the machine is shared
    while done < steps:
        for xb, yb in loader:
            optimizer.zero_grad()
            loss_fn(model(xb), yb).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    seconds = time.process_time() - start
    with torch.no_grad():
        model.eval()
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    out = {
        "eps": float(engine.get_epsilon(DELTA)),
        "accuracy": accuracy,
        "ms_per_step": 1e3 * seconds / steps,
    }
    if audit is not None:
        out["scores"] = audit.scores()
        audit.detach()
    return out


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def small() -> nn.Module:
    return nn.Linear(64, 10)


def audit_table(seeds: int, steps: int, peer_python: str | None = None) -> None:
    """Audited ε per seed beside the accountant's, and the cost in test accuracy; with
    ``peer_python``, jax_privacy's bounds on the same canary scores."""
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    audited: dict[tuple[str, str, str], list[float]] = {}
    arrays: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    for seed in range(seeds):
        data = digits(seed)
        for noise, factor in NOISE.items():
            for name, canaries in CANARIES.items():
                r = run(seed, factor, canaries, steps=steps, model_fn=mlp, data=data)
                results.setdefault((noise, name), []).append(r)
                if "scores" in r:
                    key = f"{noise}-{name}_{seed}"
                    arrays[f"in_{key}"], arrays[f"out_{key}"] = r["scores"]
                    for method in METHODS:
                        eps = one_run_epsilon(*r["scores"], delta=DELTA, method=method)
                        audited.setdefault((noise, name, method), []).append(float(eps))
    minutes = (time.perf_counter() - t0) / 60
    print(
        f"\n## Audit of the digits MLP: {seeds} seeds, {steps} steps, σ = {SIGMA} claimed, "
        f"δ = {DELTA:g} ({minutes:.1f} min)\n"
    )
    print("| noise | canaries | accountant ε | method | audited ε, seeds 0.. | > accountant |")
    print("|---|---|---|---|---|---|")
    for (noise, name, method), values in audited.items():
        accountant = results[(noise, name)][0]["eps"]
        per_seed = " ".join(f"{v:.2f}" for v in values)
        above = sum(v > accountant for v in values)
        print(
            f"| {noise} | {name} | {accountant:.2f} | {method} | {per_seed} | "
            f"{above}/{len(values)} |"
        )
    if peer_python:
        peer_table(peer_python, arrays, audited, results, seeds)
    print(f"\n## Cost in test accuracy (mean ± sd over {seeds} seeds)\n")
    print("| noise | canaries | test accuracy |")
    print("|---|---|---|")
    for (noise, name), rs in results.items():
        acc = [r["accuracy"] for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print(f"| {noise} | {name} | {statistics.mean(acc):.3f} ± {sd:.3f} |")


def peer_table(
    peer_python: str,
    arrays: dict[str, np.ndarray],
    audited: dict[tuple[str, str, str], list[float]],
    results: dict[tuple[str, str], list[dict[str, Any]]],
    seeds: int,
) -> None:
    """jax_privacy's one-run bounds on the same canary scores, in its own environment
    (``benchmarks/one_run_audit.py``'s peer: only arrays cross over)."""
    from one_run_audit import run_peer

    peer = run_peer(peer_python, arrays)
    print(f"\n## jax_privacy {peer['version']} on the same scores (δ = {DELTA:g}, 0.05)\n")
    print(
        "Mean over seeds and runs above the accountant's ε; jax_privacy guesses positive only; "
        "its default corrects by Bonferroni over its threshold hull.\n"
    )
    print("| noise | canaries | method | privmon | jax_privacy default | jax_privacy Split |")
    print("|---|---|---|---|---|---|")
    for (noise, name, method), values in audited.items():
        accountant = results[(noise, name)][0]["eps"]
        cells = [f"{np.mean(values):.2f} ({sum(v > accountant for v in values)}/{seeds})"]
        for choice in ("bonferroni", "split"):
            theirs = [peer["scores"][f"{noise}-{name}_{s} {method} {choice}"] for s in range(seeds)]
            cells.append(f"{np.mean(theirs):.2f} ({sum(v > accountant for v in theirs)}/{seeds})")
        print(f"| {noise} | {name} | {method} | {' | '.join(cells)} |")


def timing_table(repeats: int, steps: int) -> None:
    """CPU time per step with each canary setting, interleaved repeats, median (1 thread)."""
    data = digits(0)
    times: dict[str, list[float]] = {name: [] for name in CANARIES}
    for _ in range(repeats):
        for name, canaries in CANARIES.items():
            r = run(0, 1.0, canaries, steps=steps, model_fn=mlp, data=data)
            times[name].append(r["ms_per_step"])
    base = statistics.median(times["no canaries"])
    print(f"\n## CPU time per step ({repeats} interleaved repeats of {steps} steps, median)\n")
    print("| canaries | ms / step | vs none |")
    print("|---|---|---|")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.2f} | {ms / base - 1:+.0%} |")


def alarm_table(runs: int, steps: int) -> None:
    """How often 'audited ε > accountant ε' fires with the correct noise (level) and with half
    the noise (power), 1e5 block canaries on a linear model."""
    t0 = time.perf_counter()
    alarms: dict[tuple[str, str], int] = {}
    for seed in range(runs):
        data = digits(seed)
        for noise in ("correct", "half"):
            r = run(
                1000 + seed,
                NOISE[noise],
                100_000,
                steps=steps,
                model_fn=small,
                data=data,
            )
            for method in METHODS:
                eps = float(one_run_epsilon(*r["scores"], delta=DELTA, method=method))
                alarms[(noise, method)] = alarms.get((noise, method), 0) + int(eps > r["eps"])
    minutes = (time.perf_counter() - t0) / 60
    print(
        f"\n## Alarm 'audited ε > accountant ε' over {runs} seeded runs (1e5 block canaries, "
        f"linear model 64-10, {steps} steps; {minutes:.1f} min)\n"
    )
    print("| noise | method | alarms | rate |")
    print("|---|---|---|---|")
    for (noise, method), count in alarms.items():
        print(f"| {noise} | {method} | {count}/{runs} | {count / runs:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats")
    parser.add_argument("--null-runs", type=int, default=100, help="runs for level and power")
    parser.add_argument("--quick", action="store_true", help="a smoke test: everything small")
    parser.add_argument(
        "--peer-python",
        default=None,
        help="jax_privacy's interpreter (its own venv, see benchmarks/one_run_audit.py): its "
        "bounds on the same scores",
    )
    parser.add_argument("--parts", default="audit,timing,alarm")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.repeats, args.null_runs = 1, 100, 1, 10
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    if "audit" in parts:
        audit_table(args.seeds, args.steps, args.peer_python)
    if "timing" in parts:
        timing_table(args.repeats, min(args.steps, 100))
    if "alarm" in parts:
        alarm_table(args.null_runs, args.steps)


if __name__ == "__main__":
    main()
