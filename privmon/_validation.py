"""Input checks shared by every public function: clear errors, NaN/inf dropped and counted."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch

from privmon._shown import as_written, described, shown

__all__ = [
    "as_array",
    "as_float_array",
    "as_mask",
    "as_scores",
    "as_tensor",
    "check_alphas_cumprod",
    "check_audit_set",
    "check_callable",
    "check_choice",
    "check_count",
    "check_epsilons",
    "check_flag",
    "check_fprs",
    "check_fraction",
    "check_half_open_interval",
    "check_indices",
    "check_int",
    "check_module",
    "check_name",
    "check_open_interval",
    "check_open_unit",
    "check_pair",
    "check_positive",
    "check_quantiles",
    "check_str",
    "check_threshold",
    "check_timesteps",
    "check_transform",
    "check_unit",
    "check_writable_dir",
    "is_table",
    "to_numpy",
]


def is_table(x: Any) -> bool:
    """True for a pandas DataFrame (pandas is only imported where a caller already has)."""
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(x, pandas.DataFrame)


_NOT_NUMBERS = (str, bytes, bytearray, bool, np.bool_)  # float() reads them; they are no number


def _refuse_text(value: Any, *, name: str, what: str) -> None:
    """Refuse a string (``delta="1e-5"``) or a bool where ``what`` is expected: ``float()``
    would read it, hiding a mistake (a value read from a file or the command line unparsed)."""
    if isinstance(value, _NOT_NUMBERS):
        raise ValueError(f"{name} must be {what}, got {shown(value, typed=True)}")


def _refuse_text_array(value: Any, *, name: str, what: str) -> None:
    """:func:`_refuse_text` for a number or an array: also an array or sequence of strings."""
    _refuse_text(value, name=name, what=what)
    if isinstance(value, list | tuple | np.ndarray):
        try:
            kind = np.asarray(value).dtype.kind
        except (TypeError, ValueError):  # ragged: the conversion that follows says so
            return
        if kind in "USO" and (kind != "O" or any(isinstance(v, str | bytes) for v in value)):
            raise ValueError(f"{name} must be {what}, got strings: {described(value)}")


def _number(value: Any, *, name: str, ok: Callable[[float], bool], where: str) -> float:
    """``value`` as a float, checked by ``ok`` (NaN fails every comparison); ``where`` names
    the valid range in the messages. Strings and bools are refused."""
    _refuse_text(value, name=name, what=f"a number {where}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number {where}, got {shown(value)}") from None
    if math.isnan(v) or not ok(v):
        raise ValueError(f"{name} must be {where}, got {shown(value)}")
    return v


def check_open_unit(value: float, *, name: str) -> float:
    """Return ``value`` as a float after checking it lies in the open interval (0, 1)."""
    return _number(
        value, name=name, ok=lambda v: 0.0 < v < 1.0, where="in the open interval (0, 1)"
    )


def check_unit(value: float, *, name: str) -> float:
    """Return ``value`` as a float after checking it lies in the closed interval [0, 1]."""
    return _number(
        value, name=name, ok=lambda v: 0.0 <= v <= 1.0, where="in the closed interval [0, 1]"
    )


def check_fraction(value: float, *, name: str) -> float:
    """Return ``value`` as a float after checking it lies in the interval (0, 1]."""
    return _number(value, name=name, ok=lambda v: 0.0 < v <= 1.0, where="in the interval (0, 1]")


def check_positive(value: float, *, name: str) -> float:
    """Return ``value`` as a float after checking it is finite and > 0."""
    return _number(value, name=name, ok=lambda v: 0.0 < v < math.inf, where="finite and > 0")


def check_threshold(value: Any, *, epsilon: bool) -> float:
    """An early-stopping budget as a float, in [0, 1] (a fraction) or [0, inf) for an ε."""
    if epsilon:
        return check_half_open_interval(value, name="threshold", low=0.0, high=math.inf)
    return check_unit(value, name="threshold")  # an advantage, an AUC, a risk


def check_int(value: Any, *, name: str, minimum: int = 0) -> int:
    """Return ``value`` as an int after checking it is an integer (not a bool) >= ``minimum``."""
    if type(value) is int and value >= minimum:  # the common case first: asked once a step
        return value
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {shown(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def check_open_interval(value: float, *, name: str, low: float, high: float) -> float:
    """Return ``value`` as a float after checking it lies in the open interval (low, high)."""
    return _number(value, name=name, ok=lambda v: low < v < high, where=f"in ({low}, {high})")


def check_half_open_interval(value: float, *, name: str, low: float, high: float) -> float:
    """Return ``value`` as a float after checking it lies in [low, high)."""
    return _number(value, name=name, ok=lambda v: low <= v < high, where=f"in [{low}, {high})")


def check_choice(value: Any, valid: tuple[Any, ...], *, name: str) -> Any:
    """Return ``value`` after checking it is one of ``valid``."""
    if not as_written(value) or value not in valid:  # (an array would compare elementwise)
        raise ValueError(f"{name} must be one of {valid}, got {shown(value)}")
    return value


def check_name(value: Any, *, name: str = "name") -> str:
    """Return ``value`` after checking it is a non-empty string (not only spaces)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {shown(value)}")
    return value


