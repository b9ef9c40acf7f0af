"""The batch convention every query reads (see :mod:`privmon.queries`): splitting a batch into
inputs and labels, moving it to the model's device, calling a module on it, unwrapping its output,
and the content digests that key the queries' caches. Shared by the queries and
:class:`privmon.queries.GeneratorQuery`."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from privmon._validation import is_table

__all__ = [
    "INPUT_KEYS",
    "LABEL_KEYS",
    "Batch",
    "Transform",
    "as_float",
    "batch_digests",
    "call_module",
    "count_records",
    "first_tensor",
    "flat_records",
    "module_device",
    "per_record",
    "record_digests",
    "records_on_cpu",
    "split_batch",
    "tensor_digest",
    "to_device",
    "unique_modules",
]

Batch = Any
Transform = Callable[[Batch], tuple[Any, Any]]

INPUT_KEYS = ("x", "input", "inputs", "input_ids")
LABEL_KEYS = ("y", "label", "labels", "target")


def unique_modules(modules: Iterable[nn.Module]) -> tuple[nn.Module, ...]:
    out: list[nn.Module] = []
    for m in modules:
        if not any(m is o for o in out):
            out.append(m)
    return tuple(out)


def module_device(modules: Iterable[nn.Module], fallback: Any = None) -> torch.device:
    """Device of the first parameter, else the first buffer, of the first module that has one."""
    for m in modules:
        for t in m.parameters():
            return t.device
        for b in m.buffers():
            return b.device
    return torch.device(fallback) if fallback is not None else torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, np.ndarray):
        return torch.as_tensor(obj, device=device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def _transformed(batch: Batch, transform: Transform) -> tuple[Any, Any]:
    out = transform(batch)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError("transform must return a pair (x, y), with y None when there is no label")
    return out[0], out[1]


def _split_mapping(batch: Mapping[Any, Any]) -> tuple[Any, Any]:
    """(x, y or None) of a dict batch, by the first of its keys in INPUT_KEYS and LABEL_KEYS."""
    xk = next((k for k in INPUT_KEYS if k in batch), None)
    if xk is None:
        raise ValueError(
            f"dict batch has none of the input keys {INPUT_KEYS} "
            f"(keys: {sorted(map(str, batch))}); pass transform=lambda batch: (x, y)"
        )
    yk = next((k for k in LABEL_KEYS if k in batch), None)
    return batch[xk], (batch[yk] if yk is not None else None)


def split_batch(
    batch: Batch, device: torch.device, transform: Transform | None = None
) -> tuple[Any, torch.Tensor | None]:
    """Split a batch into (x, y or None) following the module's batch convention; move to device."""
    if transform is not None:
        x, y = _transformed(batch, transform)
    elif isinstance(batch, torch.Tensor):
        x, y = batch, None
    elif isinstance(batch, Mapping):
        x, y = _split_mapping(batch)
    elif isinstance(batch, (tuple, list)):
        if len(batch) == 0:
            raise ValueError("batch is an empty tuple/list: expected (x, y, ...)")
        x, y = batch[0], (batch[1] if len(batch) > 1 else None)
    else:
        raise ValueError(
            f"unsupported batch type {type(batch).__name__}: expected a tensor, a tuple/list "
            "(x, y, ...) or a dict; pass transform=lambda batch: (x, y)"
        )
    x = to_device(x, device)
    if y is not None:
        y = y.to(device) if isinstance(y, torch.Tensor) else torch.as_tensor(y, device=device)
    return x, y


