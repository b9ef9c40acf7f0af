"""Classifier queries: what a classifier's output reveals about one labelled record (loss,
confidence, correctness, entropies, logit-scaled confidence) and a hidden layer's activations."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from privmon._shown import positions
from privmon._validation import check_module
from privmon.attacks.metric import logit_confidence_from_logits, modified_entropy_from_logits
from privmon.queries.base import Query
from privmon.queries.batches import (
    LABEL_KEYS,
    Batch,
    Transform,
    as_float,
    call_module,
    first_tensor,
)

__all__ = [
    "ClassifierQuery",
    "ConfidenceQuery",
    "CorrectnessQuery",
    "EntropyQuery",
    "HiddenLayerQuery",
    "LogitConfidenceQuery",
    "LossQuery",
    "ModifiedEntropyQuery",
]


class ClassifierQuery(Query):
    """Base of the classifier queries: the forward, the logits (n, C) and the checked labels (n,);
    each subclass turns them into its score."""

    def __init__(self, model: nn.Module, *, name: str, transform: Transform | None = None) -> None:
        self.model = check_module(model, name="model")
        super().__init__(name=name, modules=(model,), transform=transform)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        _, logits, y = self._forward_labelled(batch)
        return self._score(logits, y)

    def _forward_labelled(self, batch: Batch) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The batch's inputs, the model's logits (n, C) and the checked labels (n,)."""
        x, y = self._split(batch)
        if y is None:
            raise ValueError(
                f"{type(self).__name__} needs labels, but the batch has none: pass (x, y) tuples, "
                f"a dict with one of the label keys {LABEL_KEYS}, or transform=lambda batch: (x, y)"
            )
        logits = self._logits(call_module(self.model, x))
        return x, logits, self._labels(y, logits)

    @staticmethod
    def _logits(out: Any) -> torch.Tensor:
        z = first_tensor(out, "model")
        if not (z.is_floating_point()):
            raise ValueError(f"model returned a {z.dtype} tensor; expected float logits")
        z = as_float(z)
        if z.ndim == 1 or (z.ndim == 2 and z.shape[1] == 1):
            z = z.reshape(-1, 1)
            return torch.cat([torch.zeros_like(z), z], dim=1)  # binary logit z -> [0, z]
        if z.ndim == 3:  # (n, T, V): a language model's per-token logits
            raise ValueError(
                f"model returned logits of shape {tuple(z.shape)}; expected (n, C): for a "
                "language model's per-token logits use privmon.queries.LanguageModelQuery"
            )
        if z.ndim != 2:
            raise ValueError(
                f"model returned logits of shape {tuple(z.shape)}; expected (n, C) "
                "(use transform / CallableQuery for other outputs)"
            )
        return z

    @staticmethod
    def _labels(y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        n, c = logits.shape
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.ndim != 1 or y.shape[0] != n:
            raise ValueError(
                f"labels must be class indices of shape ({n},) matching the logits "
                f"{tuple(logits.shape)}, got shape {tuple(y.shape)}"
            )
        if y.is_floating_point():
            if not bool(torch.all(y == torch.round(y))):
                raise ValueError("labels must be class indices, got non-integer float labels")
        elif y.is_complex():
            raise ValueError("labels must be class indices, got complex labels")
        y = y.long()
        bad = (y < 0) | (y >= c)
        if bool(bad.any()):
            raise ValueError(
                f"labels must lie in [0, {c - 1}] for {c} classes; {positions(bad)} do not"
            )
        return y

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LossQuery(ClassifierQuery):
    """Per-record cross-entropy loss ``-log p_y`` (``F.cross_entropy(..., reduction="none")``).

    Args:
        model: the classifier; its output is read as logits (n, C) (:mod:`privmon.queries`).
        name: tag in reports.
        transform: optional ``batch -> (x, y)`` adapter.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import LossQuery
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 3)
        >>> x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 1])
        >>> scores = LossQuery(model)((x, y))
        >>> [round(s, 3) for s in scores.tolist()]
        [1.12, 1.707, 1.045, 0.619]
    """

    higher_is_member = False
    per_record_loss = True  # a LossTracing traces its members' losses and reports LOSS TNR

    def __init__(self, model: nn.Module, *, name: str = "loss", transform: Transform | None = None):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, reduction="none")


class ConfidenceQuery(ClassifierQuery):
    """Softmax probability of the true class, ``p_y`` (Song & Mittal's confidence metric).

    Arguments as for :class:`LossQuery`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import ConfidenceQuery, LossQuery
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 3)
        >>> batch = {"x": torch.randn(4, 4), "label": torch.tensor([0, 1, 2, 1])}  # a dict batch
        >>> confidence = ConfidenceQuery(model)(batch)
        >>> [round(p, 3) for p in confidence.tolist()]
        [0.326, 0.181, 0.352, 0.538]
        >>> torch.allclose(confidence, (-LossQuery(model)(batch)).exp())  # p_y = exp(-loss)
        True
    """

    higher_is_member = True

    def __init__(
        self, model: nn.Module, *, name: str = "confidence", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits, dim=1).gather(1, y[:, None]).squeeze(1).exp()


