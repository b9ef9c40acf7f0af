"""A checkpoint folder: what each trained model gave, one file per model, saved as soon as it
is trained, so that an interrupted audit resumes without retraining what was saved.

File ``{kind}-{i:06d}.pt`` (``torch.save``) holds model i's *fingerprint* (its seed, its mask
and whatever else makes it model i, under ``identity``), the *recipe* (fingerprints of what
every model of the audit shares: data, architecture, optimizer, ...: digests of arrays,
:func:`qualified_name`, :func:`code_digest`), its contents (parameters, or scores) and a digest
of all of it. A later call loads a file only when the digest, recipe and fingerprint match the
call's, and otherwise refuses, naming what differs (a flipped bit: the file is damaged).
Files are read with ``torch.load(weights_only=True)`` (tensors, numbers, strings and containers
only: no code runs on loading) and written to a temporary name first, then renamed, so a
process killed while saving leaves no half-written file under the final name.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from privmon._digest import DIGEST_KEY, content_digest, sealed
from privmon._validation import check_writable_dir

__all__ = ["CheckpointFolder", "code_digest", "portable", "qualified_name"]

FORMAT = "privmon.audit.checkpoint/1"


_MAIN_ALIASES = ("__mp_main__",)  # the main script, as multiprocessing's spawn imports it


def qualified_name(fn: Any) -> str:
    """``module.qualname`` of a function or of a callable object's class: what a fingerprint
    can say of the name. The main script's functions are ``__main__.…`` in every process (a
    process that ``mp.spawn`` or multiprocessing's spawn starts imports it as
    ``__mp_main__``)."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None) or "?"
    return f"{'__main__' if module in _MAIN_ALIASES else module}.{target.__qualname__}"


def code_digest(fn: Any) -> str:
    """SHA-256 (hex) of what a function's code does: its bytecode, constants (nested functions'
    code too), names and argument layout — not its file, line numbers or module, so it is the
    same in every process that runs the same source (under the same Python). A method or a
    callable object counts by its ``__call__``'s code, a ``functools.partial`` by its
    function's and the literals it binds, a callable without Python code (a builtin) by its
    qualified name.

    Examples:
        >>> from privmon.audit.checkpoints import code_digest
        >>> def double(x):
        ...     return 2 * x
        >>> def triple(x):
        ...     return 3 * x
        >>> code_digest(double) == code_digest(lambda x: 2 * x)  # the same code, another name
        True
        >>> code_digest(double) == code_digest(triple)
        False
    """
    h = hashlib.sha256()
    _hash_callable(h, fn)
    return h.hexdigest()


def _hash_callable(h: Any, fn: Any) -> None:
    if isinstance(fn, functools.partial):  # its function's code, and what it binds
        _hash_callable(h, fn.func)
        h.update(f"partial{_literal(fn.args)}{_literal(sorted(fn.keywords.items()))};".encode())
        return
    code = _code_of(fn)
    if code is None:
        h.update(qualified_name(fn).encode())
    else:
        _hash_code(h, code)