def _rows(x: Any) -> Any:
    """What holds one row per record in an input: the input itself (a tensor, an array or a
    DataFrame), a list of strings (texts), or the first tensor or array among keyword inputs
    (the first input key present, else the first value) or positional ones; None when there
    is none."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x if x.ndim else None
    if is_table(x):
        return x
    if isinstance(x, Mapping):
        keys = [k for k in INPUT_KEYS if k in x] + list(x)
        return next((r for r in map(_rows, (x[k] for k in keys)) if r is not None), None)
    if isinstance(x, (tuple, list)) and x:
        if all(isinstance(v, str) for v in x):
            return list(x)
        return next((r for r in map(_rows, x) if r is not None), None)
    return None


def _raw_split(batch: Batch) -> tuple[Any, Any]:
    """(x, y or None) of a raw batch by the batch convention, left where they are; a batch that
    follows none of its forms (a mapping without an input key, a list of texts) is all input."""
    if isinstance(batch, Mapping):
        xk = next((k for k in INPUT_KEYS if k in batch), None)
        yk = next((k for k in LABEL_KEYS if k in batch), None)
        return (batch if xk is None else batch[xk]), (None if yk is None else batch[yk])
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], str):
        return batch[0], batch[1] if len(batch) > 1 else None
    return batch, None


def count_records(batch: Batch, transform: Transform | None = None) -> int | None:
    """How many records a batch holds, read as the queries read it: the length of its input
    (``transform(batch)[0]`` when a transform is given, else the input by the batch convention):
    a tensor's or array's first dimension, a list of texts' length, or that of the first tensor
    among keyword or positional inputs. None when no input holds rows."""
    x, _ = _transformed(batch, transform) if transform is not None else _raw_split(batch)
    rows = _rows(x)
    return None if rows is None else len(rows)


def batch_digests(batch: Batch, transform: Transform | None = None) -> list[bytes] | None:
    """One 128-bit BLAKE2b digest per record of a batch, read as :func:`count_records` reads
    it: of its input row and, where the batch has one label (or row of labels) per record, its
    label. None when the batch holds no rows. Only the digests are kept, never the records."""
    x, y = _transformed(batch, transform) if transform is not None else _raw_split(batch)
    rows = _rows(x)
    if rows is None:
        return None
    if isinstance(rows, list):
        return [hashlib.blake2b(t.encode(), digest_size=16).digest() for t in rows]
    if is_table(rows):  # pandas' per-row hash of the values, one 64-bit digest per record,
        ordered = rows[sorted(rows.columns, key=str)]  # whatever the order of the columns
        hashes = sys.modules["pandas"].util.hash_pandas_object(ordered, index=False).to_numpy()
        return [h.tobytes() for h in hashes]
    try:
        x_rows = torch.as_tensor(rows)
        labels = torch.as_tensor(y) if isinstance(y, (torch.Tensor, np.ndarray)) else None
    except (TypeError, ValueError):  # arrays of objects: nothing to digest
        return None
    if labels is None or labels.shape[:1] != x_rows.shape[:1] or labels.is_complex():
        labels = torch.zeros(x_rows.shape[0], dtype=torch.long)
    return record_digests(x_rows, labels)


def tensor_digest(x: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """Cache key of a batch tensor: dtype, shape and a 128-bit BLAKE2b digest of its bytes (a
    tensor on an accelerator is copied to the CPU for hashing)."""
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    raw = t.view(torch.uint8).numpy() if t.numel() else b""
    # numpy's stubs do not declare ndarray a Buffer; at run time it is one (no copy is made)
    digest = hashlib.blake2b(raw, digest_size=16).digest()  # type: ignore[arg-type]
    return str(x.dtype), tuple(x.shape), digest


def call_module(module: nn.Module, x: Any) -> Any:
    """Call module on x: a tuple/list is unpacked as positional args, a mapping as keyword args."""
    if isinstance(x, Mapping):
        return module(**x)
    if isinstance(x, (tuple, list)):
        return module(*x)
    return module(x)


def first_tensor(out: Any, what: str) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if "logits" in out and isinstance(out["logits"], torch.Tensor):
            return out["logits"]
        out = list(out.values())
    elif isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise ValueError(f"{what} returned {type(out).__name__}; expected a tensor")


def as_float(t: torch.Tensor) -> torch.Tensor:
    """float64 stays float64; every other dtype (half, bfloat16, ints, bool) becomes float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def per_record(t: torch.Tensor, what: str) -> torch.Tensor:
    """(n,) or (n, 1, ...) with one value per record -> (n,)."""
    if t.ndim == 0:
        raise ValueError(f"{what} returned a scalar; expected one value per record, shape (n,)")
    if t[0].numel() != 1:
        raise ValueError(
            f"{what} returned shape {tuple(t.shape)}; expected one value per record, (n,) or (n, 1)"
        )
    return t.reshape(t.shape[0])


def flat_records(
    batch: Batch, device: torch.device, transform: Any, dim: int, name: str, against: str
) -> torch.Tensor:
    """A batch's inputs as (n, dim) rows on ``device``, checked against the rows they are
    compared with; ``against`` names them with their verb ("generated samples have")."""
    x, _ = split_batch(batch, device, transform)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: the input must be a tensor, got {type(x).__name__}")
    x = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, -1)
    if x.shape[1] != dim:
        raise ValueError(
            f"{name}: input has {x.shape[1]} values per record but {against} {dim}; "
            "use transform to match the generator's output"
        )
    return x


def records_on_cpu(
    pair: tuple[Any, Any] | None, name: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Records ``(x, y)`` as CPU tensors, checked for at least one record, one integer label
    per input row."""
    if pair is None:
        return None
    x, y = (v.detach().cpu() if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in pair)
    if x.ndim == 0 or tuple(y.shape) != (x.shape[0],) or x.shape[0] == 0:
        raise ValueError(
            f"{name} must be a pair (x, y) with one row per record (at least one) and labels of "
            f"shape (n,), got shapes {tuple(x.shape)} and {tuple(y.shape)}"
        )
    integral = not y.is_complex() and (not y.is_floating_point() or bool((y == y.round()).all()))
    if not integral:
        raise ValueError(f"{name}: labels must be integer class indices, got {y.dtype} values")
    return x, y.long()


def record_digests(x: torch.Tensor, y: torch.Tensor) -> list[bytes]:
    """One 128-bit BLAKE2b digest per record of its input row's bytes and its label (or its
    row of labels, e.g. a language model's per-token labels)."""
    rows = x.detach().cpu().contiguous().reshape(x.shape[0], -1).view(torch.uint8).numpy()
    labels = y.detach().cpu().long().reshape(x.shape[0], -1).view(torch.uint8).numpy()
    return [
        hashlib.blake2b(r.tobytes() + lab.tobytes(), digest_size=16).digest()
        for r, lab in zip(rows, labels, strict=True)
    ]
