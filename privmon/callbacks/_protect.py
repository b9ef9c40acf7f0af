"""What a check must leave as it found it: the training's RNGs, modes, gradients, Opacus
per-sample-gradient hooks and the audit loaders' generators and iterators.

A check runs the user's queries between two training steps. Anything they can change that the
next step reads is saved before and restored after (:func:`untouched_training`); the audit loaders
are iterated through views that cannot reset an iterator the training loop is using
(:func:`audit_view`).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

__all__ = ["audit_view", "untouched_training", "warn_if_shuffled"]


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


def _opacus_modules(roots: Sequence[nn.Module]) -> list[Any]:
    """Opacus ``GradSampleModule``s whose hooks fire on these modules: the roots themselves, and
    the owners of the hooks Opacus attached to their submodules (a query may hold the wrapped
    model rather than the wrapper)."""
    found: dict[int, Any] = {}
    for root in roots:
        for m in root.modules():
            owners = [m, *(getattr(h, "__self__", None) for h in m._forward_hooks.values())]
            for owner in owners:
                if callable(getattr(owner, "disable_hooks", None)) and isinstance(
                    getattr(owner, "hooks_enabled", None), bool
                ):
                    found[id(owner)] = owner
    return list(found.values())


@contextlib.contextmanager
def untouched_training(roots: Sequence[nn.Module], loaders: Sequence[Any]) -> Iterator[None]:
    """Run the block with ``roots`` in eval mode and leave, whatever the block does or raises:

    - every RNG (Python, numpy, torch, CUDA) and every generator the audit ``loaders`` draw from;
    - every submodule's train / eval mode;
    - every parameter's ``.grad`` (a gradient query's ``backward()`` writes to a fresh one);
    - Opacus' per-sample-gradient hooks, disabled inside the block, so a query's backward pass
      neither consumes the training step's captured activations nor leaves partial per-sample
      gradients that make the next training step fail.
    """
    rng = _save_rng()
    generators = [(g, g.get_state()) for g in _loader_generators(loaders)]
    modes = {m: m.training for root in roots for m in root.modules()}
    params = list({id(p): p for root in roots for p in root.parameters()}.values())
    grads = [p.grad for p in params]
    opacus = [(m, m.hooks_enabled) for m in _opacus_modules(roots)]
    try:
        for p in params:
            p.grad = None
        for m, _ in opacus:
            m.disable_hooks()
        for root in roots:
            root.eval()
        yield
    finally:
        for m, training in modes.items():
            m.training = training
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for m, enabled in opacus:
            m.hooks_enabled = enabled
        for g, state in generators:
            g.set_state(state)
        _restore_rng(rng)


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
