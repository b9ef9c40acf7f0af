"""The scores of one check moved to rank 0 in one tensor collective: each rank's scores, every
query and side in the agreed order, as their bytes (a uint8 view: bit exact for any dtype),
joined and padded to the longest rank's, gathered on rank 0 and rebuilt there from the agreed
layouts and rows (:class:`~privmon.callbacks.distributed.Agreement`), in rank order."""

from __future__ import annotations

import math

import torch

from privmon._process_group import collective_device, rank_and_world
from privmon.callbacks.collection import Scores
from privmon.callbacks.distributed import Agreement

__all__ = ["gather_scores"]


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _nbytes(agreed: Agreement, rank: int) -> int:
    """The bytes of ``rank``'s scores, every query and side."""
    return sum(
        agreed.rows[name][side][rank] * math.prod(trailing) * _itemsize(dtype)
        for name, layouts in agreed.layouts.items()
        for side, (dtype, trailing) in enumerate(layouts)
    )


def _packed(scores: Scores, agreed: Agreement, *, size: int) -> torch.Tensor:
    """This rank's scores as ``size`` bytes on the collective device (zeros after them)."""
    device = collective_device()
    parts = [
        t.contiguous().reshape(-1).view(torch.uint8).to(device)
        for name in agreed.layouts
        for t in scores[name]
        if t.shape[0] > 0
    ]
    used = sum(p.numel() for p in parts)
    return torch.cat([*parts, torch.zeros(size - used, dtype=torch.uint8, device=device)])


def _unpacked(buffers: list[torch.Tensor], agreed: Agreement, *, like: Scores) -> Scores:
    """Every rank's bytes (``buffers``, in rank order) as each query's scores, the ranks' rows
    joined in rank order, on the device of this rank's own (``like``)."""
    pieces: dict[str, list[list[torch.Tensor]]] = {name: [[], []] for name in agreed.layouts}
    for rank, buffer in enumerate(buffers):
        offset = 0
        for name, layouts in agreed.layouts.items():
            for side, (dtype, trailing) in enumerate(layouts):
                rows = agreed.rows[name][side][rank]
                size = rows * math.prod(trailing) * _itemsize(dtype)
                chunk = buffer[offset : offset + size].clone()  # aligned for the view
                pieces[name][side].append(
                    chunk.view(getattr(torch, dtype)).reshape(rows, *trailing)
                )
                offset += size
    return {
        name: (
            torch.cat(sides[0]).to(like[name][0].device),
            torch.cat(sides[1]).to(like[name][1].device),
        )
        for name, sides in pieces.items()
    }


def gather_scores(scores: Scores, agreed: Agreement) -> Scores | None:
    """Every rank's rows of each query in ``agreed.layouts``, concatenated in rank order, on
    rank 0 (None on the others): one ``gather`` of each rank's bytes. Every rank must call it
    (with nothing to exchange, none does and rank 0 gets no scores)."""
    if not agreed.layouts:
        return {} if rank_and_world()[0] == 0 else None
    rank, world = rank_and_world()
    size = max(1, *(_nbytes(agreed, r) for r in range(world)))
    mine = _packed(scores, agreed, size=size)
    buffers = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
    torch.distributed.gather(mine, gather_list=buffers, dst=0)
    if buffers is None:
        return None
    return _unpacked(buffers, agreed, like=scores)