class CorrectnessQuery(ClassifierQuery):
    """1.0 when the arg-max class equals the label, else 0.0 (discrete: histogram estimators).

    Arguments as for :class:`LossQuery`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import CorrectnessQuery
        >>> _ = torch.manual_seed(0)
        >>> binary = nn.Linear(4, 1)  # one logit per record: class 1 when it is positive
        >>> x, y = torch.randn(4, 4), torch.tensor([0, 1, 1, 0])
        >>> CorrectnessQuery(binary)((x, y)).tolist()
        [0.0, 1.0, 1.0, 1.0]
    """

    discrete = True
    higher_is_member = True

    def __init__(
        self, model: nn.Module, *, name: str = "correct", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (logits.argmax(dim=1) == y).to(logits.dtype)


class EntropyQuery(ClassifierQuery):
    """Prediction entropy ``-sum_i p_i log p_i`` (label-free, but labels are still required).

    Arguments as for :class:`LossQuery`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import EntropyQuery
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 3)
        >>> batch = {"features": torch.randn(4, 4), "target": torch.tensor([0, 1, 2, 1])}
        >>> query = EntropyQuery(model, transform=lambda b: (b["features"], b["target"]))
        >>> [round(h, 3) for h in query(batch).tolist()]  # at most log(3) = 1.099
        [1.095, 1.029, 1.096, 0.98]
    """

    higher_is_member = False

    def __init__(
        self, model: nn.Module, *, name: str = "entropy", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=1)
        p = logp.exp()
        return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1)


class ModifiedEntropyQuery(ClassifierQuery):
    """Song & Mittal's modified entropy (their eq. 8), computed stably from the logits::

        Mentr = -(1 - p_y) log p_y - sum_{i != y} p_i log(1 - p_i)

    Never NaN / inf for finite logits: 0 for a perfectly confident correct prediction, finite for
    a confident wrong one (Theory page: *Modified entropy from logits*). Arguments as for
    :class:`LossQuery`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import ModifiedEntropyQuery
        >>> logits = torch.tensor([[50.0, -50.0, -50.0], [50.0, -50.0, -50.0]])
        >>> query = ModifiedEntropyQuery(nn.Identity())  # a "model" returning its input
        >>> [round(m, 2) for m in query((logits, torch.tensor([0, 1]))).tolist()]
        [0.0, 138.16]
    """

    higher_is_member = False

    def __init__(
        self, model: nn.Module, *, name: str = "mentr", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return modified_entropy_from_logits(logits, y)


class LogitConfidenceQuery(ClassifierQuery):
    """Logit-scaled confidence ``log(p_y / (1 - p_y)) = z_y - logsumexp_{i != y} z_i``.

    Computed by the identity on the right, so it stays finite (e.g. 100 for logits [50, -50]) where
    ``p_y`` rounds to 1. The scaling used by LiRA-style attacks: roughly Gaussian per record.
    Arguments as for :class:`LossQuery`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import LogitConfidenceQuery
        >>> logits = torch.tensor([[50.0, -50.0], [1.0, 1.0]])
        >>> query = LogitConfidenceQuery(nn.Identity())  # a "model" returning its input
        >>> query((logits, torch.tensor([0, 0]))).tolist()
        [100.0, 0.0]
    """

    higher_is_member = True

    def __init__(
        self, model: nn.Module, *, name: str = "logit_conf", transform: Transform | None = None
    ):
        super().__init__(model, name=name, transform=transform)

    def _score(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return logit_confidence_from_logits(logits, y)


class HiddenLayerQuery(Query):
    """Activations of a submodule ``layer`` of ``model``, flattened to (n, d) (MACE App. G).

    A forward hook is attached to ``layer`` only during each call (never during training), and
    the captured output is cloned, so an in-place op later in the forward cannot alter it. A tuple
    output gives its first tensor; a layer run several times in one forward gives its last run.
    Labels are not needed.

    Args:
        model: the model whose forward is run.
        layer: a submodule of ``model``, or its qualified name (``model.get_submodule``).
        name: tag in reports.
        transform: optional ``batch -> (x, y)`` adapter.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import HiddenLayerQuery
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> query = HiddenLayerQuery(model, "1")  # the ReLU's output
        >>> query(torch.randn(5, 4)).shape
        torch.Size([5, 8])
    """

    def __init__(
        self,
        model: nn.Module,
        layer: nn.Module | str,
        *,
        name: str = "hidden",
        transform: Transform | None = None,
    ) -> None:
        self.model = check_module(model, name="model")
        if isinstance(layer, str):
            try:
                layer = model.get_submodule(layer)
            except AttributeError:
                raise ValueError(f"layer {layer!r} is not a submodule name of model") from None
        check_module(layer, name="layer")
        if not any(m is layer for m in model.modules()):
            raise ValueError("layer must be a submodule of model")
        self.layer = layer
        super().__init__(name=name, modules=(model,), transform=transform)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, _ = self._split(batch)
        captured: list[torch.Tensor] = []

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            captured[:] = [first_tensor(output, "layer").detach().clone()]

        handle = self.layer.register_forward_hook(hook)
        try:
            call_module(self.model, x)
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(f"{self.name}: the layer did not run during model's forward pass")
        h = captured[0]
        if h.ndim == 0:
            raise ValueError(f"{self.name}: the layer returned a scalar; expected (n, ...)")
        return as_float(h.reshape(h.shape[0], -1))

    def release(self) -> None:
        """Nothing is cached between calls; the hook only lives inside a call."""
