"""torch.distributed glue for the monitor: every rank audits its shard, the scores are gathered
so every rank computes the same figures as one process holding all audit records would, only
rank 0 writes, and ranks agree on failures and on stopping."""

from __future__ import annotations

import torch

__all__ = ["any_rank", "gather_rows", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """(rank, world size), or (0, 1) outside an initialised process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device() -> torch.device:
    """Where collectives run: CUDA for NCCL, the CPU otherwise (gloo)."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any rank (a MAX all-reduce)."""
    t = torch.tensor([1 if flag else 0], device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``x``, concatenated in rank order (shards may differ in length)."""
    dist = torch.distributed
    world = dist.get_world_size()
    dev = _device()
    local = x.detach().to(dev)
    n = torch.tensor([local.shape[0]], device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = int(max(int(s.item()) for s in sizes))
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=dev)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)]).to(x.device)