def _literal(value: Any) -> str:
    """``value``'s repr when it is a plain literal (or a tuple / list of them), else its type's
    name: a repr may hold a memory address, which differs from process to process."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, tuple | list):
        return f"({','.join(map(_literal, value))})"
    return f"<{type(value).__qualname__}>"


def _code_of(fn: Any) -> types.CodeType | None:
    owners = () if isinstance(fn, types.FunctionType) else type(fn).__mro__
    call = next((c.__dict__["__call__"] for c in owners if "__call__" in c.__dict__), None)
    for target in (fn, getattr(fn, "__func__", None), call):
        code = getattr(target, "__code__", None)
        if isinstance(code, types.CodeType):
            return code
    return None


def _hash_code(h: Any, code: types.CodeType) -> None:
    h.update(code.co_code)
    layout = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
    h.update(f"{layout}{code.co_names}{code.co_varnames}{code.co_freevars};".encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _hash_code(h, const)
        elif isinstance(const, frozenset):  # its order varies with the strings' hash seed
            h.update(f"frozenset{sorted(map(repr, const))};".encode())
        else:
            h.update(f"{type(const).__name__}:{_literal(const)};".encode())


def _shown(value: str) -> str:
    return f"'{value[:12]}...'" if re.fullmatch(r"[0-9a-f]{64}", value) else repr(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def _difference(key: str, saved: Any, wanted: Any) -> str:
    if isinstance(wanted, torch.Tensor) and isinstance(saved, torch.Tensor):
        if saved.shape == wanted.shape and saved.dtype == wanted.dtype:
            n = int((saved.cpu() != wanted.cpu()).sum())
            return f"its {key} differs in {n} of {wanted.numel()} entries"
        return f"its {key} has shape {tuple(saved.shape)}, here {tuple(wanted.shape)}"
    if isinstance(saved, str) and isinstance(wanted, str):
        return f"its {key} is {_shown(saved)}, here {_shown(wanted)}"
    return f"its {key} is {saved!r}, here {wanted!r}"


class CheckpointFolder:
    """The files of one audit's models in ``folder`` (created when missing).

    Args:
        folder: the directory (``checkpoint_dir``).
        kind: the file prefix, one per kind of audit (``"model"``, ``"specific"``, ...).
        recipe: name -> string fingerprint of what every model shares; a file saved with
            another recipe is refused, naming the entries that differ.
        what: the caller's name, for messages.
    """

    def __init__(self, folder: Any, *, kind: str, recipe: Mapping[str, str], what: str) -> None:
        self.folder = check_writable_dir(folder, name="checkpoint_dir")
        os.makedirs(self.folder, exist_ok=True)
        self.kind, self.recipe, self.what = kind, dict(recipe), what
        self._pattern = re.compile(rf"{re.escape(kind)}-(\d{{6}})\.pt")

    def path(self, i: int) -> str:
        """The file of model ``i``."""
        return os.path.join(self.folder, f"{self.kind}-{i:06d}.pt")

    def present(self, n_models: int) -> list[int]:
        """The indices below ``n_models`` that have a file (files of further models, e.g. from
        an audit of more models, are left alone)."""
        found = (self._pattern.fullmatch(f) for f in os.listdir(self.folder))
        return sorted(i for m in found if m is not None and (i := int(m.group(1))) < n_models)

    def save(self, i: int, fingerprint: Mapping[str, Any], contents: Mapping[str, Any]) -> None:
        """Write model ``i``'s file: its ``fingerprint`` (e.g. seed, mask) and ``contents``
        (tensors are saved from the CPU, each as a copy of its own)."""
        record: dict[str, Any] = {
            "format": FORMAT,
            "kind": self.kind,
            "index": i,
            "recipe": self.recipe,
            "identity": portable(fingerprint),
            "contents": portable(contents),
        }
        record = sealed(record)
        final = self.path(i)
        partial = f"{final}.{os.getpid()}.partial"
        torch.save(record, partial)
        os.replace(partial, final)

    def load(self, i: int, fingerprint: Mapping[str, Any]) -> dict[str, Any]:
        """Model ``i``'s contents (on the CPU), after checking its file was saved by this
        recipe for this fingerprint.

        Raises:
            ValueError naming the file and what differs: another recipe or fingerprint, or a file
                that cannot be read (remove it and that model is trained again).
        """
        path = self.path(i)
        try:
            record = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a damaged file fails anywhere in the unpickler
            raise ValueError(
                f"{self.what}: checkpoint_dir file {path} cannot be read "
                f"({type(err).__name__}: {str(err).splitlines()[0]}); remove it and that "
                "model is trained again"
            ) from err
        if (
            not isinstance(record, dict)
            or record.get("format") != FORMAT
            or record.get("kind") != self.kind
            or record.get("index") != i
        ):
            raise ValueError(
                f"{self.what}: checkpoint_dir file {path} is not a privmon {self.kind} "
                f"checkpoint of model {i} ({FORMAT})"
            )
        if record.get(DIGEST_KEY) != content_digest(record):
            old = (
                " (it has none: written by an earlier privmon)" if DIGEST_KEY not in record else ""
            )
            raise ValueError(
                f"{self.what}: checkpoint_dir file {path} is damaged: what it holds (the "
                "model's parameters, scores, fingerprint or recipe) no longer matches the digest "
                "saved with it"
                f"{old}; remove it and that model is trained again"
            )
        saved = record["recipe"]
        differs = [
            f"{k} ({_shown(saved.get(k, 'nothing'))} in the folder, "
            f"{_shown(self.recipe.get(k, 'nothing'))} here)"
            for k in sorted(saved.keys() | self.recipe.keys())
            if saved.get(k) != self.recipe.get(k)
        ]
        if differs:
            raise ValueError(
                f"{self.what}: checkpoint_dir {self.folder} holds models of another recipe: "
                f"{'; '.join(differs)} differ{'s' if len(differs) == 1 else ''}. Use another "
                "folder, or empty this one to retrain"
            )
        wanted = portable(fingerprint)
        mismatch = [
            _difference(k, record["identity"].get(k), v)
            for k, v in wanted.items()
            if not _same(record["identity"].get(k), v)
        ]
        if mismatch:
            raise ValueError(
                f"{self.what}: checkpoint_dir file {path} holds another model {i}: "
                f"{'; '.join(mismatch)}. Use another folder, or empty this one to retrain"
            )
        return record["contents"]


def portable(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (nested maps too) ready to save or to send to another process: tensors as CPU
    copies of their own (a view would save its whole storage); numpy arrays
    as tensors; numpy scalars as Python numbers: what ``weights_only`` loading accepts."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, Mapping):
            out[k] = portable(v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().to("cpu", copy=True)
        elif isinstance(v, np.ndarray):
            out[k] = torch.from_numpy(np.array(v, copy=True))
        elif isinstance(v, np.generic):
            out[k] = v.item()
        else:
            out[k] = v
    return out
