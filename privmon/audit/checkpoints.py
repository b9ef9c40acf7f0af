"""A checkpoint folder: what each trained model gave, one file per model, saved as soon as it
is trained, so that an interrupted audit resumes without retraining what was saved.

File ``{kind}-{i:06d}.pt`` (``torch.save``) holds model i's *fingerprint* (its seed, its mask
and whatever else makes it model i, under ``identity``), the *recipe* (fingerprints of what
every model of the audit shares: data, architecture, optimizer, ...; :func:`digest`,
:func:`qualified_name`) and its contents (parameters, or scores). A later call loads a file
only when recipe and fingerprint match the call's, and otherwise refuses, naming what differs.
Files are read with ``torch.load(weights_only=True)`` (tensors, numbers, strings and containers
only: no code runs on loading) and written to a temporary name first, then renamed, so a
process killed while saving leaves no half-written file under the final name.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from privmon._validation import check_writable_dir

__all__ = ["CheckpointFolder", "digest", "portable", "qualified_name"]

FORMAT = "privmon.audit.checkpoint/1"


def digest(*arrays: Any) -> str:
    """SHA-256 (hex) over the dtype, shape and bytes of each array / tensor (None counts as
    itself): equal exactly when the arrays are equal element by element, on any device."""
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"None;")
            continue
        t = a.detach() if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
        t = t.to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def qualified_name(fn: Any) -> str:
    """``module.qualname`` of a function or of a callable object's class: what a fingerprint
    can say of code (a changed body under the same name goes unnoticed)."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}.{target.__qualname__}"


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
        record = {
            "format": FORMAT,
            "kind": self.kind,
            "index": i,
            "recipe": self.recipe,
            "identity": portable(fingerprint),
            "contents": portable(contents),
        }
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
