"""Queries: what a membership-inference attacker observes about one record.

A query maps a batch of records to scores of shape ``(n,)`` (scalar query) or ``(n, d)`` (vector
query), computed on the model's device. The monitor runs every query, once per check, as::

    query.prepare(device)          # once, before any batch (e.g. draw generated samples)
    query(batch) -> scores         # every member and non-member batch
    query.release()                # once, after the check: per-check caches are dropped

inside ``torch.no_grad()``, with every module in ``query.modules`` in eval mode, and with every RNG
restored afterwards (so queries may draw random numbers from the global torch RNG). Queries never
change module state: no ``.train()`` / ``.eval()`` calls, no parameter or buffer writes, and no hook
left attached outside a call.

Batch convention
----------------
A batch is one of

* a tensor ``x`` (no labels);
* a tuple or list ``(x, y, ...)``: the first element is the input, the second (if any) the label,
  the rest is ignored;
* a mapping with an input under the first present key of ``"x"``, ``"input"``, ``"inputs"``,
  ``"input_ids"`` and a label under the first present key of ``"y"``, ``"label"``, ``"labels"``,
  ``"target"`` (the label is optional).

Anything else is adapted with ``transform``, which every query (except :class:`CallableQuery`,
whose function sees the raw batch) accepts: ``transform(batch) -> (x, y)`` with ``y`` possibly
``None``. Tensors and numpy arrays in ``x`` and ``y`` are moved to the model's device (the device
of its first parameter, else of its first buffer, else the CPU). If ``x`` is itself a tuple /
list it is unpacked as positional arguments, and if it is a mapping as keyword arguments, so
``transform=lambda b: ({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]},
b["labels"])`` calls ``model(input_ids=..., attention_mask=...)``.

Classifier queries read the model's output as logits of shape ``(n, C)``; an output with a
``logits`` attribute or key (Hugging Face) or a tuple (first element) is unwrapped. A single logit
per record (shape ``(n,)`` or ``(n, 1)``, the ``BCEWithLogitsLoss`` convention) is read as a binary
classifier's logit ``z`` for class 1 and expanded to the two-class logits ``[0, z]``. Labels are
class indices (integer, bool, or floats holding whole numbers), shape ``(n,)`` or ``(n, 1)``.

Score direction (``higher_is_member``): members tend to score higher for confidence, correctness,
logit confidence and discriminator outputs, lower for loss, entropy, modified entropy and the
distance to the nearest generated sample; ``None`` for vector queries and when unknown. The
advantage estimators do not need it; direction-dependent figures such as the AUC can use it.

Layout: :mod:`~privmon.queries.base` (the protocol and :class:`CallableQuery`),
:mod:`~privmon.queries.classifier`, :mod:`~privmon.queries.generative`,
:mod:`~privmon.queries.generator` (DOMIAS and its baselines on a generator's synthetic data),
:mod:`~privmon.queries.reference` (reference-model attacks),
:mod:`~privmon.queries.language_model` (causal language models: loss, zlib, Min-K%, Min-K%++,
reference); the batch convention above lives in
:mod:`~privmon.queries.batches`.
"""

from privmon.queries.base import CallableQuery, Query
from privmon.queries.classifier import (
    ConfidenceQuery,
    CorrectnessQuery,
    EntropyQuery,
    HiddenLayerQuery,
    LogitConfidenceQuery,
    LossQuery,
    ModifiedEntropyQuery,
)
from privmon.queries.generative import (
    DiscriminatorQuery,
    HybridQuery,
    MultiDiscriminatorQuery,
    NearestGeneratedQuery,
)
from privmon.queries.generator import GeneratorQuery
from privmon.queries.language_model import LanguageModelQuery, language_model_queries
from privmon.queries.reference import ReferenceModelQuery

__all__ = [
    "CallableQuery",
    "ConfidenceQuery",
    "CorrectnessQuery",
    "DiscriminatorQuery",
    "EntropyQuery",
    "GeneratorQuery",
    "HiddenLayerQuery",
    "HybridQuery",
    "LanguageModelQuery",
    "LogitConfidenceQuery",
    "LossQuery",
    "ModifiedEntropyQuery",
    "MultiDiscriminatorQuery",
    "NearestGeneratedQuery",
    "Query",
    "ReferenceModelQuery",
    "language_model_queries",
]
