"""What a check must leave as it found it: the training's RNGs, modes, buffers, gradients,
default dtype and grad mode, what the step keeps for the optimizer (Opacus' hooks and
per-sample gradients) and the audit loaders' generators and iterators; and the weights, which
it cannot restore cheaply, it watches.

A check runs the user's queries between two training steps. Anything they can change that the
next step reads is saved before and restored after (:class:`TrainingGuard`), and a query that
writes to the weights has its result refused; one check runs at a time in a process
(:func:`begin_check`). The audit loaders are iterated through views that cannot reset an
iterator the training loop is using (:func:`audit_view`).
"""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from privmon._inplace_writes import InPlaceWrites

__all__ = [
    "PerSample",
    "TrainingGuard",
    "audit_view",
    "begin_check",
    "end_check",
    "warn_if_shuffled",
]


def _save_rng() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 (the global RNG is what we protect)
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _loader_generators(loaders: Iterable[Any]) -> list[torch.Generator]:
    """The torch generators iterating these loaders draws from: the loader's own (its workers'
    base seed) and its sampler's (the shuffle order), often one object shared with the training
    loader."""
    found: dict[int, torch.Generator] = {}
    for loader in loaders:
        if not isinstance(loader, DataLoader):
            continue
        batch_sampler = getattr(loader, "batch_sampler", None)
        for owner in (loader, loader.sampler, getattr(batch_sampler, "sampler", None)):
            g = getattr(owner, "generator", None)
            if isinstance(g, torch.Generator):
                found[id(g)] = g
    return list(found.values())


_CHECK_LOCK = threading.Lock()


def begin_check() -> bool:
    """Take the process's check lock, without waiting: False when another check holds it.

    Two checks at a time would each save the other's eval mode and cleared gradients as "the
    training state" and put them back last; the RNGs they restore are the process's, so the
    lock is one per process, not per monitor. A refused check does not wait: a query calling
    ``check()`` would otherwise wait for itself. Release it with :func:`end_check`."""
    return _CHECK_LOCK.acquire(blocking=False)


def end_check() -> None:
    """Release the lock :func:`begin_check` took."""
    _CHECK_LOCK.release()


class PerSample(Protocol):
    """What a training step keeps for its optimizer step that queries must not see:
    :meth:`hide` before each query, :meth:`restore` as found at the end."""

    def hide(self) -> None: ...

    def restore(self) -> None: ...


class _Param(NamedTuple):
    """A parameter as a check found it: where it lives, the tensor, its storage (an alias:
    ``p.data = …`` rebinds it, which is put back) and its gradient and ``requires_grad``."""

    owner: nn.Module
    name: str
    qualified: str
    tensor: nn.Parameter
    storage: torch.Tensor
    grad: torch.Tensor | None
    requires_grad: bool


class _Buffer(NamedTuple):
    """A buffer as a check found it, with a copy of its values."""

    owner: nn.Module
    name: str
    tensor: torch.Tensor
    saved: torch.Tensor


