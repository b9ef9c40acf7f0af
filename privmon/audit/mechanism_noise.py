"""The mechanism checks' noise tests (:class:`~privmon.audit.MechanismChecks`): what they read
of one noised step (the noise just added, on the entries whose dtype resolves it, and the
step's digest), and the check that tests it against N(0, σ²C²) and for repeats. Derivations:
docs, Theory page, *Mechanism checks*."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.linalg import vector_norm as norm

from privmon.audit import mechanism_evidence as evidence
from privmon.audit import opacus_adapter as adapter
from privmon.audit.mechanism import MechanismFinding
from privmon.audit.mechanism_check import MechanismCheck, StepContext
from privmon.audit.mechanism_math import resolved_sum

__all__ = ["Head", "NoiseCheck", "Reading", "fixed_tensor", "hashed", "read_noise"]

NOISE_VALUES = 32_768  # noise values read per step and tensor (two tensors a step)
DIGEST_VALUES = 64  # a step's digest: the first noise values of the fixed tensor
DIGEST_RESOLVED = 32  # ... of which at least so many resolved (else the step has no digest)
DIGEST_GRID = 16.0  # the digest rounds the noise to σ C / 16
DIGEST_BATCH = 64  # steps whose digests are hashed together (one vectorised rounding)


def fixed_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor read at every step, whose noise makes the digest: the first with
    DIGEST_VALUES entries on this rank (a DTensor's local shard), else the largest."""
    sizes = [adapter.local(p).numel() for p in tensors]
    first = next((i for i, n in enumerate(sizes) if n >= DIGEST_VALUES), None)
    return tensors[sizes.index(max(sizes)) if first is None else first]


Head = tuple[list[float], float]  # a digest not hashed yet: its noise values, the grid factor
Reading = tuple[float, int, "bytes | Head", int]  # Σ z², values, the digest, values not finite
Pair = tuple["torch.Tensor | None", "torch.Tensor | None"]  # a tensor's (grad, summed_grad)


def read_noise(pairs: Sequence[Pair], scale: float) -> Reading:
    """(Σ z², number of values, the step's digest — or its :data:`Head`, which :func:`hashed`
    hashes together with other steps' —, number of values left out as not finite) of
    the noise z = grad − summed_grad just added at std ``scale`` > 0 (σ C, or each shard's
    share of it), on up to NOISE_VALUES values of each tensor's (gradient, summed gradient)
    pair (the first makes the digest). Only finite entries whose
    summed gradient s the tensor's precision resolves
    (:func:`~privmon.audit.mechanism_math.resolved_sum`) count: where it is coarser, rounding
    s + noise may remove the noise from z (not from the rounded s + noise, a function of the
    mechanism's output); where s or z is NaN or infinite (a non-finite gradient reached the
    noise: the clipping check's finding) there is no noise to read. The digest hashes the first
    DIGEST_VALUES of the fixed tensor, rounded to σ C / DIGEST_GRID (the others inf), and needs
    DIGEST_RESOLVED of them. Few operations and one copy to the host: this runs at every
    step."""
    reads = _differences(pairs, scale)
    if not reads:
        return 0.0, 0, b"", 0
    # ‖z‖, min s and max s: NaN when a value is (a NaN norm: some z is not finite); s's extremes
    # by aminmax, ten times faster than its ∞-norm on CPU; then the digest's values. All exact
    # in the promoted dtype, read as Python floats in one copy.
    stats = torch.stack([x for z, s, _ in reads for x in (norm(z), *torch.aminmax(s))])
    figures = torch.cat([stats, reads[0][0][:DIGEST_VALUES]]).tolist()
    n, factor = 3 * len(reads), DIGEST_GRID / scale
    if all(
        math.isfinite(size) and max(-low, high) <= limit
        for size, low, high, (*_, limit) in zip(
            figures[0:n:3], figures[1:n:3], figures[2:n:3], reads, strict=True
        )
    ):  # every value finite and resolved: the digest is hashed later, with others (hashed)
        squares, values = sum(x * x for x in figures[0:n:3]), sum(z.numel() for z, *_ in reads)
        head = figures[n:]
        return squares, values, (head, factor) if len(head) >= DIGEST_RESOLVED else b"", 0
    # rare: sums too large for their precision, or values not finite: left out
    squares, values, nonfinite, marked = _resolved(reads, np.round(np.array(figures[n:]) * factor))
    if int(np.isfinite(marked).sum()) < DIGEST_RESOLVED:
        return squares, values, b"", nonfinite
    return squares, values, hashlib.blake2b(marked.tobytes(), digest_size=8).digest(), nonfinite


