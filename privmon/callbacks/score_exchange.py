"""The scores of one check moved to rank 0 in one tensor collective. Each rank packs its scores,
before the check's headers are exchanged, as their bytes (a uint8 view of every query's sides,
in its own order: bit exact for any dtype) on the collective device — so that a rank that
cannot pack them says so in its header, and none allocates anything before the collective
but rank 0, which receives — then one ``all_to_all_single`` sends each rank's bytes to rank 0
alone, where each query's scores are rebuilt from the agreed layouts and rows
(:class:`~privmon.callbacks.distributed.Agreement`), the ranks' rows in rank order."""

from __future__ import annotations

import torch

from privmon._process_group import collective_device, rank_and_world
from privmon.callbacks.collection import Scores
from privmon.callbacks.distributed import Agreement

__all__ = ["Packed", "gather_scores", "packed"]

Packed = tuple[torch.Tensor, dict[str, tuple[int, int]]]
"""A rank's scores as bytes, and per query the bytes of each side, in the order packed."""


def packed(scores: Scores, extra: torch.Tensor | None = None) -> Packed:
    """``scores`` as one uint8 tensor on the collective device, and each side's bytes;
    ``extra`` (uint8, the loss traces' bytes) after them."""
    device = collective_device()
    parts = {
        name: [t.contiguous().reshape(-1).view(torch.uint8).to(device) for t in sides]
        for name, sides in scores.items()
    }
    flat = [p for sides in parts.values() for p in sides]
    flat += [] if extra is None else [extra.to(device)]
    mine = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    return mine, {name: (m.numel(), n.numel()) for name, (m, n) in parts.items()}


def _rebuilt(rank: int, buffer: torch.Tensor, agreed: Agreement) -> dict[str, list[torch.Tensor]]:
    """``rank``'s bytes as its rows of each agreed query, per side (what it sent of the queries
    left out skipped)."""
    out, offset = {}, 0
    for name, sizes in agreed.sent[rank].items():
        if name in agreed.layouts:
            out[name] = [
                buffer[start : start + size].clone().view(getattr(torch, dtype))  # aligned
                .reshape(agreed.rows[name][side][rank], *trailing)
                for side, (start, size, (dtype, trailing)) in enumerate(
                    zip((offset, offset + sizes[0]), sizes, agreed.layouts[name], strict=True)
                )
            ]  # fmt: skip
        offset += sum(sizes)
    return out


def gather_scores(
    mine: torch.Tensor, agreed: Agreement, *, like: Scores
) -> tuple[Scores | None, list[torch.Tensor], Exception | None]:
    """Every rank's rows of each query in ``agreed.layouts``, concatenated in rank order, on
    rank 0, on the devices of its own scores (``like``), and each rank's loss-trace bytes
    (:attr:`~privmon.callbacks.distributed.Agreement.traces`, on the CPU); None and no bytes
    on the others. ``mine``: this rank's :func:`packed` bytes. One ``all_to_all_single``,
    each rank to rank 0 only; every rank calls it (with nothing to exchange none does, and
    rank 0 gets no scores). Rank 0's failure to rebuild the scores after the collective is
    returned, not raised: the other ranks are already on their way to its outcome."""
    rank, world = rank_and_world()
    if not agreed.layouts and not any(agreed.traces):
        return ({} if rank == 0 else None), [], None
    extras = [0 if t is None else t[3] for t in agreed.traces] or [0] * world
    totals = [sum(map(sum, sent.values())) + e for sent, e in zip(agreed.sent, extras, strict=True)]
    into = totals if rank == 0 else [0] * world
    received = torch.empty(sum(into), dtype=torch.uint8, device=mine.device)
    torch.distributed.all_to_all_single(
        received,
        mine,
        output_split_sizes=into,
        input_split_sizes=[totals[rank]] + [0] * (world - 1),
    )
    if rank != 0:
        return None, [], None
    try:
        buffers = received.split(totals)
        ranks = [_rebuilt(r, buffer, agreed) for r, buffer in enumerate(buffers)]
        traces = [b[b.numel() - e :].to("cpu") for b, e in zip(buffers, extras, strict=True)]
        return (
            {
                name: (
                    torch.cat([r[name][0] for r in ranks]).to(like[name][0].device),
                    torch.cat([r[name][1] for r in ranks]).to(like[name][1].device),
                )
                for name in agreed.layouts
            },
            traces,
            None,
        )
    except Exception as err:
        return None, [], err
