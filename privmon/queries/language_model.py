"""A causal language model's membership statistics per text, as monitor queries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from privmon._validation import (
    check_fraction,
    check_int,
    check_materialized,
    check_module,
    check_subset,
)
from privmon.attacks.language_model import (
    STATISTICS,
    Statistic,
    causal_lm_logits,
    decode_texts,
    lm_statistic,
)
from privmon.attacks.lm_statistics import lm_statistic_of, registered_lm_statistics
from privmon.queries.base import Query
from privmon.queries.batches import Batch, Transform, split_batch, tensor_digest, to_device

__all__ = ["LanguageModelQuery", "language_model_queries"]


class _SharedLogits:
    """The last batch's logits of one model, shared by the queries built together and kept
    only during a check (from ``prepare`` to ``release``, while the model cannot change): the
    monitor runs every query on a batch before the next batch, so one forward serves them all.
    Keyed by the content of the batch's ids and mask."""

    def __init__(self, *, shared: bool) -> None:
        self.shared = shared  # a query built alone keeps nothing
        self.open = False
        self.key: tuple[Any, ...] | None = None
        self.logits: torch.Tensor | None = None

    def get(self, model: nn.Module, ids: torch.Tensor, mask: Any) -> torch.Tensor:
        if not (self.open and self.shared):
            return causal_lm_logits(model, ids, mask)
        key = (tensor_digest(ids), None if mask is None else tensor_digest(mask))
        if self.logits is None or key != self.key:
            self.logits = None  # the previous batch's logits go before the next forward
            self.logits, self.key = causal_lm_logits(model, ids, mask), key
        return self.logits

    def close(self) -> None:
        self.open, self.key, self.logits = False, None, None


class LanguageModelQuery(Query):
    """One membership statistic per text of a causal language model, shape (n,).

    ``statistic`` is one of ``"loss"``, ``"zlib"``, ``"min_k"``, ``"min_k_plus_plus"``,
    ``"reference"``: the formulas, their sources, which tokens count and the memory bound are
    in :mod:`privmon.attacks.language_model`; ``higher_is_member`` is set per statistic (Min-K%
    and Min-K%++ higher, the others lower). Each record's score equals the statistic of its
    text alone, unpadded, whichever side the batch is padded on.

    Batches are what a Hugging Face data collator gives: a mapping with ``input_ids``, and
    optionally ``attention_mask`` (right or left padding; padding never counts) and ``labels``
    (positions labelled -100 are context, not scored). A tensor batch is ``input_ids`` without
    padding. ``transform(batch) -> (x, labels)`` adapts anything else, ``x`` a mapping with
    ``input_ids`` (and ``attention_mask``) or a tensor of ids. A left-padded batch is scored
    with ``position_ids`` from its mask (:func:`~privmon.attacks.causal_lm_logits`).

    A text with no predicted token (one token long, even in a batch of such texts), or
    (Min-K%, Min-K%++) with ⌊k·T⌋ = 0, scores NaN, as in MIMIR; the monitor drops and counts
    such records. A model (or reference) whose weights are on the meta device is refused here;
    a model returning a tuple is read as logits first
    (:func:`~privmon.attacks.causal_lm_logits`).

    Args:
        model: the causal language model being trained (a Hugging Face ``…ForCausalLM`` or any
            module taking ``input_ids`` / ``attention_mask`` and returning logits (n, L, V)).
        statistic: which statistic.
        k: the fraction of lowest tokens Min-K% / Min-K%++ average, in (0, 1] (default 0.2).
        tokenizer: for ``"zlib"`` (required there): each text is ``tokenizer.decode`` of its
            unpadded ids with ``skip_special_tokens=True``
            (:func:`~privmon.attacks.decode_texts`), compressed as UTF-8 with ``zlib``.
        reference: for ``"reference"`` (required there): a reference causal language model on
            the same tokenizer (e.g. the pretrained model before fine-tuning), in eval mode
            during checks like ``model``.
        name: tag in reports (default: the statistic).
        transform: optional batch adapter (see above).
        chunk_tokens: positions per chunk of the vocabulary-wide work (default ⌊2²²/V⌋).

    Examples:
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from privmon.queries import LanguageModelQuery
        >>> _ = torch.manual_seed(0)
        >>> config = GPT2Config(
        ...     n_layer=1, n_embd=8, n_head=2, vocab_size=20, bos_token_id=0, eos_token_id=0
        ... )
        >>> model = GPT2LMHeadModel(config).eval()  # the monitor sets eval mode during checks
        >>> batch = {"input_ids": torch.randint(1, 20, (3, 6)), "attention_mask": torch.ones(3, 6)}
        >>> query = LanguageModelQuery(model, "min_k", k=0.5)
        >>> query.name, query.higher_is_member, query(batch).shape
        ('min_k', True, torch.Size([3]))
    """

    def __init__(
        self,
        model: nn.Module,
        statistic: Statistic,
        *,
        k: float = 0.2,
        tokenizer: Any = None,
        reference: nn.Module | None = None,
        name: str | None = None,
        transform: Transform | None = None,
        chunk_tokens: int | None = None,
    ) -> None:
        self.model = check_materialized(check_module(model, name="model"), name="model")
        stat = lm_statistic_of(statistic)
        self.statistic = stat.name
        self.k = check_fraction(k, name="k")
        if chunk_tokens is not None:
            chunk_tokens = check_int(chunk_tokens, name="chunk_tokens", minimum=1)
        self.chunk_tokens = chunk_tokens
        if stat.reads_texts and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(
                f"statistic {stat.name!r} needs tokenizer= (with a decode method) to read each "
                f"text, got {type(tokenizer).__name__}"
            )
        if stat.reads_reference:
            if reference is None:
                raise ValueError(f"statistic {stat.name!r} needs reference= (a reference model)")
            check_materialized(check_module(reference, name="reference"), name="reference")
        self.tokenizer = tokenizer
        self._logits = _SharedLogits(shared=False)
        self.reference = reference if stat.reads_reference else None
        self.higher_is_member = stat.higher_is_member
        self._reads_texts = stat.reads_texts
        modules = (model,) if self.reference is None else (model, self.reference)
        super().__init__(
            name=statistic if name is None else name, modules=modules, transform=transform
        )

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, Any, Any]:
        """(input_ids, attention_mask or None, labels or None) on the model's device."""
        if self.transform is None and isinstance(batch, Mapping) and "input_ids" in batch:
            x, labels = batch, batch.get("labels")
        else:
            x, labels = split_batch(batch, self.device, self.transform)
        if isinstance(x, Mapping):
            if "input_ids" not in x:
                raise ValueError(
                    f"{self.name}: the batch has no input_ids (keys: {sorted(map(str, x))}); "
                    "pass transform=lambda batch: ({'input_ids': ..., 'attention_mask': ...}, "
                    "labels)"
                )
            ids, mask = x["input_ids"], x.get("attention_mask")
        else:
            ids, mask = x, None
        ids, mask, labels = to_device((ids, mask, labels), self.device)
        return ids, mask, labels

    def prepare(self, device: Any = None) -> None:
        """Start a check: the queries built together by :func:`language_model_queries` share
        each batch's forward pass until :meth:`release`."""
        self._logits.open = True

    def release(self) -> None:
        """End a check: drop the shared logits."""
        self._logits.close()

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """The statistic of each text of ``batch``, shape (n,), on the model's device."""
        ids, mask, labels = self._inputs(batch)
        logits = self._logits.get(self.model, ids, mask)
        texts = decode_texts(self.tokenizer, ids, mask) if self._reads_texts else None
        reference_logits = (
            causal_lm_logits(self.reference, ids, mask) if self.reference is not None else None
        )
        return lm_statistic(
            logits,
            ids,
            mask,
            statistic=self.statistic,
            labels=labels,
            k=self.k,
            texts=texts,
            reference_logits=reference_logits,
            chunk_tokens=self.chunk_tokens,
        )


