"""The noise check's step digests: hashed a batch of steps at a time, each the blake2b of the
step's first noise values rounded to σ C / 16 in float64, in step order — the same bytes as
hashing each step at once; and a state saved between two batches carries every step's."""

import hashlib
from types import SimpleNamespace

import numpy as np
import torch

from privmon.audit import mechanism_noise as noise
from privmon.audit.mechanism_check import StepContext


def _one(values: list[float], factor: float) -> bytes:
    grid = np.round(np.asarray(values, dtype=np.float64) * factor)
    return hashlib.blake2b(grid.tobytes(), digest_size=8).digest()


def test_hashing_steps_together_gives_each_steps_own_digest_in_order():
    rng = np.random.default_rng(0)
    readings: list = []
    for i in range(40):
        size = (64, 40)[i % 7 == 3]  # two lengths, hashed in groups
        values = (rng.standard_normal(size) * 0.7).astype(np.float32).tolist()
        readings.append((values, float(rng.uniform(1, 40))))
        if i % 5 == 0:
            readings.append(i.to_bytes(8, "little"))  # a digest made at its step, kept as it is
    expected = b"".join(r if isinstance(r, bytes) else _one(*r) for r in readings)
    assert noise.hashed(readings) == expected
    assert noise.hashed([]) == b""
    halves = noise.hashed(readings[:17]) + noise.hashed(readings[17:])
    assert halves == expected


def test_a_reading_rounds_the_noise_to_the_grid_and_negative_zero_stays_apart():
    z = torch.tensor([0.01, -0.01, 1.0, -2.5] * 16)  # rounds to 0, -0, 16, -40 at factor 16
    summed = torch.zeros(64)
    squares, values, head, nonfinite = noise.read_noise([(summed + z, summed)], 1.0)
    assert (values, nonfinite) == (64, 0)
    assert squares == float(torch.linalg.vector_norm(z)) ** 2
    assert noise.hashed([head]) == _one(z.tolist(), 16.0)
    values, factor = head
    positive = [abs(v) if abs(v) < 0.02 else v for v in values]  # -0 on the grid made +0
    assert noise.hashed([(positive, factor)]) != noise.hashed([head])


def test_the_state_carries_the_steps_not_hashed_yet():
    check = noise.NoiseCheck()
    optimizer = SimpleNamespace(noise_multiplier=1.0, max_grad_norm=1.0)  # σ C = 1
    context = StepContext(optimizer=optimizer)
    rng = np.random.default_rng(1)
    readings = [(rng.standard_normal(64).tolist(), 16.0) for _ in range(noise.DIGEST_BATCH + 5)]
    for reading in readings:
        check.reading = (64.0, 64, reading, 0)  # what noised() leaves for the step
        context.steps += 1
        check.private_step(context)
    assert len(check.digests) == 8 * noise.DIGEST_BATCH  # one batch hashed, 5 steps not yet
    state = check.state_dict()
    assert bytes(state["digests"].numpy()) == noise.hashed(readings)
    resumed = noise.NoiseCheck()
    resumed.load_state_dict(state)
    variance, repeat = resumed.findings(context, accountant=None)
    assert repeat.evidence == f"noise: no step repeats another's noise ({len(readings)} steps)"
    assert variance == check.findings(context, accountant=None)[0]
