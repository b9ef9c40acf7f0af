"""Spawned torch.distributed ranks for the multi-process tests: each worker runs on its own
process, and the test fails, never hangs, when the ranks outlive :data:`DEADLINE_S` (a rank
stuck in a collective gives up sooner, at its process group's timeout)."""

from __future__ import annotations

import contextlib
import pickle
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 240  # generous for 2 loaded cores


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, tmp, world=2):
    """Run ``worker(rank, world, port, tmp)`` on ``world`` ranks; fail, never hang, when they
    outlive DEADLINE_S."""
    ctx = mp.start_processes(
        worker, args=(world, free_port(), str(tmp)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks were still running after {DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def spawned_results(worker, tmp, world=2):
    """:func:`spawn`, then what each rank left in ``tmp`` as ``rank{r}.pkl``, in rank order."""
    spawn(worker, tmp, world)
    return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(world)]


@contextlib.contextmanager
def rank_results(rank: int, tmp: str) -> Iterator[dict]:
    """A dict a worker fills: whatever the block raises, it reaches :func:`spawned_results`
    (``rank{rank}.pkl`` in ``tmp``) as it stands, and the process group is destroyed after."""
    out: dict = {}
    try:
        yield out
    finally:
        with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
        dist.destroy_process_group()
