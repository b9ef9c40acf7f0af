"""A new diffusion statistic is one object registered in one place (issue #41): a toy statistic
defined here, ‖ε_θ(x_0, t)‖² per image and timestep, is registered, computed by
``diffusion_statistic`` and ``DiffusionQuery`` and checked against its closed form. Nothing of
privmon is patched; the registry is left as it was found."""

from __future__ import annotations

import pytest
import torch

from privmon.attacks import diffusion_statistic, model_calls
from privmon.attacks.diffusion import (
    STATISTICS,
    DiffusionStatistic,
    StatisticInputs,
    register_statistic,
    statistic_of,
    unregister_statistic,
)
from privmon.queries import DiffusionQuery

ABAR = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100, dtype=torch.float64), dim=0)


class SquaredNorm(DiffusionStatistic):
    """‖ε_θ(x_0, t)‖² (SimA with exponent 2)."""

    name = "squared_norm"

    def compute(self, inputs: StatisticInputs) -> torch.Tensor:
        x0, n = inputs.images, inputs.n
        scores = inputs.predict(
            n * inputs.m,
            lambda r: (x0[r % n], inputs.t_of[r // n]),
            lambda r, out: (out**2).flatten(1).sum(dim=1),
        )
        return inputs.columns(scores)


@pytest.fixture
def toy():
    register_statistic(SquaredNorm())
    yield "squared_norm"
    unregister_statistic("squared_norm")
    with pytest.raises(ValueError, match="statistic must be one of"):
        statistic_of("squared_norm")


def model(x, t):  # ε̂ = (1 + t/100) · x: the statistic is (1 + t/100)² ‖x‖²
    return x * (1 + t.to(x.dtype).view(-1, *[1] * (x.ndim - 1)) / 100)


def test_a_registered_statistic_reads_its_closed_form(toy):
    images = torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    got = diffusion_statistic(model, images, ABAR, statistic=toy, timesteps=[10, 30], max_batch=3)
    norms = (images**2).flatten(1).sum(dim=1)
    expected = torch.stack([norms * 1.1**2, norms * 1.3**2], dim=1)
    torch.testing.assert_close(got, expected)
    assert model_calls(toy, [10, 30]) == 2


def test_the_query_asks_the_statistic(toy):
    images = torch.randn(4, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    query = DiffusionQuery(model, ABAR, toy, timesteps=20)
    assert query.name == toy and query.higher_is_member is False
    expected = (images**2).flatten(1).sum(dim=1) * 1.2**2
    torch.testing.assert_close(query(images), expected)


def test_the_built_in_statistics_stay(toy):
    assert toy not in STATISTICS
    with pytest.raises(ValueError, match="built-in"):
        unregister_statistic("sima")
    with pytest.raises(ValueError, match="not yet registered"):
        register_statistic(SquaredNorm())