def _unchanged(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit the same values (NaN included, which ``torch.equal`` calls unequal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class TrainingGuard:
    """What a check must leave as it found it: a context manager over the modules ``roots``
    (duplicates counted once) and the audit ``loaders``.

    Entering saves, and exiting restores, whatever the block does or raises:

    - every RNG (Python, numpy, torch, CUDA) and every generator the audit ``loaders`` draw from;
    - every submodule's train / eval mode, every parameter's ``requires_grad`` and ``.grad``;
    - every buffer's values (BatchNorm statistics: a query that calls ``.train()`` changes
      them), a copy of each taken on entry;
    - the default dtype and the grad mode;
    - what the training step keeps for its optimizer step (``per_sample``: Opacus' hooks and
      per-sample gradients, :class:`~privmon.audit.opacus_per_sample.PerSampleState`), hidden
      inside the block;
    - every parameter the modules hold, and the storage it holds (``module.weight = …`` and
      ``p.data = …`` are put back); a lazy parameter not yet materialised has neither and is
      passed by.

    Inside, the roots are in eval mode, grad mode is off and every ``.grad`` is None.
    :meth:`after_query`, called after each query call, puts that back for the next one and says
    when the call changed a parameter: one written to in place cannot be restored without a copy
    of the model (nor can the optimizer state, which only changes with a step that writes the
    weights), so the call's result is refused instead. In-place writes are seen through the
    parameters' version counters (:class:`~privmon._inplace_writes.InPlaceWrites`), which every
    in-place torch operation and optimizer step updates; a write through ``.data``
    (``p.data.add_(…)``) bypasses them and is not seen.
    """

    def __init__(
        self, roots: Sequence[nn.Module], loaders: Sequence[Any], *, per_sample: PerSample
    ) -> None:
        self.roots = list({id(root): root for root in roots}.values())
        self.loaders = list(loaders)
        self.per_sample = per_sample

    def __enter__(self) -> TrainingGuard:
        self._rng = _save_rng()
        self._generators = [(g, g.get_state()) for g in _loader_generators(self.loaders)]
        self._dtype, self._grad_mode = torch.get_default_dtype(), torch.is_grad_enabled()
        modules = list({id(m): m for root in self.roots for m in root.modules()}.values())
        self._modes = [(m, m.training) for m in modules]
        self._params = _parameters(self.roots)
        self._writes = [InPlaceWrites([p.tensor]) for p in self._params]  # renewed after one
        self._buffers = [
            _Buffer(m, name, b, b.detach().clone())
            for m in modules
            for name, b in m.named_buffers(recurse=False)
            if not is_lazy(b)
        ]
        try:
            self._set_check_state()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _set_check_state(self) -> None:
        """What each query starts from: eval mode, no gradients (``requires_grad`` as found), no
        per-sample state, the default dtype as found, grad mode off."""
        for p in self._params:
            p.tensor.grad = None
            p.tensor.requires_grad_(p.requires_grad)
        self.per_sample.hide()
        for root in self.roots:
            root.eval()
        torch.set_default_dtype(self._dtype)
        torch.set_grad_enabled(False)

    def after_query(self) -> str | None:
        """After a query call: restore what it changed that the next call reads (modes,
        buffers, ``requires_grad``, gradients, hooks, default dtype, grad mode); return why its
        result must be refused — the parameters it wrote to in place — or None."""
        changed = self._restore_parameters()
        written = [i for i, w in enumerate(self._writes) if w.any()]
        for i in written:  # later calls are judged on their own writes
            self._writes[i] = InPlaceWrites([self._params[i].tensor])
        changed += [self._params[i].qualified for i in written]
        changed = list(dict.fromkeys(changed))
        self._restore_buffers()  # by value: BatchNorm in training mode writes them
        self._set_check_state()
        if not changed:
            return None
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" * (len(changed) > 5))
        return (
            f"wrote to parameters ({shown}): its scores are of other weights than training's, "
            "and are refused (a weight written to in place stays written, as does the "
            "optimizer state that moves with it: a query must not step an optimizer or change "
            "weights)"
        )

    def _restore_parameters(self) -> list[str]:
        """Put back every parameter replaced in its module or given other storage; their
        names."""
        put_back = []
        for p in self._params:
            moved = getattr(p.owner, p.name, None) is not p.tensor
            if moved:
                setattr(p.owner, p.name, p.tensor)
            if p.tensor.data_ptr() != p.storage.data_ptr() or p.tensor.shape != p.storage.shape:
                p.tensor.data = p.storage
                moved = True
            if moved:
                put_back.append(p.qualified)
        return put_back

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for b in self._buffers:
                if getattr(b.owner, b.name, None) is not b.tensor:
                    _put_buffer(b)
                if _unchanged(b.tensor, b.saved):
                    continue  # no needless write: it would bump the version autograd checks
                if b.tensor.shape == b.saved.shape:
                    b.tensor.copy_(b.saved)
                else:  # resized in place: back to the saved size, then the saved values
                    b.tensor.resize_(b.saved.shape).copy_(b.saved)

    def _restore(self) -> None:
        for m, training in self._modes:
            m.training = training
        self._restore_parameters()
        for p in self._params:
            p.tensor.grad = p.grad
            p.tensor.requires_grad_(p.requires_grad)
        self._restore_buffers()
        self.per_sample.restore()
        for g, state in self._generators:
            g.set_state(state)
        _restore_rng(self._rng)
        torch.set_default_dtype(self._dtype)
        torch.set_grad_enabled(self._grad_mode)


def _put_buffer(b: _Buffer) -> None:
    """Back in its module: a buffer a query replaced (or removed, then registered again)."""
    if b.name in dict(b.owner.named_buffers(recurse=False)):
        setattr(b.owner, b.name, b.tensor)
    else:
        b.owner.register_buffer(b.name, b.tensor)


def _parameters(roots: Sequence[nn.Module]) -> list[_Param]:
    """Every parameter of the roots once, with its qualified name (prefixed by the root's
    class and position when there are several roots)."""
    found: dict[int, _Param] = {}
    for i, root in enumerate(roots):
        prefix = f"{type(root).__name__}#{i}." if len(roots) > 1 else ""
        for module_name, m in root.named_modules(remove_duplicate=False):
            for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
                if is_lazy(p) or id(p) in found:  # a lazy one has no data yet
                    continue
                qualified = f"{prefix}{module_name}.{name}" if module_name else prefix + name
                found[id(p)] = _Param(m, name, qualified, p, p.data, p.grad, p.requires_grad)
    return list(found.values())


def audit_view(data: Any) -> Any:
    """What a check iterates for an audit set: the set itself, or for a DataLoader with
    ``persistent_workers=True`` a twin without them — iterating such a loader hands back (and
    resets) the one iterator the training loop may be in the middle of."""
    if not isinstance(data, DataLoader) or not data.persistent_workers:
        return data
    options = {
        "num_workers": data.num_workers,
        "collate_fn": data.collate_fn,
        "pin_memory": data.pin_memory,
        "timeout": data.timeout,
        "worker_init_fn": data.worker_init_fn,
        "multiprocessing_context": data.multiprocessing_context,
        "generator": data.generator,
        "prefetch_factor": data.prefetch_factor,
        "persistent_workers": False,
        "pin_memory_device": data.pin_memory_device,
        "in_order": data.in_order,
    }
    if isinstance(data.dataset, IterableDataset):
        return DataLoader(
            data.dataset, batch_size=data.batch_size, drop_last=data.drop_last, **options
        )
    if data.batch_sampler is None:  # automatic batching off: one record per "batch"
        return DataLoader(data.dataset, sampler=data.sampler, batch_size=None, **options)
    return DataLoader(data.dataset, batch_sampler=data.batch_sampler, **options)


def warn_if_shuffled(data: Any, *, name: str) -> None:
    """Warn when an audit set is a shuffling DataLoader: per-record figures (top records, the
    record tracker, exported risks) index records by the order the set yields, which then changes
    at every check."""
    sampler = getattr(data, "sampler", None) if isinstance(data, DataLoader) else None
    inner = getattr(getattr(data, "batch_sampler", None), "sampler", None)
    if isinstance(sampler, RandomSampler) or isinstance(inner, RandomSampler):
        warnings.warn(
            f"{name} is a shuffling DataLoader: per-record indices (top records, the record "
            "tracker, exported risks) refer to the order it yields, which changes at every check. "
            "Audit with shuffle=False (the aggregate figures are unaffected).",
            UserWarning,
            stacklevel=3,
        )
