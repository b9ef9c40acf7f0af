"""The default torch.distributed process group as the monitor and the audits see it: this
process's rank and the world size, an exchange of one picklable object per rank, and one object
sent from rank 0 to every rank. Outside an initialised group everything behaves as one process
(rank 0 of 1)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

__all__ = ["collective_device", "every_rank", "from_rank_0", "rank_and_world"]

T = TypeVar("T")


def rank_and_world(distributed: bool = True) -> tuple[int, int]:
    """(rank, world size) of the default process group when ``distributed`` and one is
    initialised, else (0, 1)."""
    dist = torch.distributed
    if distributed and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def every_rank(obj: T, world: int) -> list[T]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` when ``world`` is 1). Under
    NCCL the objects travel through the current CUDA device (``torch.cuda.set_device``)."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def from_rank_0(obj: T, world: int) -> T:
    """Rank 0's picklable ``obj`` on every rank (what the others pass is ignored; ``obj``
    itself when ``world`` is 1): one broadcast. Under NCCL through the current CUDA device."""
    if world == 1:
        return obj
    box: list[Any] = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def collective_device() -> torch.device:
    """Where tensor collectives of the default group run: CUDA for NCCL, the CPU otherwise."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
