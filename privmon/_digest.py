"""Digests that seal what privmon saves (a checkpoint folder's files, the saved states of the
monitor and of the canaries): SHA-256 over every key, string, number and tensor (dtype, shape
and bytes), so that a changed byte anywhere is seen on loading, whatever the unpickler let
through."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["DIGEST_KEY", "check_sealed", "content_digest", "digest", "sealed"]

DIGEST_KEY = "digest"
"""The key under which a sealed record holds its digest (:func:`sealed`)."""


def digest(*arrays: Any) -> str:
    """SHA-256 (hex) over the dtype, shape and bytes of each array / tensor (None counts as
    itself): equal exactly when the arrays are equal element by element, on any device.

    Examples:
        >>> import torch
        >>> from privmon._digest import digest
        >>> digest(torch.zeros(3)) == digest(torch.zeros(3)), digest(torch.zeros(3)) == digest(
        ...     torch.zeros(3, dtype=torch.float64))
        (True, False)
    """
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"None;")
            continue
        t = a.detach() if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
        t = t.to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():  # an empty tensor may have any strides, which view() refuses
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def content_digest(record: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of everything ``record`` holds but its own :data:`DIGEST_KEY` entry: every
    key, string and number (type and repr), every container's entries, and every tensor's
    dtype, shape and bytes (:func:`digest`); a nested record's digest counts as its content.

    Examples:
        >>> import torch
        >>> from privmon._digest import content_digest
        >>> state = {"steps": 3, "values": torch.tensor([1.0, 2.0])}
        >>> content_digest(state) == content_digest({**state, "digest": "anything"})
        True
        >>> content_digest(state) == content_digest({**state, "steps": 3.0})
        False
    """
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            h.update(b"{")
            for key in sorted(value, key=repr):
                if key != DIGEST_KEY or value is not record:
                    h.update(f"{key!r}:".encode())
                    walk(value[key])
            h.update(b"}")
        elif isinstance(value, torch.Tensor):
            h.update(f"tensor {digest(value)};".encode())
        elif isinstance(value, tuple | list):
            h.update(b"[")
            for v in value:
                walk(v)
            h.update(b"]")
        else:
            h.update(f"{type(value).__name__} {value!r};".encode())

    walk(record)
    return h.hexdigest()


def sealed(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` with its :func:`content_digest` under :data:`DIGEST_KEY`.

    Examples:
        >>> from privmon._digest import check_sealed, sealed
        >>> state = sealed({"steps": 3})
        >>> check_sealed(state, what="state")  # intact: nothing raised
        >>> try:
        ...     check_sealed({**state, "steps": 4}, what="state")
        ... except ValueError as err:
        ...     print(str(err).split(":")[0])
        state is damaged
    """
    return {**record, DIGEST_KEY: content_digest(record)}


def check_sealed(record: Any, *, what: str) -> None:
    """Refuse ``record`` (a saved state, called ``what`` in messages) unless it is a dict that
    holds the digest of its content (:func:`sealed`): a ValueError says it is not a dict, is
    damaged, or carries no digest (saved by a privmon before states carried one)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{what} must be a dict from state_dict(), got {type(record).__name__}")
    if DIGEST_KEY not in record:
        raise ValueError(
            f"{what} carries no digest: it was saved by a privmon before saved states carried "
            "one (or edited), and this privmon reads only sealed states; resume it with the "
            "privmon that saved it, or start afresh"
        )
    if record[DIGEST_KEY] != content_digest(record):
        raise ValueError(
            f"{what} is damaged: what it holds no longer matches the digest saved with it (a "
            "changed byte: the file was damaged or the state edited); load an intact copy"
        )