def language_model_queries(
    model: nn.Module,
    statistics: Sequence[str] = STATISTICS,
    *,
    k: float = 0.2,
    tokenizer: Any = None,
    reference: nn.Module | None = None,
    transform: Transform | None = None,
    chunk_tokens: int | None = None,
) -> list[LanguageModelQuery]:
    """One :class:`LanguageModelQuery` per statistic, named by it, sharing one forward pass of
    ``model`` per batch during a check (the scores are those of separate queries).

    Args:
        model: the causal language model.
        statistics: which statistics (default: all five; "zlib" needs ``tokenizer``,
            "reference" needs ``reference``).
        k, tokenizer, reference, transform, chunk_tokens: as for :class:`LanguageModelQuery`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import language_model_queries
        >>> class TinyLM(nn.Module):  # any module mapping input_ids to logits (n, L, V)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed, self.head, self.calls = nn.Embedding(20, 8), nn.Linear(8, 20), 0
        ...     def forward(self, input_ids, attention_mask=None):
        ...         self.calls += 1
        ...         return self.head(self.embed(input_ids))
        >>> model = TinyLM()
        >>> queries = language_model_queries(model, ["loss", "min_k", "min_k_plus_plus"])
        >>> batch = {"input_ids": torch.randint(1, 20, (3, 6))}
        >>> for q in queries:  # what the monitor does at a check
        ...     q.prepare()
        >>> {q.name: tuple(q(batch).shape) for q in queries}
        {'loss': (3,), 'min_k': (3,), 'min_k_plus_plus': (3,)}
        >>> model.calls  # one forward served all three
        1
        >>> for q in queries:
        ...     q.release()
    """
    names = check_subset(statistics, registered_lm_statistics(), name="statistics")
    queries = [
        LanguageModelQuery(
            model,
            cast(Statistic, s),
            k=k,
            tokenizer=tokenizer,
            reference=reference,
            transform=transform,
            chunk_tokens=chunk_tokens,
        )
        for s in names
    ]
    shared = _SharedLogits(shared=True)
    for q in queries:
        q._logits = shared
    return queries
