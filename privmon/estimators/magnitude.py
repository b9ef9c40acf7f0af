"""Scores of extreme magnitude brought to a safe one before any estimator reads them.

Squares, covariances and determinants of scores near 1e154 overflow, and of scores near
1e-154 underflow. A column whose largest magnitude lies outside [2^-64, 2^64] is multiplied by
the power of two that brings it into [1, 2), which is exact in floating point (no digit of a
score changes) and changes no figure: the 1-D rules read ranks; the grids, bandwidths and the
learned rule's standardisation follow each column's spread; its summaries read the scores with
the scaling divided out. Every other column, so every ordinary input, is left as it is and its
figures stay bit-identical.
"""

from __future__ import annotations

import torch

__all__ = ["SAFE_EXPONENT", "magnitude_scale"]

# columns whose largest |score| lies in [2^-SAFE_EXPONENT, 2^SAFE_EXPONENT] are left as they are:
# their squares summed over millions of records, and 2-D determinants of their covariances,
# stay far from float64's over- and underflow (2^±1022)
SAFE_EXPONENT = 64


def magnitude_scale(x: torch.Tensor) -> torch.Tensor | None:
    """Per-column powers of two (d,) bringing each column of finite scores x (n, d) whose
    largest magnitude lies outside [2^-64, 2^64] into [1, 2) (a column of subnormals as far
    as float64 allows); 1 for every other column and for columns of zeros. None when no column
    needs it, the usual case."""
    if x.numel() == 0:
        return None
    largest = x.abs().amax(dim=0)
    outside = (largest > 0) & ((largest > 2.0**SAFE_EXPONENT) | (largest < 2.0**-SAFE_EXPONENT))
    if not bool(outside.any()):
        return None
    _, exponent = torch.frexp(largest)  # largest = mantissa · 2^exponent, mantissa in [0.5, 1)
    # 2^1023 is the largest finite power of two: columns of subnormals land in [2^-51, 2)
    shift = (1 - exponent).clamp_max(1023)
    one = torch.ones_like(largest)
    return torch.where(outside, torch.ldexp(one, shift), one)
