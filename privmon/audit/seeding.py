"""Seeding shared by the audits: independent numpy streams keyed by (seed, tag, ...), each
model's training seed from (seed, k), and the global RNGs seeded and restored around training.

Model k's seed and mask depend only on (seed, k): never on the order models are trained in, the
process, or the world size."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = [
    "TAG_DATA",
    "TAG_FOLDS",
    "TAG_HALVES",
    "TAG_MASK",
    "TAG_TRAIN",
    "global_rngs_restored",
    "seed_global_rngs",
    "seeded_global_rng",
    "stream",
    "training_seeds",
]

# SeedSequence spawn keys of the independent streams (the same in the specific and the average
# audits, so both run with one seed share their mask and their training seeds).
TAG_MASK, TAG_TRAIN, TAG_DATA, TAG_HALVES, TAG_FOLDS = 0, 1, 2, 3, 4


def stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def training_seeds(seed: int, n_models: int) -> np.ndarray:
    """Training seed of model k, derived from (seed, k): a 31-bit integer, valid everywhere."""
    return np.array(
        [
            int(np.random.SeedSequence(seed, spawn_key=(TAG_TRAIN, k)).generate_state(1)[0] >> 1)
            for k in range(n_models)
        ],
        dtype=np.int64,
    )


@contextmanager
def global_rngs_restored() -> Iterator[None]:
    """Restore python / numpy / torch (CPU, and CUDA when available) global RNGs on exit."""
    py_state = random.getstate()
    np_state = np.random.get_state()  # noqa: NPY002 - the legacy global is what we guard
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)  # noqa: NPY002
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def seed_global_rngs(seed: int) -> None:
    """Seed the global RNGs :func:`global_rngs_restored` guards with ``seed``."""
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002
    # not torch.manual_seed: it also queues lazy seeds for MPS / XPU / MTIA, 0.2 ms a call,
    # on generators this module does not restore
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@contextmanager
def seeded_global_rng(seed: int) -> Iterator[None]:
    """Seed python / numpy / torch (CPU and CUDA) global RNGs with ``seed``, restore on exit."""
    with global_rngs_restored():
        seed_global_rngs(seed)
        yield