def check_module(value: Any, *, name: str) -> Any:
    """Return ``value`` after checking it is a ``torch.nn.Module``."""
    if not isinstance(value, torch.nn.Module):
        raise ValueError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def check_materialized(module: torch.nn.Module, *, name: str) -> torch.nn.Module:
    """Return ``module`` after checking that its parameters and buffers hold values: none on
    the meta device (a model built under ``torch.device("meta")`` or accelerate's
    ``init_empty_weights``), unless an accelerate hook loads the weights at each forward."""
    for kind, tensors in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for key, t in tensors:
            if t.is_meta and not any(hasattr(m, "_hf_hook") for m in module.modules()):
                raise ValueError(
                    f"{name} has its {kind} {key!r} on the meta device, which holds no values, "
                    f"so no score can be computed: load the weights first (e.g. "
                    f"{name}.to_empty(device='cpu') then load_state_dict)"
                )
    return module


def check_transform(transform: Any) -> Any:
    """Return ``transform`` after checking it is None or a callable ``batch -> (x, y)``."""
    if transform is not None and not callable(transform):
        raise ValueError(
            f"transform must be None or a callable batch -> (x, y), got {type(transform).__name__}"
        )
    return transform


def check_pair(pair: Any, *, name: str) -> tuple[Any, Any] | None:
    """Return ``pair`` as a tuple after checking it is None or a pair ``(x, y)``."""
    if pair is not None and (not isinstance(pair, tuple | list) or len(pair) != 2):
        raise ValueError(f"{name} must be a pair (x, y) of inputs and labels")
    return None if pair is None else tuple(pair)


def check_indices(targets: Any, n: int, *, what: str) -> np.ndarray:
    """Return ``targets`` as distinct int64 indices into ``what``, a collection of ``n`` records
    (a non-empty 1-D sequence of integers in [0, n - 1]); the argument is named ``targets``."""
    if isinstance(targets, torch.Tensor):
        targets = targets.detach().cpu().numpy()
    try:
        t = np.asarray(targets)
    except (TypeError, ValueError):
        raise ValueError(f"targets must be a sequence of integer indices into {what}") from None
    if t.ndim == 0:
        t = t.reshape(1)
    if t.ndim != 1 or t.size == 0:
        raise ValueError(
            f"targets must be a non-empty 1-D sequence of indices, got shape {t.shape}"
        )
    if t.dtype == bool or not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"targets must be integer indices into {what}, got dtype {t.dtype}")
    t = t.astype(np.int64)
    bad = (t < 0) | (t >= n)
    if bad.any():
        raise ValueError(
            f"targets must be indices in [0, {n - 1}] ({what} has {n} records), "
            f"got out-of-range values {t[bad][:5].tolist()}"
        )
    if np.unique(t).size != t.size:
        raise ValueError("targets must not repeat an index")
    return t


def check_fprs(fpr: Any) -> list[float]:
    """Return ``fpr`` (a number or a sequence of them) as a non-empty list of false-positive
    rates in (0, 1)."""
    values = np.atleast_1d(np.asarray(fpr, dtype=object)).ravel().tolist()
    if not values:
        raise ValueError("fpr must hold at least one target false-positive rate in (0, 1)")
    return [check_open_unit(v, name="fpr") for v in values]