def hashed(readings: Sequence[bytes | Head]) -> bytes:
    """8 bytes per step, in order: a digest made is kept; a :data:`Head` is hashed, its noise
    values rounded to the grid (``np.round(values * factor)`` in float64: z is exact there),
    the heads of one length in one vectorised rounding."""
    made = [r if isinstance(r, bytes) else b"" for r in readings]
    heads = [(i, r) for i, r in enumerate(readings) if not isinstance(r, bytes)]
    for size in {len(values) for _, (values, _) in heads}:
        rows = [(i, values, f) for i, (values, f) in heads if len(values) == size]
        grid = np.round(np.array([v for _, v, _ in rows]) * np.array([[f] for *_, f in rows]))
        for (i, *_), row in zip(rows, grid, strict=True):
            made[i] = hashlib.blake2b(row.tobytes(), digest_size=8).digest()
    return b"".join(made)


def _differences(pairs: Sequence[Pair], scale: float) -> list[tuple[Any, Any, float]]:
    """Per pair with entries: (z = grad − summed_grad on up to NOISE_VALUES entries, in at least
    float32, where z = fl(s + n) − s is exact; those entries of s; the largest |s| the precision
    resolves); none when a pair lacks a tensor. Fewest operations: this runs at every step."""
    reads = []
    for grad, summed in pairs:
        if grad is None or summed is None:
            return []
        size = summed.numel()
        if size == 0:
            continue
        if grad.requires_grad or summed.requires_grad:  # no graph (and no no_grad, dearer)
            grad, summed = grad.detach(), summed.detach()
        sums, values = summed.reshape(-1), grad.reshape(-1)
        if size > NOISE_VALUES:
            sums, values = sums[:NOISE_VALUES], values[:NOISE_VALUES]
        wide = torch.promote_types(sums.dtype, torch.float32)
        z = (values if values.dtype == wide else values.to(wide)) - sums  # s promoted exactly
        info = torch.finfo(sums.dtype)
        reads.append((z, sums, resolved_sum(scale, info.eps, info.tiny)))
    return reads


def _resolved(
    reads: list[tuple[torch.Tensor, torch.Tensor, float]], head: np.ndarray
) -> tuple[float, int, int, np.ndarray]:
    """(Σ z², number of values, number not finite, the digest's values) over the finite
    entries whose sum s the precision resolves; the digest's others are inf."""
    finite = [z.isfinite() & s.isfinite() for z, s, _ in reads]
    keeps = [f & (s.abs() <= limit) for f, (_, s, limit) in zip(finite, reads, strict=True)]
    kept = [norm(torch.where(k, z, 0.0)) for k, (z, *_) in zip(keeps, reads, strict=True)]
    counts = [k.sum() for k in keeps] + [(~f).sum() for f in finite]
    stats = torch.stack([*kept, *counts]).double()
    host = torch.cat([stats, keeps[0][: len(head)].double()]).cpu().numpy()
    n = len(reads)
    squares, values = float(np.square(host[:n]).sum()), int(host[n : 2 * n].sum())
    marked = np.where(host[3 * n :] > 0, head, math.inf)
    return squares, values, int(host[2 * n : 3 * n].sum()), marked


