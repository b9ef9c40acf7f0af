"""Small DP-SGD runs on real Opacus for the mechanism-check tests: a 6 → 16 → 3 classifier of
``N`` seeded Gaussian records, made private with SGD, and the loop that trains it a number of
steps (epochs restarted as needed)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N = 200


def toy_data(seed: int) -> TensorDataset:
    """``N`` records of 6 Gaussian features and one of 3 labels, drawn from their own seeded
    generator (the global RNG left to the model's initialisation)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


def toy_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def make_private(
    module: nn.Module, net: nn.Module, data: TensorDataset, *, batch: int, **options: Any
) -> tuple:
    """``PrivacyEngine().make_private`` of ``module`` (``net`` or a wrapper of it) with SGD at lr
    0.2 over ``net``'s parameters, a loader of ``batch`` records and Opacus' notices silenced."""
    from opacus import PrivacyEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG and accountant notices
        return PrivacyEngine().make_private(
            module=module,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
            data_loader=DataLoader(data, batch_size=batch),
            **options,
        )


def train(
    model: nn.Module,
    optimizer: Any,
    loader: Iterable[Any],
    loss_of: Callable[..., torch.Tensor],
    *,
    steps: int,
) -> None:
    """``steps`` optimizer steps over ``loader``, restarted at each epoch's end."""
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss_of(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                return


def with_noise_factor(optimizer: Any, factor: float) -> None:
    """``add_noise`` runs with σ · factor (the fault of noise removed or scaled); σ is restored
    before the accountant's hook reads it."""
    original = optimizer.add_noise

    def add_noise() -> None:
        sigma = optimizer.noise_multiplier
        optimizer.noise_multiplier = sigma * factor
        try:
            original()
        finally:
            optimizer.noise_multiplier = sigma

    optimizer.add_noise = add_noise