def check_quantiles(q: Any) -> tuple[np.ndarray, bool]:
    """Return ``q`` (a number or a sequence of them) as a non-empty float64 array of quantiles
    in (0, 1], and whether it was a scalar."""
    _refuse_text_array(q, name="q", what="a number or a sequence of numbers in (0, 1]")
    try:
        arr = np.asarray(q, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"q must be a number or a sequence of numbers in (0, 1], got {shown(q)}"
        ) from None
    scalar = arr.ndim == 0
    arr = np.atleast_1d(arr).ravel()
    if arr.size == 0:
        raise ValueError("q must hold at least one quantile in (0, 1]")
    bad = ~((arr > 0.0) & (arr <= 1.0))  # also catches NaN
    if bad.any():
        raise ValueError(f"q must be in the half-open interval (0, 1], got {arr[bad].tolist()}")
    return arr, scalar


def check_count(value: Any, *, name: str) -> int:
    """Return ``value`` as an int after checking it is a non-negative whole number (an integer or
    a float holding one; not a string or a bool)."""
    _refuse_text(value, name=name, what="a non-negative integer count")
    try:
        f = float(value)
    except (TypeError, ValueError):
        f = math.nan
    if not math.isfinite(f) or f < 0 or f != int(f):
        raise ValueError(f"{name} must be a non-negative integer count, got {shown(value)}")
    return int(f)


def as_float_array(value: Any, *, name: str, valid: str) -> np.ndarray:
    """``value`` as a float64 numpy array; ``valid`` names the valid range in the message.
    Strings are refused."""
    _refuse_text_array(value, name=name, what=f"a number or array of numbers in {valid}")
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number or array of numbers in {valid}") from None


def check_epsilons(epsilon: Any) -> np.ndarray:
    """ε (a number, an array or a torch tensor on any device) as a float64 array, every entry in
    [0, inf]."""
    if hasattr(epsilon, "detach"):  # torch tensor on any device
        epsilon = to_numpy(epsilon)
    eps = as_float_array(epsilon, name="epsilon", valid="[0, inf]")
    if np.isnan(eps).any() or (eps < 0).any():
        raise ValueError(f"epsilon must be in [0, inf] (inf, not NaN), got {shown(epsilon)}")
    return eps


def check_flag(value: Any, *, name: str) -> bool:
    """Return ``value`` as a bool after checking it is True or False (numpy bools too)."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be True or False, got {shown(value)}")
    return bool(value)


def check_callable(fn: Any, *, name: str) -> None:
    """Raise TypeError unless ``fn`` is callable."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def check_has_methods(obj: Any, *methods: str, name: str, expected: str) -> Any:
    """Return ``obj`` after checking it has every one of ``methods`` (callable attributes)."""
    if not all(callable(getattr(obj, m, None)) for m in methods):
        raise ValueError(f"{name} must be {expected}, got {shown(obj)}")
    return obj


def check_audit_set(data: Any, *, name: str, allow_empty: bool = False) -> Any:
    """Return ``data`` after checking it can be iterated once per check, batch by batch: an
    iterable that is not a one-shot iterator, a string, a mapping or an array, and is not
    empty when it has a length (unless ``allow_empty``: a rank's shard of a set)."""
    what = f"{name} must be an iterable of batches that can be iterated again at every check "
    what += "(a DataLoader, a list of batches)"
    if isinstance(data, (str, bytes)):
        raise ValueError(f"{what}, got {described(data)}")
    if isinstance(data, Mapping):
        raise ValueError(f"{what}, got a {type(data).__name__}; one batch: pass [batch]")
    if isinstance(data, (torch.Tensor, np.ndarray)):
        raise ValueError(
            f"{what}, got a {type(data).__name__}: iterating it yields single rows; "
            "one batch: pass [tensor], or a DataLoader over a TensorDataset"
        )
    if is_table(data):
        raise ValueError(f"{what}, got a DataFrame: iterating it yields column names; pass [df]")
    if not isinstance(data, Iterable):
        raise ValueError(f"{what}, got {type(data).__name__}")
    if isinstance(data, Iterator):  # a generator, map, zip, iter(...)
        raise ValueError(
            f"{what}, got a one-shot iterator ({type(data).__name__}), which would be exhausted "
            "after the first check; pass list(...) of it"
        )
    try:
        empty = isinstance(data, Sized) and len(data) == 0
    except TypeError:  # no length (an iterable dataset): the first check tells
        empty = False
    if empty and not allow_empty:
        raise ValueError(f"{name} is empty: it must yield at least one batch")
    return data


