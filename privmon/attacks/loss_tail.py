"""LOSS TNR: a model-level estimate of LiRA's TPR at a low FPR from the loss tails alone.

Dodd, Krčo, Shilov and de Montjoye, "The Tail Tells All: Estimating Model-Level Membership
Inference Vulnerability Without Reference Models": loss distributions are heavy-tailed, and the
records at risk are those that training moved out of the high-loss tail. The members' tail
thins while the non-members' stays, so the true-negative rate of the plain loss attack there
(the share of non-members above a threshold that only a fraction α of the members exceed)
estimates the TPR at FPR α of LiRA, with no reference model trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from privmon._validation import as_scores, check_fprs

__all__ = ["LossTnr", "loss_tnr"]

DEFAULT_FPRS = (0.001, 0.01)
"""The FPRs :func:`loss_tnr` estimates LiRA's TPR at by default: 0.1 % and 1 %."""


@dataclass(frozen=True)
class LossTnr:
    """LOSS TNR estimates: ``estimate[i]`` estimates LiRA's TPR at FPR ``fpr[i]``; it is the
    share of non-member losses above ``threshold[i]``, the smallest member loss that at most a
    fraction ``fpr[i]`` of the members exceed (the loss attack's TNR at FNR <= ``fpr[i]``).
    An estimate, not a bound: no confidence level is attached. ``dropped``: non-finite losses
    left out (members and non-members together).

    Examples:
        >>> from privmon.attacks import LossTnr
        >>> LossTnr(fpr=(0.01,), estimate=(0.2,), threshold=(3.1,), n_members=100,
        ...         n_nonmembers=100, dropped=0).estimate
        (0.2,)
    """

    fpr: tuple[float, ...]
    estimate: tuple[float, ...]
    threshold: tuple[float, ...]
    n_members: int
    n_nonmembers: int
    dropped: int


def _losses(values: Any, *, name: str, device: torch.device | None) -> tuple[torch.Tensor, int]:
    """One finite float64 loss per record (n,), and how many were not finite."""
    t, dropped = as_scores(values, name=name, device=device)
    if t.shape[1] != 1:
        raise ValueError(f"{name} must be one loss per record, shape (n,), got (n, {t.shape[1]})")
    return t[:, 0], dropped


def loss_tnr(member_losses: Any, nonmember_losses: Any, *, fpr: Any = DEFAULT_FPRS) -> LossTnr:
    """LOSS TNR (Dodd et al., "The Tail Tells All"): estimates of LiRA's TPR at each FPR α
    from the trained model's losses on its members and on held-out records.

    For each α the threshold τ_α is the smallest member loss with at most ⌊α · n_members⌋
    member losses strictly above it (the loss attack "member when loss <= τ" at FNR <= α), and
    the estimate is the share of non-member losses strictly above τ_α.

    Args:
        member_losses: (n,) per-record losses of the training records (numpy, torch on any
            device); NaN / inf dropped and counted.
        nonmember_losses: (m,) per-record losses of held-out records, likewise.
        fpr: the FPR (or FPRs) in (0, 1) to estimate LiRA's TPR at; default 0.1 % and 1 %.

    Returns:
        :class:`LossTnr`.

    Raises:
        ValueError naming the argument: arrays not of one loss per record, empty or with no
            finite loss, an ``fpr`` outside (0, 1).

    Examples:
        >>> import numpy as np
        >>> from privmon.attacks import loss_tnr
        >>> members = np.arange(100) / 100  # losses 0.00 .. 0.99
        >>> nonmembers = np.arange(100) / 50  # losses 0.00 .. 1.98, a heavier tail
        >>> est = loss_tnr(members, nonmembers, fpr=0.01)
        >>> est.threshold, est.estimate  # one member above 0.98; 50 non-members above it
        ((0.98,), (0.5,))
    """
    alphas = check_fprs(fpr)
    members, dropped_m = _losses(member_losses, name="member_losses", device=None)
    device = members.device
    nonmembers, dropped_h = _losses(nonmember_losses, name="nonmember_losses", device=device)
    ordered = torch.sort(members).values
    n = ordered.numel()
    above = [math.floor(a * n + 1e-9) for a in alphas]  # members allowed above the threshold
    index = torch.tensor([n - 1 - j for j in above], device=ordered.device)
    thresholds = ordered[index]
    share = (nonmembers[:, None] > thresholds[None, :]).to(torch.float64).mean(dim=0)
    return LossTnr(
        fpr=tuple(alphas),
        estimate=tuple(share.tolist()),
        threshold=tuple(thresholds.tolist()),
        n_members=n,
        n_nonmembers=nonmembers.numel(),
        dropped=dropped_m + dropped_h,
    )
