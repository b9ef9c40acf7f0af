"""Whether tensors were written in place since a point, read through public torch API.

torch counts every in-place write to a tensor (optimizer steps, ``add_``, ``copy_``) in a version
counter, and has no public read of it. Its public face is autograd's in-place correctness check
(*Autograd mechanics*, "In-place correctness checks"): a tensor saved for backward remembers its
version, and reading ``saved_tensors`` raises once the tensor was written after it was saved.
:class:`InPlaceWrites` saves the tensors in a graph of one node that is never run backward and
reads them back: no copy, and a write through ``.data`` (which bypasses the counter) is not seen,
as with the counter itself. An inference tensor cannot be saved for backward, nor written
outside inference mode, and is passed by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["InPlaceWrites"]


class _Saved(torch.autograd.Function):
    """A node that saves ``tensors`` for a backward pass it never gets."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> None:  # never run
        raise RuntimeError("privmon's write witness is not differentiable")


_ANCHOR = torch.zeros((), requires_grad=True)  # the node's one input that needs a gradient


class InPlaceWrites:
    """Whether any of ``tensors`` has been written in place since this object was made.

    Examples:
        >>> import torch
        >>> from privmon._inplace_writes import InPlaceWrites
        >>> w = torch.zeros(3)
        >>> seen = InPlaceWrites([w])
        >>> seen.any()
        False
        >>> _ = w.add_(1)
        >>> seen.any()
        True
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        kept = [t for t in tensors if not t.is_inference()]
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            self._node = _Saved.apply(_ANCHOR, *kept).grad_fn  # the modes' switches cost more
        else:
            with torch.inference_mode(False), torch.enable_grad():
                self._node = _Saved.apply(_ANCHOR, *kept).grad_fn

    def any(self) -> bool:
        """True once one of the tensors was written in place."""
        try:
            _ = self._node.saved_tensors
        except RuntimeError:  # "… has been modified by an inplace operation"
            return True
        return False
