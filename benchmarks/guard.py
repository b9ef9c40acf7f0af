"""What the training guard costs per check: saving and restoring the training state once
(entering and leaving :class:`~privmon._training_guard.TrainingGuard`: RNGs, modes, a copy of
every buffer, gradients) and the work between query calls (:meth:`after_query`: parameter
versions, modes, buffer versions), beside one forward pass of a 256-record batch.

    python benchmarks/guard.py            # prints a markdown table (about a minute)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from privmon._training_guard import TrainingGuard


def mlp() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    return model, torch.randn(256, 784)


def deep_batchnorm() -> tuple[nn.Module, torch.Tensor]:
    """50 blocks of Linear + BatchNorm + ReLU: 200 parameters, 150 buffers."""
    blocks = [m for _ in range(50) for m in (nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU())]
    return nn.Sequential(*blocks), torch.randn(256, 128)


def conv() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )  # fmt: skip
    return model, torch.randn(256, 3, 32, 32)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print("| model | parameters | buffers | enter + exit (ms) | after_query (µs) | forward (ms) |")
    print("|---|---|---|---|---|---|")
    for name, build in (("MLP 784-512-256-10", mlp), ("50 x Linear+BN", deep_batchnorm),
                        ("conv net (CIFAR)", conv)):  # fmt: skip
        model, batch = build()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # a training step's gradients

        def enter_exit(model: nn.Module = model) -> None:
            with TrainingGuard([model], []):
                pass

        guard = TrainingGuard([model], [])
        guard.__enter__()
        per_call = median_seconds(guard.after_query, 200)
        guard.__exit__(None, None, None)

        def forward(model: nn.Module = model, batch: torch.Tensor = batch) -> None:
            with torch.no_grad():
                model.eval()(batch)

        n_params = sum(1 for _ in model.parameters())
        n_buffers = sum(1 for _ in model.buffers())
        print(
            f"| {name} | {n_params} | {n_buffers} | {median_seconds(enter_exit, 50) * 1e3:.2f} "
            f"| {per_call * 1e6:.0f} | {median_seconds(forward, 20) * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
