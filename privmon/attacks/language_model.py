"""Membership statistics of causal language models, per text, from a padded batch.

A text of T + 1 tokens has T predicted tokens, each x_t given its prefix x_<t and read from the
logits at position t − 1 (``logits[:, t]`` predicts ``input_ids[:, t + 1]``, the Hugging Face
convention). :func:`lm_statistic` reduces them to one score per text (:data:`STATISTICS`; the
direction of each in :data:`HIGHER_IS_MEMBER`):

- ``loss``: the mean negative log-likelihood L(x) (Yeom et al., "Privacy Risk in Machine
  Learning");
- ``zlib``: L(x) over the text's zlib-compressed size (Carlini et al., "Extracting Training Data
  from Large Language Models");
- ``min_k``: the mean of the ⌊k·T⌋ lowest token log-probabilities (Shi et al., "Detecting
  Pretraining Data from Large Language Models");
- ``min_k_plus_plus``: the same over the tokens' z-scores under the model's vocabulary
  distribution (Zhang et al., "Min-K%++: Improved Baseline for Detecting Pre-Training Data from
  Large Language Models");
- ``reference``: L_target(x) − L_reference(x) on the same tokens.

The vocabulary-wide work runs in chunks of ``chunk_tokens`` positions, never on an (n, T, V) copy
of the logits. Inputs are torch tensors (numpy arrays are converted) on any device; results are
tensors on the logits' device, computed without gradients. The formulas, short texts and the
memory bound: docs, Theory page, *Language-model statistics*.
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

# nothing from privmon.queries: its language-model query imports this module
from privmon._shown import positions
from privmon._validation import (
    as_mask,
    as_tensor,
    check_fraction,
    check_int,
    check_materialized,
    check_module,
)
from privmon.attacks.lm_statistics import STATISTICS as LM_STATISTICS
from privmon.attacks.lm_statistics import TokenInputs, lm_statistic_of

__all__ = [
    "CHUNK_ELEMENTS",
    "HIGHER_IS_MEMBER",
    "IGNORE_INDEX",
    "STATISTICS",
    "causal_lm_logits",
    "decode_texts",
    "lm_statistic",
    "lowest_k_mean",
    "predicted_tokens",
    "token_log_probs",
    "token_z_scores",
    "zlib_sizes",
]

Statistic = Literal["loss", "zlib", "min_k", "min_k_plus_plus", "reference"]

IGNORE_INDEX = -100
"""The label value Hugging Face losses ignore: a token with this label is never counted."""

CHUNK_ELEMENTS = 2**22
"""Default size of one chunk's (positions × vocabulary) block: ``chunk_tokens = ⌊2²²/V⌋``."""


# --- which tokens count -------------------------------------------------------------------------


