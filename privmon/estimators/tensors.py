"""Small tensors made cheaply: a check runs hundreds of small operations, and building a
tensor of a few numbers through numpy is several times cheaper than ``torch.tensor`` on a list.
A leaf: it imports nothing of privmon."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["on_device", "small_tensor"]


def small_tensor(
    values: Sequence[float] | Sequence[Sequence[float]], dtype: type, device: torch.device
) -> torch.Tensor:
    """A tensor of a few Python numbers (numpy ``dtype``) on ``device``: through numpy, several
    times cheaper than torch.tensor on a list (checks run hundreds of small operations)."""
    out = torch.from_numpy(np.asarray(values, dtype=dtype))
    return out if torch.device(device).type == "cpu" else out.to(device)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on ``device`` (without an operation when it is there already)."""
    return t if t.device == device else t.to(device)
