"""Queries: what a membership-inference attacker observes about each record.

A query maps a batch of records to scores of shape ``(n,)`` (scalar query) or ``(n, d)`` (vector
query) on the model's device. At every check the monitor calls ``query.prepare(device)``, then
the query on each member and non-member batch, then ``query.release()``, under
``torch.no_grad()`` with the query's ``modules`` in eval mode and every RNG restored; a query
never changes its modules' state. A batch is a tensor, an ``(x, y, ...)`` tuple or a mapping
(:mod:`~privmon.queries.batches`); ``transform=lambda batch: (x, y)`` adapts anything else.
``higher_is_member`` says whether members tend to score higher (None: unknown, or a vector).
Classifiers: :mod:`~privmon.queries.classifier`, :mod:`~privmon.queries.reference`; generative
models: :mod:`~privmon.queries.generative`, :mod:`~privmon.queries.generator`; causal language
models: :mod:`~privmon.queries.language_model`; diffusion models:
:mod:`~privmon.queries.diffusion`; table synthesizers (CTGAN, TVAE, SDV):
:mod:`~privmon.queries.synthesizers`. User guide: *Queries and attacks*.
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
from privmon.queries.diffusion import DiffusionQuery
from privmon.queries.generative import (
    DiscriminatorQuery,
    HybridQuery,
    MultiDiscriminatorQuery,
    NearestGeneratedQuery,
)
from privmon.queries.generator import GeneratorQuery
from privmon.queries.language_model import LanguageModelQuery, language_model_queries
from privmon.queries.reference import ReferenceModelQuery
from privmon.queries.synthesizers import SynthesizerQuery

__all__ = [
    "CallableQuery",
    "ConfidenceQuery",
    "CorrectnessQuery",
    "DiffusionQuery",
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
    "SynthesizerQuery",
    "language_model_queries",
]