def _integer_matrix(values: Any, *, name: str, columns: int = 1) -> torch.Tensor:
    """``values`` as an int64 (n, L) tensor, n ≥ 1 and L ≥ ``columns`` (0 for the targets of
    texts of one token, which predict nothing)."""
    what = "an integer array of shape (n, L)"
    t = as_tensor(values, name=name, what=what)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.ndim != 2:
        raise ValueError(f"{name} must be {what}, got {t.dtype} of shape {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] < columns:
        raise ValueError(f"{name} is empty: shape {tuple(t.shape)}")
    return t.long()


def predicted_tokens(
    input_ids: Any, attention_mask: Any = None, *, labels: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The predicted tokens of each text of a padded batch.

    Args:
        input_ids: token ids, shape (n, L), right or left padded.
        attention_mask: 1 for a text's tokens, 0 for padding, shape (n, L); one block of ones
            per row (packed sequences are refused). None: every token is a text's.
        labels: optional Hugging Face labels, shape (n, L): positions labelled
            :data:`IGNORE_INDEX` (-100) are not predicted, the others' targets are the labels.

    Returns:
        ``(targets, counted)``, both of shape (n, L − 1) on ``input_ids``' device: column t is
        the token at position t + 1 (read from the logits at position t) and whether it counts:
        ``attention_mask`` is 1 at t and t + 1 (so a text's first token is never predicted) and
        its label is not -100.

    Examples:
        >>> import torch
        >>> from privmon.attacks import predicted_tokens
        >>> input_ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])  # right padded
        >>> attention_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
        >>> targets, counted = predicted_tokens(input_ids, attention_mask)
        >>> targets
        tensor([[6, 7, 0],
                [9, 0, 0]])
        >>> counted
        tensor([[ True,  True, False],
                [ True, False, False]])
    """
    ids = _integer_matrix(input_ids, name="input_ids")
    n, length = ids.shape
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        mask = as_mask(attention_mask, name="attention_mask", shape=(n, length), device=ids.device)
        # a row's ones form one block: at most one 0 -> 1 step, counting a 1 in the first column
        starts = (mask[:, 1:] & ~mask[:, :-1]).sum(dim=1) + mask[:, 0]
        if bool((starts > 1).any()):
            row = int(torch.nonzero(starts > 1)[0, 0])
            raise ValueError(
                f"attention_mask row {row} has padding between tokens: each row must be one text "
                "padded on the right and/or the left (packed sequences are not supported)"
            )
    counted = mask[:, 1:] & mask[:, :-1]
    targets = ids[:, 1:]
    if labels is not None:
        lab = _integer_matrix(labels, name="labels").to(ids.device)
        if lab.shape != ids.shape:
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(ids.shape)}, "
                f"got {tuple(lab.shape)}"
            )
        targets = lab[:, 1:]
        counted = counted & (targets != IGNORE_INDEX)
    return targets, counted


# --- per-token values, in chunks ------------------------------------------------------------------


def _logits_of(output: Any, *, source: str = "logits is") -> torch.Tensor:
    """The logits tensor of a model output: a tensor, ``.logits`` / ``["logits"]``, or a
    tuple's first element (a Hugging Face model called with ``return_dict=False`` and no labels
    gives ``(logits, cache, ...)``)."""
    if isinstance(output, Mapping) and "logits" in output:
        output = output["logits"]
    output = getattr(output, "logits", output)
    if isinstance(output, tuple | list):
        if not output:
            raise ValueError(
                f"{source} an empty {type(output).__name__}: expected the logits (n, L, V), "
                "alone, as .logits or first in a tuple"
            )
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ValueError(
            f"logits must be a tensor of shape (n, L, V) or a model output with .logits (or a "
            f"tuple, the logits first), got {type(output).__name__}"
        )
    return output


def _checked_logits(logits: Any, targets: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    z = _logits_of(logits)
    if not z.is_floating_point() or z.ndim != 3:
        raise ValueError(
            f"logits must be a float tensor of shape (n, L, V), got {z.dtype} of shape "
            f"{tuple(z.shape)}"
        )
    n, width = targets.shape
    if tuple(z.shape[:2]) != (n, width + 1) or tuple(counted.shape) != (n, width):
        raise ValueError(
            f"logits of shape {tuple(z.shape)} do not match targets {tuple(targets.shape)} and "
            f"counted {tuple(counted.shape)}: expected logits (n, L, V) with targets and counted "
            "(n, L - 1), as predicted_tokens gives them"
        )
    vocab = z.shape[2]
    ids = targets.to(z.device)
    outside = counted.to(z.device) & ((ids < 0) | (ids >= vocab))
    if bool(outside.any()):
        raise ValueError(
            f"token ids must lie in [0, {vocab - 1}] for logits over {vocab} tokens; "
            f"{positions(outside)} (record, position) pairs hold one outside it"
        )
    return z


def _compute_dtype(z: torch.Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def _blocks(n: int, length: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(records, positions) blocks of at most ``rows`` positions, or of whole records when a
    record fits: every block of a contiguous (n, L, V) tensor is a contiguous view."""
    if rows >= length:
        group = rows // length
        for i in range(0, n, group):
            yield slice(i, i + group), slice(0, length)
    else:
        for i in range(n):
            for s in range(0, length, rows):
                yield slice(i, i + 1), slice(s, s + rows)


