"""Cross-fitting folds. Record ``i`` of a class (counted from the first update) goes to fold
``hash(i) mod folds`` (a multiplicative hash, so sorted streams are still spread evenly). The fold
depends only on the record's position, never on batch sizes or on an RNG, so a stream and the same
records passed at once give identical counts."""

from __future__ import annotations

import functools

import torch

__all__ = ["CERTIFY_FOLDS", "HIGH_DIM_CERTIFY_FOLDS", "certify_folds", "fold_of", "record_groups"]

_HASH = 0x9E3779B1  # Knuth's multiplicative hash constant (2^32 / golden ratio)
# The certificates of a 1-2-D estimate, by the folds each one certifies (its rule learns on the
# others); ``lower`` is the larger, each certified at δ / 2. A rule learned on one fold of four
# certifies on three, which wins on most leaks (benchmarks/power.py); one learned on two folds
# finds a sharp leak from few members that the first blurs (examples/dp_classifier.py's losses
# of 100 members).
CERTIFY_FOLDS: tuple[tuple[int, ...], ...] = ((0, 1, 2), (0, 1))
# Above 2-D the same two, the one learned on two folds first (the first is what the detectable
# advantage models): a logistic rule learned on one fold of four certified half as much (a
# mean lower bound of 0.07 against 0.15 over 6 seeds of benchmarks/learned.py's "shift 64" at
# 500 + 500 records, δ = 0.003), while a summary's threshold rule learns from one fold and
# certifies on three.
HIGH_DIM_CERTIFY_FOLDS: tuple[tuple[int, ...], ...] = ((0, 1), (0, 1, 2))


def certify_folds(dim: int) -> tuple[tuple[int, ...], ...]:
    """The certificates of an estimate of ``dim``-dimensional scores, by the folds each reads."""
    return CERTIFY_FOLDS if dim <= 2 else HIGH_DIM_CERTIFY_FOLDS


def fold_of(index: torch.Tensor, folds: int) -> torch.Tensor:
    """Fold of each running record index (int64 tensor)."""
    return ((index * _HASH) % (1 << 32) >> 16) % folds


_CACHED_ROWS = 1 << 16


def record_groups(start0: int, n0: int, start1: int, n1: int, folds: int, device: torch.device):
    """(class · folds + fold) and class of each row of a batch of ``n0`` members (running indices
    from ``start0``) then ``n1`` non-members (from ``start1``). A monitor bins the same record
    positions at every check, so small batches' groups are cached (read-only tensors)."""
    if n0 + n1 <= _CACHED_ROWS:
        return _cached_groups(start0, n0, start1, n1, folds, device)
    return _make_groups(start0, n0, start1, n1, folds, device)


def _make_groups(start0: int, n0: int, start1: int, n1: int, folds: int, device: torch.device):
    index = torch.cat(
        [
            torch.arange(start0, start0 + n0, device=device),
            torch.arange(start1, start1 + n1, device=device),
        ]
    )
    cls = torch.cat(
        [
            torch.zeros(n0, dtype=torch.int64, device=device),
            torch.ones(n1, dtype=torch.int64, device=device),
        ]
    )
    return fold_of(index, folds) + cls * folds, cls


_cached_groups = functools.lru_cache(maxsize=8)(_make_groups)