def check_writable_dir(path: str | os.PathLike[str], *, name: str) -> str:
    """Return ``path`` (a string or path object) as a string after checking a directory exists
    there, or can be created there and written to (the nearest existing ancestor is a writable
    directory)."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{name} must be a directory path (str or os.PathLike), got {shown(path)}")
    path = os.fspath(path)
    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"{name} must be a directory path, but {path!r} is a file")
    ancestor = target
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{name} {path!r} cannot be created: {ancestor!r} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path!r} is not writable: no write permission on {ancestor!r}")
    return path


def check_str(value: Any, *, name: str) -> str:
    """Return ``value`` after checking it is a string (empty allowed)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {shown(value)}")
    return value


def check_optional_str(value: Any, *, name: str) -> str | None:
    """Return ``value`` after checking it is None or a non-empty string."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name} must be None or a non-empty string, got {shown(value)}")
    return value


def check_subset(
    values: Any, valid: tuple[str, ...], *, name: str, allow_empty: bool = False
) -> tuple[str, ...]:
    """Return ``values`` as a tuple without repeats after checking it is a subset of ``valid``,
    non-empty unless ``allow_empty`` (a lone string counts as one value)."""
    items = (values,) if isinstance(values, str) else tuple(values)
    if (not items and not allow_empty) or any(v not in valid for v in items):
        kind = "a subset" if allow_empty else "a non-empty subset"
        raise ValueError(f"{name} must be {kind} of {valid}, got {shown(values)}")
    return tuple(dict.fromkeys(items))


def check_names(values: Any, valid: tuple[str, ...], *, name: str) -> tuple[str, ...]:
    """``values`` (a name or names of ``valid``; empty: none) as those names, in valid's order."""
    if not isinstance(values, str | Iterable):
        raise TypeError(
            f"{name} must be a name or names from {valid} (or empty), got {type(values).__name__}"
        )
    chosen = check_subset(values, valid, name=name, allow_empty=True)
    return tuple(v for v in valid if v in chosen)


def _is_complex(values: Any) -> bool:
    """Whether ``values`` (a tensor, an array or nested sequences) holds complex numbers."""
    if isinstance(values, torch.Tensor):
        return values.is_complex()
    try:
        return bool(np.iscomplexobj(np.asarray(values)))
    except (TypeError, ValueError):  # ragged or not numeric: the conversion below says so
        return False


def as_scores(
    scores: Any, *, name: str, device: torch.device | None = None, drop: bool = True
) -> tuple[torch.Tensor, int]:
    """Convert scores to a float64 tensor of shape (n, d) on their own device.

    Accepts numpy arrays, torch tensors (any device) and nested sequences, of shape (n,) or (n, d).
    Rows holding NaN or +-inf are dropped; the number dropped is returned so callers can report it.
    ``device`` moves the result (used to bring a second argument onto the first one's device).
    ``drop=False`` keeps every row (for per-record outputs that must stay aligned with the input)
    and still returns how many rows are not finite.
    """
    if _is_complex(scores):  # casting would silently drop the imaginary parts
        raise ValueError(f"{name} must be real numbers, got complex values")
    if isinstance(scores, torch.Tensor):
        t = scores.detach()
    else:
        try:
            arr = np.asarray(scores, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a numeric array of shape (n,) or (n, d)") from None
        t = torch.from_numpy(np.ascontiguousarray(arr))  # views with negative strides too
    if device is not None:
        t = t.to(device)
    t = t.to(torch.float64)
    if t.ndim == 1:
        t = t.unsqueeze(1)
    elif t.ndim != 2:
        raise ValueError(f"{name} must have shape (n,) or (n, d), got shape {tuple(t.shape)}")
    if t.shape[0] == 0:
        raise ValueError(f"{name} is empty: at least one score is needed")
    if t.shape[1] == 0:
        raise ValueError(f"{name} has zero dimensions per score: shape {tuple(t.shape)}")
    if bool(torch.isfinite(t).all()):  # the usual case: one reduction, no per-row mask
        return t, 0
    finite = torch.isfinite(t).all(dim=1)
    n_dropped = int(t.shape[0] - int(finite.sum()))
    if not drop:
        return t, n_dropped
    if n_dropped == t.shape[0]:
        raise ValueError(f"{name} has no finite scores: all {n_dropped} are NaN or infinite")
    if n_dropped:
        t = t[finite]
    return t, n_dropped


def as_tensor(values: Any, *, name: str, what: str) -> torch.Tensor:
    """``values`` as a tensor of its own dtype and device (numpy arrays and sequences of numbers
    or bools converted, read-only arrays copied); ``what`` completes the error message
    "{name} must be {what}"."""
    if isinstance(values, torch.Tensor):
        return values.detach()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}") from None
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"{name} must be {what}, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # frozen results too


