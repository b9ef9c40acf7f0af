"""Diffusion-model membership statistics (privmon.attacks.diffusion) and DiffusionQuery.

Every statistic is checked against the formula of ``diffusion-membership.md`` written out below
in float64 (a float64 copy of the model, one timestep and one image at a time), on a
random-weight diffusers ``UNet2DModel`` and on a plain module; conditional keyword arguments,
``encode``, the batching of timesteps into model calls, the seeded noise and bad input too.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_unet
from torch import nn

from privmon.attacks import alphas_cumprod, diffusion_statistic, model_calls, noise_prediction
from privmon.attacks.diffusion import STATISTICS
from privmon.queries import DiffusionQuery

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
N = 5


class Denoiser(nn.Module):
    """A plain noise predictor (x_t, t) -> ε̂ with a timestep embedding; counts its calls."""

    def __init__(self, steps: int = 200):
        super().__init__()
        self.inp, self.out = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 1, 3, padding=1)
        self.embed = nn.Embedding(steps, 4)
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        return self.out(torch.tanh(self.inp(x) + self.embed(t)[:, :, None, None]))


def _unet():
    torch.manual_seed(0)
    return tiny_unet().eval()


def _conditional_unet():
    torch.manual_seed(0)
    return tiny_unet(conditional=True).eval()


def _linear_abar(steps=200):
    return torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps, dtype=torch.float64), dim=0)


@pytest.fixture(scope="module")
def setups():
    torch.manual_seed(1)
    images = torch.rand(N, 1, 8, 8) * 2 - 1
    plain = Denoiser()
    with torch.no_grad():  # a denoiser far from zero, so every statistic is far from 0
        plain.embed.weight.mul_(3.0)
    return {
        "unet": (_unet(), diffusers.DDPMScheduler(num_train_timesteps=1000), images),
        "plain": (plain.eval(), _linear_abar(), images),
    }


# --- the formulas, written out in float64 ------------------------------------------------------


def _eps64(model64, x, t, cond=None):
    out = model64(x[None], torch.tensor([t]), **(cond or {}))
    return (out.sample if hasattr(out, "sample") else out)[0]


def _reference(model, abar, images, statistic, ts, *, k=10, p=4.0, noise=None, cond=None):
    """(n, m) float64: each image and timestep by the formula sheet, one at a time."""
    m64 = copy.deepcopy(model).double()
    a = abar.double()
    x0s = images.double()
    out = torch.zeros(len(x0s), len(ts), dtype=torch.float64)
    with torch.no_grad():
        for i, x0 in enumerate(x0s):
            c = None if cond is None else {key: v[i : i + 1].double() for key, v in cond.items()}
            for j, t in enumerate(ts):
                if statistic == "loss":
                    e = noise[i, j].double()
                    xt = a[t].sqrt() * x0 + (1 - a[t]).sqrt() * e
                    out[i, j] = ((e - _eps64(m64, xt, t, c)) ** 2).sum()
                elif statistic in ("pia", "pian"):
                    e = _eps64(m64, x0, 0, c)
                    if statistic == "pian":
                        e = e / e.abs().mean() * math.sqrt(2 / math.pi)
                    xt = a[t].sqrt() * x0 + (1 - a[t]).sqrt() * e
                    out[i, j] = ((e - _eps64(m64, xt, t, c)).abs() ** p).sum()
                elif statistic == "sima":
                    out[i, j] = (_eps64(m64, x0, t, c).abs() ** 4).sum()
                else:  # secmi

                    def y(x, s):
                        return x / a[s].sqrt()

                    def pos(s):
                        return (1 / a[s] - 1).sqrt()

                    def back(v, s):
                        return v * a[s].sqrt()

                    x, path = x0, {0: x0}
                    for s in range(0, t + 1, k):  # inversion 0 -> t + k
                        x = back(_eps64(m64, x, s, c) * (pos(s + k) - pos(s)) + y(x, s), s + k)
                        path[s + k] = x
                    xk = path[t + k]
                    x_hat = back(
                        _eps64(m64, xk, t + k, c) * (pos(t) - pos(t + k)) + y(xk, t + k), t
                    )
                    out[i, j] = ((path[t] - x_hat) ** 2).sum()
    return out


def _noise(seed, n, m, shape):
    return torch.randn((n, m, *shape), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["unet", "plain"])
@pytest.mark.parametrize("statistic", STATISTICS)
def test_each_statistic_equals_its_formula(setups, kind, statistic):
    model, scheduler, images = setups[kind]
    ts = [0, 20, 40] if statistic == "secmi" else [3, 20, 41]
    noise = _noise(7, N, len(ts), images.shape[1:]) if statistic == "loss" else None
    want = _reference(model, alphas_cumprod(scheduler), images, statistic, ts, noise=noise)
    assert bool((want > 1e-5).all())  # not 0: a relative comparison means something
    # the model in float64: the query computes in float64 and equals the formula
    query = DiffusionQuery(
        copy.deepcopy(model).double(), scheduler, statistic, timesteps=ts, seed=7
    )
    query.prepare()
    got = query(images.double())
    assert got.shape == (N, len(ts)) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # the model in float32 (as trained): off by its float32 forward passes only
    query = DiffusionQuery(model, scheduler, statistic, timesteps=ts, seed=7)
    query.prepare()
    got = query(images)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)


def test_pia_exponent_and_secmi_interval_are_used(setups):
    model, abar, images = setups["plain"]
    got = diffusion_statistic(model, images, abar, statistic="pia", timesteps=[30], p=2.0)
    torch.testing.assert_close(
        got.double(), _reference(model, abar, images, "pia", [30], p=2.0), rtol=1e-5, atol=0
    )
    got = DiffusionQuery(model, abar, "secmi", timesteps=[15, 30], interval=5)(images)
    want = _reference(model, abar, images, "secmi", [15, 30], k=5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def test_one_timestep_gives_one_score_per_image_and_several_one_column_each(setups):
    model, scheduler, images = setups["unet"]
    for statistic in ("pia", "secmi", "sima"):
        both = DiffusionQuery(model, scheduler, statistic, timesteps=[20, 40])(images)
        for j, t in enumerate((20, 40)):
            one = DiffusionQuery(model, scheduler, statistic, timesteps=t)(images)
            assert one.shape == (N,)
            torch.testing.assert_close(one, both[:, j], rtol=1e-5, atol=1e-6)
    assert DiffusionQuery(model, scheduler, "sima", timesteps=[20])(images).shape == (N, 1)
    one = DiffusionQuery(model, scheduler, "sima", timesteps=20)(images)
    for zero_d in (torch.tensor(20), np.array(20)):  # one timestep, as a 0-d array: (n,)
        got = DiffusionQuery(model, scheduler, "sima", timesteps=zero_d)(images)
        torch.testing.assert_close(got, one)


def test_a_bound_method_of_a_float64_module_scores_as_the_module_does(setups):
    """The model given as its forward (a bound method) is fed its own weights' dtype, as the
    module itself is."""
    _, abar, images = setups["plain"]
    plain64 = copy.deepcopy(setups["plain"][0]).double()
    for statistic in ("loss", "pia"):
        whole = DiffusionQuery(plain64, abar, statistic, timesteps=50)(images)
        bound = DiffusionQuery(plain64.forward, abar, statistic, timesteps=50)(images)
        torch.testing.assert_close(bound, whole, rtol=0, atol=0)


def test_the_loss_scores_the_same_draw_at_every_check(setups):
    model, scheduler, images = setups["unet"]
    query = DiffusionQuery(model, scheduler, "loss", timesteps=[10, 100], seed=3)
    checks = []
    for _ in range(2):
        query.prepare()
        checks.append((query(images), query(images)))  # two batches of one check
        query.release()
    assert torch.equal(checks[0][0], checks[1][0]) and torch.equal(checks[0][1], checks[1][1])
    assert not torch.equal(checks[0][0], checks[0][1])  # the second batch gets its own noise
    other = DiffusionQuery(model, scheduler, "loss", timesteps=[10, 100], seed=4)
    other.prepare()
    assert not torch.allclose(other(images), checks[0][0])


def test_the_query_leaves_mode_global_rng_and_scheduler_as_found(setups):
    model, scheduler, images = setups["unet"]
    model.train()
    abar = scheduler.alphas_cumprod.clone()
    try:
        rng = torch.get_rng_state()
        for statistic in STATISTICS:
            query = DiffusionQuery(model, scheduler, statistic, timesteps=[10, 20])
            query.prepare()
            query(images)
            query.release()
        assert model.training and all(m.training for m in model.modules())
        assert torch.equal(torch.get_rng_state(), rng)
        assert torch.equal(scheduler.alphas_cumprod, abar) and scheduler.timesteps[0] == 999
        assert all(p.grad is None for p in model.parameters())
    finally:
        model.eval()
    assert DiffusionQuery(model, scheduler, "loss").modules == (model,)


def test_timesteps_go_through_the_model_together_in_bounded_calls():
    model, abar, images = Denoiser(), _linear_abar(), torch.randn(N, 1, 8, 8)
    for statistic, ts, calls in [
        ("loss", [10, 20, 30], 1),
        ("sima", [10, 20, 30], 1),
        ("pia", [10, 20, 30], 2),
        ("secmi", [20, 40], 6),  # max(t)/k + 2, the inversion shared by both timesteps
    ]:
        assert model_calls(statistic, ts) == (calls if statistic == "secmi" else calls + 2)
        model.calls = 0
        noise = _noise(0, N, len(ts), (1, 8, 8))
        full = diffusion_statistic(
            model, images, abar, statistic=statistic, timesteps=ts, noise=noise
        )
        assert model.calls == calls, statistic
        model.calls = 0
        small = diffusion_statistic(
            model, images, abar, statistic=statistic, timesteps=ts, noise=noise, max_batch=2
        )
        # 2 images per call: ⌈rows / 2⌉ calls per pass
        per_pass = {"loss": [15], "sima": [15], "pia": [5, 15], "secmi": [5] * 6}[statistic]
        assert model.calls == sum(math.ceil(r / 2) for r in per_pass)
        torch.testing.assert_close(small, full, rtol=1e-5, atol=1e-6)


def test_conditional_keyword_arguments_reach_the_model():
    model = _conditional_unet().double()
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)
    torch.manual_seed(2)
    images = torch.rand(N, 1, 8, 8, dtype=torch.float64) * 2 - 1
    hidden = torch.randn(N, 3, 6, dtype=torch.float64)
    batch = {"pixel_values": images, "encoder_hidden_states": hidden}
    for statistic in ("pia", "secmi"):
        query = DiffusionQuery(model, scheduler, statistic, timesteps=[10, 20], max_batch=3)
        got = query(batch)  # 3 images per call: the rows' conditioning follows them
        cond = {"encoder_hidden_states": hidden}
        want = _reference(model, alphas_cumprod(scheduler), images, statistic, [10, 20], cond=cond)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
        other = query({"pixel_values": images, "encoder_hidden_states": hidden.flip(0)})
        assert not torch.allclose(other, got)
    transformed = DiffusionQuery(
        model,
        scheduler,
        "sima",
        timesteps=5,
        transform=lambda b: (b[0], {"encoder_hidden_states": b[1]}),
    )
    plain = DiffusionQuery(model, scheduler, "sima", timesteps=5)
    torch.testing.assert_close(
        transformed((images, hidden)), plain({"images": images, "encoder_hidden_states": hidden})
    )


def test_encode_maps_images_to_the_latents_scored(setups):
    model, scheduler, latents = setups["unet"]
    encoder = nn.Conv2d(3, 1, 2, stride=2)  # a 3×16×16 image -> a 1×8×8 latent
    torch.manual_seed(3)
    images = torch.randn(N, 3, 16, 16)
    with torch.no_grad():
        latents = encoder(images)
    query = DiffusionQuery(model, scheduler, "pia", timesteps=[20], encode=encoder)
    assert query.modules == (model, encoder)
    torch.testing.assert_close(
        query((images, torch.zeros(N))),
        DiffusionQuery(model, scheduler, "pia", timesteps=[20])(latents),
    )
    bound = DiffusionQuery(model, scheduler, "sima", encode=encoder.forward)
    assert bound.modules == (model, encoder)


def test_a_monitor_check_reports_each_statistic(setups):
    import privmon

    model, scheduler, images = setups["unet"]
    queries = [
        DiffusionQuery(model, scheduler, s, timesteps=t)
        for s, t in (("loss", 50), ("pia", [20, 40]), ("secmi", 20))
    ]
    monitor = privmon.PrivacyMonitor(
        queries, [images[:3]], [images[3:]], every_n_steps=1, strict=True
    )
    report = monitor.check(0)
    assert report is not None and set(report.queries) == {"loss", "pia", "secmi"}
    assert report.failures == {}


# --- bad input --------------------------------------------------------------------------------


def test_bad_input_is_an_error_naming_the_argument(setups):
    model, scheduler, images = setups["unet"]
    plain, abar, _ = setups["plain"]
    cases = [
        (lambda: DiffusionQuery(model, scheduler, "psi"), "statistic"),
        (
            lambda: DiffusionQuery(model, scheduler, "loss", timesteps=1000),
            r"timesteps.*\[0, 999\]",
        ),
        (lambda: DiffusionQuery(model, scheduler, "loss", timesteps=[5, -1]), "timesteps"),
        (lambda: DiffusionQuery(model, scheduler, "loss", timesteps=[]), "timesteps"),
        (lambda: DiffusionQuery(model, scheduler, "secmi", timesteps=25), "multiple of 10"),
        (lambda: DiffusionQuery(plain, abar, "secmi", timesteps=190), r"timesteps.*\[0, 189\]"),
        (lambda: DiffusionQuery(model, scheduler, "secmi", interval=0), "interval"),
        (lambda: DiffusionQuery(model, scheduler, "pia", p=0), "p must be"),
        (lambda: DiffusionQuery(model, scheduler, "pia", max_batch=0), "max_batch"),
        (lambda: DiffusionQuery(model, torch.ones(3, 3), "pia"), "scheduler"),
        (lambda: DiffusionQuery(model, torch.tensor([0.5, 0.9]), "pia", timesteps=1), "scheduler"),
        (lambda: DiffusionQuery(model, object(), "pia"), r"privmon\[diffusion\]"),
        (lambda: DiffusionQuery(42, scheduler, "pia"), "model must be callable"),
        (lambda: DiffusionQuery(model, scheduler, "pia", encode=3), "encode must be callable"),
        (lambda: DiffusionQuery(model, scheduler, "sima", timesteps=5)(images[0, 0, 0]), "images"),
        (lambda: DiffusionQuery(model, scheduler, "sima")(images.long()), "images"),
        (lambda: DiffusionQuery(model, scheduler, "sima")({"x": images}), "pixel_values"),
        (
            lambda: DiffusionQuery(model, scheduler, "sima")(
                {"images": images, "class_labels": torch.zeros(N + 1)}
            ),
            "class_labels",
        ),
        (lambda: DiffusionQuery(model, scheduler, "sima", encode=lambda x: 0)(images), "encode"),
        (
            lambda: DiffusionQuery(lambda x, t: x.mean(dim=1), scheduler, "sima")(images),
            "model returned shape",
        ),
        (
            lambda: DiffusionQuery(lambda x, t: torch.cat([x, x], 1), scheduler, "pia")(images),
            "model returned",
        ),
        (
            lambda: diffusion_statistic(
                model, images, scheduler.alphas_cumprod, statistic="loss", timesteps=3
            ),
            "noise=",
        ),
    ]
    not_callable = {"model must be callable", "encode must be callable"}  # check_callable's
    for make, match in cases:
        error = TypeError if match in not_callable else ValueError
        with pytest.raises(error, match=match):
            make()


def test_noise_prediction_reads_the_usual_outputs():
    x, t = torch.ones(2, 1, 2, 2), torch.zeros(2, dtype=torch.long)
    for wrap in (lambda e: e, lambda e: (e,), lambda e: {"sample": e}):
        got = noise_prediction(lambda x_, t_, wrap=wrap: wrap(2 * x_), x, t)
        assert torch.equal(got, 2 * x)
    wide = Denoiser().double()  # the input is cast to the model's dtype, the output back
    assert noise_prediction(wide, x, t).dtype == torch.float32


def test_without_diffusers_the_query_runs():
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "import torch\n"
        "from privmon.queries import DiffusionQuery\n"
        "abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100), 0)\n"
        "q = DiffusionQuery(lambda x, t: 0.1 * x, abar, 'pia', timesteps=[5, 9])\n"
        "print(tuple(q(torch.randn(4, 1, 8, 8)).shape))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert proc.stdout.strip() == "(4, 2)", proc.stderr
