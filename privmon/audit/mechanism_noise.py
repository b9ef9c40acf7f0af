"""What the mechanism checks' noise test reads of one noised step
(:class:`~privmon.audit.MechanismChecks`): the noise just added, on the entries whose dtype
resolves it, and the step's digest. Derivations: docs, Theory page, *Mechanism checks*."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch

from privmon.audit.mechanism_math import resolved_sum

__all__ = ["fixed_tensor", "read_noise"]

NOISE_VALUES = 32_768  # noise values read per step and tensor (two tensors a step)
DIGEST_VALUES = 64  # a step's digest: the first noise values of the fixed tensor
DIGEST_RESOLVED = 32  # ... of which at least so many resolved (else the step has no digest)
DIGEST_GRID = 16.0  # the digest rounds the noise to σ C / 16


def fixed_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor read at every step, whose noise makes the digest: the first with
    DIGEST_VALUES entries, else the largest."""
    return next((p for p in tensors if p.numel() >= DIGEST_VALUES), max(tensors, key=torch.numel))


def read_noise(tensors: Sequence[torch.Tensor], scale: float) -> tuple[float, int, bytes]:
    """(Σ z², number of values, the step's digest) of the noise z = grad − summed_grad just
    added at std ``scale`` = σ C > 0, on up to NOISE_VALUES values of each tensor (the first
    makes the digest). Only entries whose summed gradient s the tensor's precision resolves
    (:func:`~privmon.audit.mechanism_math.resolved_sum`) count: where it is coarser, rounding
    s + noise may remove the noise from z (not from the rounded s + noise, a function of the
    mechanism's output). The digest hashes the first DIGEST_VALUES of the fixed tensor, rounded
    to σ C / DIGEST_GRID (the unresolved ones inf), and needs DIGEST_RESOLVED resolved values.
    Few operations and one copy to the host: this runs at every step."""
    reads = []  # (z, s, the largest |s| the precision resolves)
    for p in tensors:
        if p.numel() == 0:
            continue
        grad, summed = p.grad, getattr(p, "summed_grad", None)
        if grad is None or summed is None:
            return 0.0, 0, b""
        sums = summed.detach().reshape(-1)[:NOISE_VALUES]
        wide = torch.promote_types(sums.dtype, torch.float32)  # z = fl(s + n) − s exactly
        z = grad.detach().reshape(-1)[:NOISE_VALUES].to(wide) - sums.to(wide)
        info = torch.finfo(sums.dtype)
        reads.append((z, sums, resolved_sum(scale, info.eps, info.tiny)))
    if not reads:
        return 0.0, 0, b""
    head = torch.round(reads[0][0][:DIGEST_VALUES].double() * (DIGEST_GRID / scale))
    stats = [x for z, s, _ in reads for x in (torch.linalg.vector_norm(z), *torch.aminmax(s))]
    host = torch.cat([torch.stack(stats).double(), head]).cpu().numpy()
    n = 3 * len(reads)
    norms, lows, highs, head_values = host[0:n:3], host[1:n:3], host[2:n:3], host[n:]
    peaks = np.maximum(-lows, highs)
    if all(peak <= limit for peak, (*_, limit) in zip(peaks, reads, strict=True)):
        squares, values = float(np.square(norms).sum()), sum(len(z) for z, *_ in reads)
    else:  # rare: some sums too large for their precision to resolve the noise: left out
        squares, values, head_values = _resolved(reads, head)
    if int(np.isfinite(head_values).sum()) < DIGEST_RESOLVED:
        return squares, values, b""
    return squares, values, hashlib.blake2b(head_values.tobytes(), digest_size=8).digest()


def _resolved(
    reads: list[tuple[torch.Tensor, torch.Tensor, float]], head: torch.Tensor
) -> tuple[float, int, np.ndarray]:
    """(Σ z², number of values, the digest's values) over the entries whose sum s the precision
    resolves; the digest's others are inf."""
    keeps = [s.abs() <= limit for _, s, limit in reads]
    kept = [
        torch.linalg.vector_norm(torch.where(k, z, 0.0))
        for k, (z, *_) in zip(keeps, reads, strict=True)
    ]
    marked = torch.where(keeps[0][: len(head)], head, math.inf)
    counts = [k.sum() for k in keeps]
    host = torch.cat([torch.stack([*kept, *counts]).double(), marked]).cpu().numpy()
    n = len(reads)
    return float(np.square(host[:n]).sum()), int(host[n : 2 * n].sum()), host[2 * n :]
