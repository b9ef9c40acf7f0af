"""How messages show the values they refuse: configuration (a number, an option's name) as
written, anything that may hold records by its type, shape, count and index only, so that no
part of a record's value appears in an error, a log line or a warning."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

import numpy as np
import torch

__all__ = ["as_written", "described", "positions", "shown"]

_WORD = 40  # the longest string shown as written: an option's name, never a text


def as_written(value: Any) -> bool:
    """A number, a bool, None or a word (a string or bytes of at most 40 characters without
    spaces: an option's name), or a list / tuple of at most 8 of them: configuration, never a
    record."""
    if value is None or isinstance(value, bool | int | float | np.number | np.bool_):
        return True
    if isinstance(value, str | bytes):  # one word: no space in or around it
        return len(value) <= _WORD and len(value.split()) <= 1 and value.strip() == value
    if isinstance(value, list | tuple) and len(value) <= 8:
        return all(not isinstance(v, list | tuple) and as_written(v) for v in value)
    return False


def shown(value: Any, *, typed: bool = False) -> str:
    """How a message shows a value it refuses: configuration (a number, a bool, None, an
    option's name, a short list of them) as written, after its type when ``typed``; anything
    else by its type and size only (:func:`described`), as it may hold records: no part of a
    record's value appears in an error, a log line or a warning."""
    if not as_written(value):
        return described(value)
    return f"{type(value).__name__} {value!r}" if typed else repr(value)


def described(value: Any) -> str:
    """``value`` by its type and size only (shape, length), never its contents."""
    kind = type(value).__name__
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple):  # torch.Size too: arrays, tensors, tables
        return f"a {kind} of shape {tuple(shape)}"
    if isinstance(value, str | bytes | bytearray):
        return f"a {kind} of {len(value)} characters"
    if isinstance(value, Mapping):
        return f"a {kind} of {len(value)} keys"
    if isinstance(value, Sized):
        return f"a {kind} of length {len(value)}"
    return f"a {kind}"


def positions(bad: Any) -> str:
    """Which entries of a boolean array (numpy or torch) a check refused, by their count and
    the first one's index, never their values: ``"2 of 6 (the first at index 3)"``, an index
    tuple above 1-D."""
    b = bad.detach().cpu().numpy() if isinstance(bad, torch.Tensor) else np.asarray(bad)
    hits = np.argwhere(b.astype(bool))
    if not len(hits):
        return f"0 of {b.size}"
    first = tuple(int(i) for i in hits[0])
    return f"{len(hits)} of {b.size} (the first at index {first[0] if len(first) == 1 else first})"
