"""The diffusion loss in bounded memory: its noise ε ~ torch.randn((n, m, ...)) is drawn
``max_batch`` rows at a time, with the one draw's values (the scores bit for bit), so a batch
never holds m times its size; and SecMI's stride must be a positive integer."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_unet

from privmon.attacks import diffusion_statistic, model_calls
from privmon.attacks.diffusion import noise_prediction
from privmon.queries import DiffusionQuery

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
ABAR = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), dim=0)


def per_row(x, t):
    """A noise predictor whose output for a row depends on that row only."""
    return 0.3 * x + 0.01 * t.view(-1, *[1] * (x.ndim - 1))


def _one_call_loss(model, images, timesteps, noise):
    """The loss as it was computed before ε was drawn in pieces: every row r = j·n + i
    (timestep j, image i) in one model call, ε one tensor of shape (n, m, ...)."""
    n, m = images.shape[0], len(timesteps)
    r = torch.arange(n * m)
    i, j = r % n, r // n
    t = torch.tensor(timesteps)[j]
    a = ABAR.to(images.dtype)[t].view(-1, *[1] * (images.ndim - 1))
    eps = noise[i, j]
    x_t = a.sqrt() * images[i] + (1 - a).sqrt() * eps
    with torch.no_grad():
        out = noise_prediction(model, x_t, t)
    return ((eps - out) ** 2).flatten(1).sum(dim=1).view(m, n).T


# n images of shape S at m timesteps: totals under 16, not a multiple of 16, and of whole 16s
SIZES = [(1, (1, 1, 1), [10]), (3, (1, 1, 1), [10, 20]), (5, (3, 5, 5), [3, 20, 41, 500]),
         (4, (1, 8, 8), [7, 90, 300])]  # fmt: skip


@pytest.mark.parametrize(("n", "shape", "timesteps"), SIZES)
@pytest.mark.parametrize("max_batch", [None, 1, 3, 7, 16, 10_000])
def test_a_generator_gives_the_scores_and_the_state_of_one_whole_draw(
    n, shape, timesteps, max_batch
):
    images = torch.rand((n, *shape), generator=torch.Generator().manual_seed(1)) * 2 - 1
    whole = torch.Generator().manual_seed(5)
    noise = torch.randn((n, len(timesteps), *shape), generator=whole)
    pieces = torch.Generator().manual_seed(5)
    got = diffusion_statistic(
        per_row, images, ABAR, statistic="loss", timesteps=timesteps, noise=pieces,
        max_batch=max_batch,
    )  # fmt: skip
    assert torch.equal(got, _one_call_loss(per_row, images, timesteps, noise))
    assert torch.equal(pieces.get_state(), whole.get_state())  # the next batch's draw follows


@pytest.mark.parametrize("max_batch", [None, 12, 100])
def test_a_batch_that_fits_one_call_scores_as_one_call_did_on_a_unet(max_batch):
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    images = torch.rand((4, 1, 8, 8), generator=torch.Generator().manual_seed(2)) * 2 - 1
    timesteps = [3, 50, 400]  # 12 rows: one call at each max_batch here
    query = DiffusionQuery(unet, ABAR, "loss", timesteps=timesteps, seed=9, max_batch=max_batch)
    query.prepare()
    first, second = query(images), query(images)  # two batches of one check
    draws = torch.Generator().manual_seed(9)
    for got in (first, second):
        noise = torch.randn((4, 3, 1, 8, 8), generator=draws)
        assert torch.equal(got, _one_call_loss(unet, images, timesteps, noise))


def test_calls_hold_at_most_max_batch_rows_and_are_as_few_as_before():
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    seen = []
    hook = unet.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    try:
        images = torch.rand(7, 1, 8, 8) * 2 - 1
        for max_batch in (1, 4, 5, 21, 64):
            seen.clear()
            query = DiffusionQuery(unet, ABAR, "loss", timesteps=[1, 2, 3], max_batch=max_batch)
            query.prepare()
            query(images)
            assert max(seen) == min(max_batch, 21) and sum(seen) == 21
            assert len(seen) == math.ceil(21 / max_batch)
    finally:
        hook.remove()


_PEAK = """
import resource, sys, torch
torch.set_num_threads(1)
from privmon.queries import DiffusionQuery
abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), dim=0)
images = torch.rand(32, 1, 64, 128) * 2 - 1  # 1 MiB of float32; at 100 timesteps ε is 100 MiB
query = DiffusionQuery(lambda x, t: 0.5 * x, abar, "loss", timesteps=list(range(0, 1000, 10)),
                       max_batch=8)
query.prepare()
query(images[:1])  # the first call's one-off allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
scores = query(images)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(tuple(scores.shape), grown // 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB: Linux")
def test_the_loss_of_a_batch_at_many_timesteps_never_holds_its_noise_whole():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=300,
    )  # fmt: skip
    shape, grown_mib = proc.stdout.split(")")
    assert shape == "(32, 100", proc.stderr
    # the whole ε is 100 MiB (the peak grew by twice that); 8 rows of it are 256 KiB
    assert int(grown_mib) < 20, proc.stdout


def test_a_secmi_stride_of_zero_is_refused_naming_it():
    images = torch.rand(2, 1, 4, 4)
    for statistic in ("secmi", "loss", "pia"):
        with pytest.raises(ValueError, match=r"^interval must be an integer >= 1, got 0$"):
            diffusion_statistic(
                per_row, images, ABAR, statistic=statistic, timesteps=[10], interval=0,
                noise=torch.Generator(),
            )  # fmt: skip
    with pytest.raises(ValueError, match=r"^interval must be an integer >= 1, got 0$"):
        model_calls("secmi", [20], interval=0)
    with pytest.raises(ValueError, match="interval must be an integer >= 1"):
        DiffusionQuery(per_row, ABAR, "secmi", timesteps=[20], interval=0)


def test_a_call_of_zero_rows_is_refused_naming_it():
    images = torch.rand(2, 1, 4, 4)
    for statistic in ("loss", "pia", "secmi", "sima"):
        with pytest.raises(ValueError, match=r"^max_batch must be an integer >= 1, got 0$"):
            diffusion_statistic(
                per_row, images, ABAR, statistic=statistic, timesteps=[10], max_batch=0,
                noise=torch.Generator(),
            )  # fmt: skip


def test_noise_that_is_neither_the_tensor_nor_a_cpu_generator_is_refused():
    images = torch.rand(2, 1, 4, 4)
    for bad, got in [(None, "NoneType"), (torch.zeros(2, 1, 4, 4), r"shape \(2, 1, 4, 4\)")]:
        with pytest.raises(ValueError, match=rf"noise= of shape \(2, 1, 1, 4, 4\).*got {got}"):
            diffusion_statistic(per_row, images, ABAR, statistic="loss", timesteps=[10], noise=bad)