class NoiseCheck(MechanismCheck):
    """Fresh N(0, σ²C²) noise at every step: the noise added against the σ the accountant read
    and the C the step clipped to (statistical, one-sided), and no step repeating another's (a
    digest per step). Under AdaClip, the gradient's noise against σ_g C (the part of σ its noisy
    count leaves) and the count's against its σ_u, the two p-values Bonferroni-combined.

    Examples:
        >>> from privmon.audit.mechanism_check import StepContext
        >>> from privmon.audit.mechanism_noise import NoiseCheck
        >>> [f.test for f in NoiseCheck().findings(StepContext(optimizer=None), accountant=None)]
        ['variance', 'repeat']
    """

    name = "noise"
    tests = evidence.kinds_of("noise")
    squares: float
    values: int
    steps: int
    scale: tuple[float, float]
    digests: bytearray
    nonfinite: int
    nonfinite_steps: int
    count_squares: float
    count_values: int
    reading: Reading | None
    unhashed: list[bytes | Head]
    clip_bound: float
    count_before: tuple[float, float] | None

    def __init__(self) -> None:
        super().__init__()
        self.add_state("squares", 0.0)  # Σ ‖z‖² / (σC)²
        self.add_state("values", 0)  # noise values tested
        self.add_state("steps", 0)  # steps they come from
        self.add_state("scale", (math.nan, math.nan))  # last (σ, C) of the test
        self.add_state("digests", bytearray())  # 8 bytes per step: the noise's digest
        self.add_state("nonfinite", 0)  # values left out: the noised gradient not finite
        self.add_state("nonfinite_steps", 0)  # the steps they come from
        self.add_state("count_squares", 0.0)  # AdaClip: Σ (count noise / σ_u)²
        self.add_state("count_values", 0)
        self.add_state("reading", None, persistent=False)  # what add_noise left for the step
        self.add_state("unhashed", [], persistent=False)  # the last steps' digests, to hash
        self.add_state("clip_bound", math.nan, persistent=False)  # the C the step clipped to
        self.add_state("count_before", None, persistent=False)  # AdaClip's count, σ_u

    def clipped(self, context: StepContext, *, rows: int, fresh: bool) -> None:
        """The bound the step clipped to (AdaClip moves it after the noise), and AdaClip's
        count of unclipped rows before its noise."""
        self.clip_bound = float(context.optimizer.max_grad_norm)
        self.count_before = adapter.noisy_count(context.optimizer)

    def noised(self, context: StepContext) -> None:
        """Read the noise just added (rank 0 only: Opacus adds it there; under FSDP every rank,
        on its shard): a fixed tensor (``fixed_tensor`` of the canary block and the model's)
        and one of the model's in turn (each one every len(params) steps)."""
        self.reading = None if context.rank and not context.sharded else _read(context)

    def private_step(self, context: StepContext) -> None:
        reading, self.reading = self.reading, None
        bound, self.clip_bound = self.clip_bound, math.nan
        # AdaClip's count as the step left it (what its next bound was computed from)
        before, after = self.count_before, adapter.noisy_count(context.optimizer)
        self.count_before = None
        if reading is not None and before is not None and after is not None and after[1] > 0:
            count = ((after[0] - before[0]) / after[1]) ** 2
            if math.isfinite(count):
                self.count_squares += count
                self.count_values += 1
        if reading is None:
            return
        opt = context.optimizer
        sigma = adapter.gradient_noise_multiplier(opt)
        bound = bound if math.isfinite(bound) else float(opt.max_grad_norm)
        squares, values, digest, nonfinite = reading
        self.unhashed.append(digest or context.steps.to_bytes(8, "little"))
        if len(self.unhashed) >= DIGEST_BATCH:
            self._hash()
        if nonfinite:
            self.nonfinite += nonfinite
            self.nonfinite_steps += 1
        if values and sigma * bound > 0:
            self.squares += squares / (sigma * bound * adapter.noise_share(opt)) ** 2
            self.values += values
            self.steps += 1
            self.scale = (sigma, bound)

    def _hash(self) -> None:
        """The steps' digests not hashed yet join ``digests`` (a few steps' together: fewer
        operations inside the step)."""
        if self.unhashed:
            self.digests += hashed(self.unhashed)
            self.unhashed = []

    def state_dict(self) -> dict[str, Any]:
        self._hash()
        return super().state_dict()

    def findings(self, context: StepContext, *, accountant: Any) -> list[MechanismFinding]:
        self._hash()
        rank = 0 if context.sharded else context.rank  # under FSDP each rank tests its own
        return [
            evidence.noise_variance(
                self.squares,
                self.values,
                self.steps,
                math.prod(self.scale),
                rank,
                (self.nonfinite, self.nonfinite_steps),
                count=(self.count_squares, self.count_values),
                shards=context.world if context.sharded else 0,
                share=adapter.noise_share(context.optimizer),
            ),
            evidence.noise_repeat(bytes(self.digests), rank),
        ]


def _read(context: StepContext) -> Reading:
    opt, block, params = context.optimizer, context.block, context.params
    scale = adapter.gradient_noise_multiplier(opt) * float(opt.max_grad_norm)
    if not params or scale <= 0:  # σ·C = 0 is accounted (ε = ∞): no noise to test
        return 0.0, 0, b"", 0
    fixed = fixed_tensor([block, *params] if block is not None else params)
    turn = params[context.steps % len(params)]
    pairs = [
        (adapter.local(p.grad), adapter.summed_grad(opt, p))
        for p in ((fixed,) if turn is fixed else (fixed, turn))
    ]
    return read_noise(pairs, scale * adapter.noise_share(opt))
