"""A causal language model's membership statistic per text, as a monitor query."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from privmon._validation import check_choice, check_fraction, check_int, check_module
from privmon.attacks.language_model import (
    HIGHER_IS_MEMBER,
    STATISTICS,
    Statistic,
    causal_lm_logits,
    decode_texts,
    lm_statistic,
)
from privmon.queries.base import Query
from privmon.queries.batches import Batch, Transform, split_batch, to_device

__all__ = ["LanguageModelQuery"]


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

    A text with no predicted token, or (Min-K%, Min-K%++) with ⌊k·T⌋ = 0, scores NaN, as in
    MIMIR; the monitor drops and counts such records.

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
        self.model = check_module(model, name="model")
        self.statistic = check_choice(statistic, STATISTICS, name="statistic")
        self.k = check_fraction(k, name="k")
        if chunk_tokens is not None:
            chunk_tokens = check_int(chunk_tokens, name="chunk_tokens", minimum=1)
        self.chunk_tokens = chunk_tokens
        if statistic == "zlib" and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(
                "statistic 'zlib' needs tokenizer= (with a decode method) to read each text, "
                f"got {type(tokenizer).__name__}"
            )
        if statistic == "reference":
            if reference is None:
                raise ValueError("statistic 'reference' needs reference= (a reference model)")
            check_module(reference, name="reference")
        self.tokenizer = tokenizer
        self.reference = reference if statistic == "reference" else None
        self.higher_is_member = HIGHER_IS_MEMBER[statistic]
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

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """The statistic of each text of ``batch``, shape (n,), on the model's device."""
        ids, mask, labels = self._inputs(batch)
        logits = causal_lm_logits(self.model, ids, mask)
        texts = decode_texts(self.tokenizer, ids, mask) if self.statistic == "zlib" else None
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