def as_array(
    values: Any, *, name: str, ndim: int, device: torch.device | None = None
) -> torch.Tensor:
    """``values`` as a float64 tensor with exactly ``ndim`` dimensions, on its own device (or
    ``device``). Every entry is kept, NaN and inf included (per-record outputs stay aligned with
    the input; the caller decides what a non-finite entry means). Empty arrays are rejected."""
    what = f"a real numeric array with {ndim} dimension{'s' if ndim > 1 else ''}"
    t = as_tensor(values, name=name, what=what)
    if t.is_complex():
        raise ValueError(f"{name} must be {what}, got complex values")
    if device is not None:
        t = t.to(device)
    t = t.to(torch.float64)
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty: shape {tuple(t.shape)}")
    return t


def as_mask(
    values: Any, *, name: str, shape: tuple[int, ...], device: torch.device | None = None
) -> torch.Tensor:
    """``values`` as a bool tensor of exactly ``shape`` on ``device``: bools, or numbers that
    are all 0 or 1."""
    what = f"a boolean array of shape {shape}"
    t = as_tensor(values, name=name, what=what)
    if device is not None:
        t = t.to(device)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    if t.dtype != torch.bool:
        if t.is_complex() or not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"{name} must be {what}: True / False (or 1 / 0) entries only")
        t = t != 0
    return t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Detach, move to CPU and return as a numpy array."""
    if t.device.type == "cpu" and not t.requires_grad:
        return t.numpy()  # (a checked shortcut: checks convert hundreds of small tensors)
    return t.detach().cpu().numpy()


def check_timesteps(
    values: Any, *, name: str, steps: int, interval: int | None = None
) -> tuple[int, ...]:
    """Return ``values`` (an integer or a non-empty sequence of integers) as a tuple of
    diffusion timesteps after checking each lies in [0, ``steps`` − 1]; with ``interval`` (a
    stride k), each must also be a multiple of k with t + k ≤ ``steps`` − 1."""
    items = (values,) if isinstance(values, int | np.integer) else values
    if isinstance(values, torch.Tensor | np.ndarray) and values.ndim == 0:
        items = (values.item(),)
    elif isinstance(values, torch.Tensor | np.ndarray):
        items = values.tolist()
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise ValueError(f"{name} must be an integer or a sequence of them, got {shown(values)}")
    items = tuple(items)
    last = steps - 1 - (interval or 0)
    where = f"integers in [0, {last}]" + (
        f", multiples of interval={interval} (t + interval must be a step of the {steps})"
        if interval
        else f" (the scheduler has {steps} steps)"
    )
    if not items:
        raise ValueError(f"{name} is empty: expected {where}")
    for t in items:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t <= last:
            raise ValueError(f"{name} must be {where}, got {shown(t)}")
        if interval and t % interval:
            raise ValueError(f"{name} must be {where}, got {t} (not a multiple of {interval})")
    return tuple(int(t) for t in items)


def check_alphas_cumprod(values: Any, *, name: str) -> torch.Tensor:
    """Return ``values`` as a float64 CPU tensor ᾱ_0 … ᾱ_{T−1} after checking it is 1-D, not
    empty, finite, in (0, 1] and non-increasing (a DDPM's cumulative product of 1 − β_t)."""
    what = "a 1-D tensor of cumulative alphas ᾱ_t in (0, 1], non-increasing"
    t = as_tensor(values, name=name, what=what)
    if t.is_complex() or t.dtype == torch.bool or t.ndim != 1 or t.numel() == 0:
        raise ValueError(f"{name} must be {what}, got {t.dtype} of shape {tuple(t.shape)}")
    t = t.detach().to("cpu", torch.float64)
    if not bool(((t > 0) & (t <= 1)).all()) or bool((t[1:] > t[:-1]).any()):
        raise ValueError(
            f"{name} must be {what}, got values from {t.min().item():.4g} to {t.max().item():.4g}"
        )
    return t