def _per_token(
    logits: Any,
    targets: Any,
    counted: Any,
    chunk_tokens: int | None,
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``reduce(log_probs, target_ids)`` over blocks of positions: ``log_probs`` the block's
    log-softmax (g, c, V) in the compute dtype, owned by ``reduce`` (it may overwrite it);
    returns (n, L − 1) values, NaN where not counted."""
    tgt = _integer_matrix(targets, name="targets", columns=0)  # (n, 0): texts of one token
    cnt = as_mask(counted, name="counted", shape=tuple(tgt.shape), device=tgt.device)
    z = _checked_logits(logits, tgt, cnt)
    n, length, vocab = z.shape
    rows = (
        max(1, CHUNK_ELEMENTS // vocab)
        if chunk_tokens is None
        else check_int(chunk_tokens, name="chunk_tokens", minimum=1)
    )
    dtype = _compute_dtype(z)
    cnt = cnt.to(z.device)
    # full width L (the last position predicts nothing): blocks of whole records stay views
    full = torch.zeros((n, length), dtype=torch.long, device=z.device)
    full[:, :-1] = torch.where(cnt, tgt.to(z.device), 0)  # a pad id may lie outside the vocabulary
    out = torch.empty((n, length), dtype=dtype, device=z.device)
    for recs, pos in _blocks(n, length, rows):
        log_probs = torch.log_softmax(z[recs, pos], dim=-1, dtype=dtype)
        out[recs, pos] = reduce(log_probs, full[recs, pos])
        del log_probs
    values = out[:, :-1]
    return torch.where(cnt, values, torch.full_like(values, math.nan))


def _target_log_prob(log_probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _z_score(log_probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Min-K%++'s (log p(x_t) − μ_t) / σ_t for a block, overwriting ``log_probs``."""
    shape, vocab = log_probs.shape[:-1], log_probs.shape[-1]
    target = _target_log_prob(log_probs, ids)
    logp = log_probs.reshape(-1, vocab)  # a view: the block is contiguous
    probs = logp.exp()
    # a -inf log-probability (a masked vocabulary entry) has p = 0: set it to 0 so that
    # p·log p and p·(log p − μ)² give 0, not 0·inf = NaN
    if bool(logp.amin() == -math.inf):  # (a reduction: no (rows, V) mask unless needed)
        logp.masked_fill_(torch.isneginf(logp), 0.0)
    p_row = probs.unsqueeze(1)  # batched dot products: no (rows, V) product is materialized
    mu = torch.bmm(p_row, logp.unsqueeze(2)).reshape(-1)
    logp.sub_(mu.unsqueeze(1)).square_()
    var = torch.bmm(p_row, logp.unsqueeze(2)).reshape(-1)
    return (target - mu.reshape(shape)) / var.sqrt().reshape(shape)


@torch.no_grad()
def token_log_probs(
    logits: Any, targets: Any, counted: Any, *, chunk_tokens: int | None = None
) -> torch.Tensor:
    """log p(x_t | x_<t) of every predicted token.

    Args:
        logits: the model's logits (n, L, V), or its output with ``.logits``.
        targets, counted: (n, L − 1) from :func:`predicted_tokens`.
        chunk_tokens: positions per chunk (default ⌊2²²/V⌋, at least 1): the extra memory is at
            most two (chunk_tokens, V) blocks of the compute dtype.

    Returns:
        (n, L − 1) tensor on the logits' device, float64 for float64 logits else float32; NaN
        where a token is not counted.

    Examples:
        >>> import torch
        >>> from privmon.attacks import predicted_tokens, token_log_probs
        >>> targets, counted = predicted_tokens(torch.tensor([[1, 2, 3]]))
        >>> logits = torch.zeros(1, 3, 4)  # a uniform model over 4 tokens
        >>> token_log_probs(logits, targets, counted)
        tensor([[-1.3863, -1.3863]])
    """
    return _per_token(logits, targets, counted, chunk_tokens, _target_log_prob)


@torch.no_grad()
def token_z_scores(
    logits: Any, targets: Any, counted: Any, *, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Min-K%++'s z_t = (log p(x_t | x_<t) − μ_t) / σ_t of every predicted token.

    μ_t and σ_t are the mean and standard deviation of log p(v | x_<t) under p(· | x_<t)
    (Zhang et al., "Min-K%++"), computed in chunks over the sequence.

    Args:
        logits: the model's logits (n, L, V), or its output with ``.logits``.
        targets, counted: (n, L − 1) from :func:`predicted_tokens`.
        chunk_tokens: positions per chunk (default ⌊2²²/V⌋, at least 1); the extra memory is at
            most two (chunk_tokens, V) blocks.

    Returns:
        (n, L − 1) tensor on the logits' device (float64 for float64 logits, else float32); NaN
        where a token is not counted or σ_t = 0 (a point mass, or a uniform distribution).

    Examples:
        >>> import torch
        >>> from privmon.attacks import predicted_tokens, token_z_scores
        >>> targets, counted = predicted_tokens(torch.tensor([[0, 1, 2]]))
        >>> logits = torch.tensor([[[0.0, 2.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]])
        >>> token_z_scores(logits, targets, counted)  # token 1 is likely, token 2 is not
        tensor([[ 0.5203, -1.9221]])
    """
    return _per_token(logits, targets, counted, chunk_tokens, _z_score)


# --- per-record reductions ------------------------------------------------------------------------


def _mean_loss(log_probs: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """−(1/T) Σ log p over the counted tokens; NaN for T = 0."""
    total = torch.where(counted, log_probs, torch.zeros_like(log_probs)).sum(dim=1)
    count = counted.sum(dim=1).to(log_probs.dtype)
    return torch.where(count > 0, -total / count.clamp(min=1), math.nan)


def lowest_k_mean(values: Any, counted: Any, *, k: float = 0.2) -> torch.Tensor:
    """Per row, the mean of the ⌊k·T⌋ lowest counted values (T: the row's counted values).

    The Min-K% / Min-K%++ reduction, with the papers' (and MIMIR's) floor: ⌊k·T⌋ is computed
    as ``int(T * k)`` in float64. A row gets NaN when ⌊k·T⌋ = 0 (the mean of no value) or when
    one of its counted values is NaN.

    Args:
        values: (n, m) float tensor (e.g. :func:`token_log_probs`).
        counted: (n, m) booleans: which values belong to the row's text.
        k: the fraction of lowest values kept, in (0, 1].

    Returns:
        (n,) tensor of ``values``' dtype and device.

    Examples:
        >>> import torch
        >>> from privmon.attacks import lowest_k_mean
        >>> log_probs = torch.tensor([[-0.1, -3.0, -0.5, -2.0, -0.2]])
        >>> lowest_k_mean(log_probs, torch.ones(1, 5, dtype=torch.bool), k=0.4)  # 2 lowest of 5
        tensor([-2.5000])
    """
    k = check_fraction(k, name="k")
    v = as_tensor(values, name="values", what="a float array of shape (n, m)")
    if not v.is_floating_point() or v.ndim != 2:
        raise ValueError(f"values must be a float array of shape (n, m), got shape {v.shape}")
    cnt = as_mask(counted, name="counted", shape=tuple(v.shape), device=v.device)
    n_counted = cnt.sum(dim=1)
    keep = torch.floor(n_counted.to(torch.float64) * k).long()
    ascending = torch.where(cnt, v, math.inf).sort(dim=1).values
    rank = torch.arange(v.shape[1], device=v.device)
    chosen = rank.unsqueeze(0) < keep.unsqueeze(1)
    total = torch.where(chosen, ascending, torch.zeros_like(ascending)).sum(dim=1)
    mean = total / keep.clamp(min=1).to(v.dtype)
    undefined = (keep == 0) | (cnt & torch.isnan(v)).any(dim=1)
    return torch.where(undefined, math.nan, mean)


# --- texts ----------------------------------------------------------------------------------------


def zlib_sizes(texts: Sequence[str]) -> np.ndarray:
    """``len(zlib.compress(text.encode("utf-8")))`` of each text (default level), as int64.

    Examples:
        >>> from privmon.attacks import zlib_sizes
        >>> zlib_sizes(["ha" * 50, "The quick brown fox jumps over the lazy dog."])
        array([13, 51])
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a sequence of strings, one per record")
    return np.array([len(zlib.compress(t.encode("utf-8"))) for t in texts], dtype=np.int64)


def decode_texts(tokenizer: Any, input_ids: Any, attention_mask: Any = None) -> list[str]:
    """Each record's text: ``tokenizer.decode`` of its unpadded ids (``attention_mask`` 1),
    with ``skip_special_tokens=True`` (a BOS / EOS a collator added is not part of the text).

    Examples:
        >>> import torch
        >>> from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast
        >>> from privmon.attacks import decode_texts
        >>> vocab = {c: i for i, c in enumerate(["<pad>", *" abcdefghijklmnopqrstuvwxyz"])}
        >>> chars = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        >>> chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # a token a letter
        >>> chars.decoder = decoders.Fuse()
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>")
        >>> batch = tokenizer(["hello world", "hi"], padding=True, return_tensors="pt")
        >>> decode_texts(tokenizer, batch["input_ids"], batch["attention_mask"])
        ['hello world', 'hi']
    """
    if not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"tokenizer must have a decode method, got {type(tokenizer).__name__}")
    ids = _integer_matrix(input_ids, name="input_ids")
    mask = (
        torch.ones_like(ids, dtype=torch.bool)
        if attention_mask is None
        else as_mask(
            attention_mask, name="attention_mask", shape=tuple(ids.shape), device=ids.device
        )
    )
    rows = ids.cpu()
    keep = mask.cpu()
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(rows, keep, strict=True)
    ]


# --- the model ------------------------------------------------------------------------------------


_RETURN_DICT = (
    "model.config.return_dict is False and {name} failed ({error!r}): transformers 5 models "
    "fail inside their own forward with it (the base model returns a tuple that the head reads "
    "as an output object); set model.config.return_dict = True (privmon reads tuple outputs "
    "too)"
)


def _takes_position_ids(model: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def causal_lm_logits(model: nn.Module, input_ids: Any, attention_mask: Any = None) -> torch.Tensor:
    """The logits (n, L, V) of a causal language model on a padded batch.

    Calls ``model(input_ids=..., attention_mask=...)`` on the model's device. A left-padded
    row's tokens would otherwise sit at shifted positions, so when a row starts with padding the
    call also passes ``position_ids`` = (cumulative sum of the mask − 1, floored at 0), which
    makes every text's logits those of the text alone (Hugging Face models take it); a model
    whose ``forward`` has no ``position_ids`` argument is refused for such a batch (pad on the
    right instead: right padding needs no positions).

    The logits are the output itself, its ``.logits`` / ``["logits"]``, or the first element
    of a tuple (a Hugging Face model called with ``return_dict=False``: no labels are passed,
    so no loss comes first). A model whose weights are on the meta device is refused, and so,
    with the reason, is the failure of a model whose ``config.return_dict`` is False (a
    transformers 5 model then fails inside its own forward).

    Examples:
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from privmon.attacks import causal_lm_logits
        >>> _ = torch.manual_seed(0)
        >>> config = GPT2Config(
        ...     vocab_size=20, n_embd=8, n_layer=1, n_head=1, bos_token_id=0, eos_token_id=0
        ... )
        >>> model = GPT2LMHeadModel(config).eval()
        >>> input_ids = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])  # the first row left padded
        >>> logits = causal_lm_logits(model, input_ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        >>> logits.shape
        torch.Size([2, 4, 20])
        >>> alone = causal_lm_logits(model, torch.tensor([[7, 8]]))  # the first text unpadded
        >>> torch.allclose(logits[0, 2:], alone[0], atol=1e-6)
        True
    """
    check_materialized(check_module(model, name="model"), name="model")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ids = _integer_matrix(input_ids, name="input_ids").to(device)
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if attention_mask is not None:
        mask = as_mask(attention_mask, name="attention_mask", shape=tuple(ids.shape), device=device)
        inputs["attention_mask"] = mask.long()
        if bool((~mask[:, 0] & mask.any(dim=1)).any()):
            if not _takes_position_ids(model):
                raise ValueError(
                    f"the batch is left padded but {type(model).__name__}.forward takes no "
                    "position_ids, so its texts would be scored at shifted positions; pad on the "
                    "right (tokenizer.padding_side = 'right')"
                )
            inputs["position_ids"] = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    try:
        output = model(**inputs)
    except AttributeError as e:  # transformers 5 reads an attribute of the tuple it got back
        if getattr(getattr(model, "config", None), "return_dict", None) is False:
            raise ValueError(_RETURN_DICT.format(name=type(model).__name__, error=e)) from e
        raise
    logits = _logits_of(output, source="model returned")
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        raise ValueError(
            f"model returned logits of shape {tuple(logits.shape)} for input_ids of shape "
            f"{tuple(ids.shape)}; expected (n, L, V)"
        )
    return logits


# --- the statistics (objects: privmon.attacks.lm_statistics) ------------------------------------
@torch.no_grad()
def lm_statistic(
    logits: Any,
    input_ids: Any,
    attention_mask: Any = None,
    *,
    statistic: str,
    labels: Any = None,
    k: float = 0.2,
    texts: Sequence[str] | None = None,
    reference_logits: Any = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """One membership statistic per text of a padded batch (module docstring).

    Args:
        logits: the target model's logits (n, L, V) on the batch, or its output.
        input_ids, attention_mask, labels: the batch, as :func:`predicted_tokens` reads it.
        statistic: one of :data:`STATISTICS`.
        k: Min-K% / Min-K%++ fraction, in (0, 1] (the papers' default 0.2); ⌊k·T⌋ is floored as
            the papers' code does.
        texts: the records' texts, for ``zlib`` (required there), e.g. from
            :func:`decode_texts`.
        reference_logits: a reference model's logits on the same batch, for ``reference``
            (required there); its vocabulary may be larger than the target's.
        chunk_tokens: positions per chunk of the vocabulary-wide work (default ⌊2²²/V⌋).

    Returns:
        (n,) tensor on the logits' device (float64 for float64 logits, else float32); NaN for a
        text with no predicted token, or too few for ⌊k·T⌋ ≥ 1 (Min-K%, Min-K%++).

    Examples:
        >>> import torch
        >>> from privmon.attacks import lm_statistic
        >>> gen = torch.Generator().manual_seed(0)
        >>> input_ids = torch.randint(0, 50, (2, 12), generator=gen)
        >>> logits = torch.randn(2, 12, 50, generator=gen)  # e.g. model(input_ids).logits
        >>> lm_statistic(logits, input_ids, statistic="loss").round(decimals=2)
        tensor([4.5000, 5.1100])
        >>> lm_statistic(logits, input_ids, statistic="min_k", k=0.2).round(decimals=2)
        tensor([-5.3400, -6.2200])
    """
    stat = lm_statistic_of(statistic)
    k = check_fraction(k, name="k")
    targets, counted = predicted_tokens(input_ids, attention_mask, labels=labels)
    return stat.score(_Batch(logits, targets, counted, k, texts, reference_logits, chunk_tokens))


class _Batch(TokenInputs):
    """The :class:`~privmon.attacks.lm_statistics.TokenInputs` of :func:`lm_statistic`."""

    def __init__(self, logits, targets, counted, k, texts, reference_logits, chunk_tokens):
        self.logits, self.targets, self.counted, self.k = logits, targets, counted, k
        self.texts, self.reference_logits, self.chunk = texts, reference_logits, chunk_tokens
        self.device = _logits_of(logits).device
        self.counted_here = counted.to(self.device)

    def log_probs(self, logits: Any = None) -> torch.Tensor:
        chosen = self.logits if logits is None else logits
        return token_log_probs(chosen, self.targets, self.counted, chunk_tokens=self.chunk)

    def z_scores(self) -> torch.Tensor:
        return token_z_scores(self.logits, self.targets, self.counted, chunk_tokens=self.chunk)

    def loss(self, *, reference: bool = False) -> torch.Tensor:
        if not reference:
            return _mean_loss(self.log_probs(), self.counted_here)
        if self.reference_logits is None:
            raise ValueError("statistic 'reference' needs reference_logits on the same batch")
        ref = self.log_probs(self.reference_logits)
        return _mean_loss(ref, self.counted.to(ref.device)).to(device=self.device)

    def lowest_k(self, values: torch.Tensor) -> torch.Tensor:
        return lowest_k_mean(values, self.counted_here, k=self.k)

    def zlib_sizes(self) -> torch.Tensor:
        if self.texts is None:
            raise ValueError("statistic 'zlib' needs texts: one string per record")
        sizes = zlib_sizes(self.texts)
        if len(sizes) != self.targets.shape[0]:
            raise ValueError(f"texts must hold {self.targets.shape[0]} strings, got {len(sizes)}")
        return torch.as_tensor(sizes, device=self.device)


STATISTICS: tuple[str, ...] = LM_STATISTICS
"""The built-in statistics :func:`lm_statistic` computes, as objects in
:mod:`~privmon.attacks.lm_statistics`."""

HIGHER_IS_MEMBER: dict[str, bool] = {s: lm_statistic_of(s).higher_is_member for s in STATISTICS}
"""Score direction of each built-in statistic: True when members tend to score higher."""
