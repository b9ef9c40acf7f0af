"""Secret-sharer canaries and their exposure (Carlini et al., "The Secret Sharer: Evaluating and
Testing Unintended Memorization in Neural Networks").

A canary is a template filled with a random secret from a space R (e.g. six digits: |R| = 10⁶),
inserted into the training text. After training, the canary's log-perplexity is ranked among
the template's other fills: exposure = log₂|R| − log₂ rank, about 1 bit for a canary the model
has not memorized and log₂|R| for one it has. :func:`secret_sharer_canaries` draws the secrets
and the candidate fills, :func:`exposure` turns losses into bits (counted among the candidates,
or extrapolated from a Gaussian fit) and :func:`canary_exposure` scores both with a Hugging Face
causal language model. The two estimators: docs, Theory page, *Secret-sharer exposure*.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from scipy import stats
from torch import nn

from privmon._validation import as_array, check_choice, check_int, to_numpy
from privmon.attacks.language_model import (
    causal_lm_logits,
    predicted_tokens,
    token_log_probs,
)

__all__ = [
    "EXPOSURE_METHODS",
    "SecretSharerCanaries",
    "canary_exposure",
    "exposure",
    "secret_sharer_canaries",
    "sequence_losses",
]

EXPOSURE_METHODS: tuple[str, ...] = ("rank", "gaussian")
"""How :func:`exposure` reads a canary's rank: counted among the candidates, or extrapolated
from a Gaussian fit to their losses."""

_PLACEHOLDER = "{secret}"
_ENUMERATE_MAX = 10**6  # spaces up to this size are listed whole when every fill is asked for


def exposure(
    canary_losses: Any,
    candidate_losses: Any,
    *,
    method: Literal["rank", "gaussian"] = "rank",
) -> np.ndarray:
    """Exposure (bits) of each canary given the losses of the template's other fills.

    Args:
        canary_losses: Px of each canary (its total negative log-likelihood), shape (c,).
        candidate_losses: Px of the candidate fills, shape (m,) (shared by every canary) or
            (c, m) (one row per canary). Non-finite candidates are left out of their row.
        method: "rank" (default): log₂(m + 1) − log₂(1 + #{candidates ≤ canary}), exact when
            the candidates are every other fill of R, else saturating at log₂(m + 1);
            "gaussian": −log₂ Φ((Px − μ) / σ) with a normal fitted to the candidates' losses,
            which extrapolates past the sample.

    Returns:
        float64 array (c,); NaN for a non-finite canary loss, or a row with too few finite
        candidates (one for "rank", two with a positive spread for "gaussian").

    Examples:
        >>> import numpy as np
        >>> from privmon.attacks import exposure
        >>> rng = np.random.default_rng(0)
        >>> candidates = rng.normal(50.0, 2.0, size=999)  # losses of the other fills
        >>> canaries = np.array([50.0, 40.0])  # a typical canary, a memorized one
        >>> exposure(canaries, candidates).round(2)
        array([0.91, 9.97])
        >>> exposure(canaries, candidates, method="gaussian").round(2)
        array([ 0.94, 22.22])
    """
    check_choice(method, EXPOSURE_METHODS, name="method")
    canary = as_array(canary_losses, name="canary_losses", ndim=1)
    ndim = _ndim(candidate_losses)
    cand = as_array(candidate_losses, name="candidate_losses", ndim=ndim, device=canary.device)
    if cand.ndim == 1:
        cand = cand.unsqueeze(0).expand(canary.shape[0], -1)
    elif cand.shape[0] != canary.shape[0]:
        raise ValueError(
            f"candidate_losses of shape {tuple(cand.shape)} must have one row per canary "
            f"({canary.shape[0]}), or be one shared row of shape (m,)"
        )
    finite = torch.isfinite(cand)
    m = finite.sum(dim=1).to(torch.float64)
    if method == "rank":
        at_or_below = (finite & (cand <= canary.unsqueeze(1))).sum(dim=1).to(torch.float64)
        bits = torch.log2(m + 1) - torch.log2(at_or_below + 1)
        ok = m >= 1
    else:
        zeros = torch.zeros_like(cand)
        mean = torch.where(finite, cand, zeros).sum(dim=1) / m.clamp(min=1)
        dev = torch.where(finite, cand - mean.unsqueeze(1), zeros)
        sd = (dev.square().sum(dim=1) / (m - 1).clamp(min=1)).sqrt()
        ok = (m >= 2) & (sd > 0)
        z = to_numpy((canary - mean) / torch.where(ok, sd, 1.0))
        bits = torch.from_numpy(-stats.norm.logcdf(z) / math.log(2)).to(canary.device)
    bits = torch.where(ok & torch.isfinite(canary), bits, math.nan)
    return to_numpy(bits)


def _ndim(values: Any) -> int:
    """1 for a shared row of candidate losses, 2 for one row per canary."""
    ndim = values.ndim if isinstance(values, torch.Tensor) else np.ndim(values)
    if ndim not in (1, 2):
        raise ValueError(f"candidate_losses must have shape (m,) or (c, m), got {ndim} dimensions")
    return int(ndim)


@dataclass(frozen=True)
class SecretSharerCanaries:
    """Canaries for a fine-tune: a template, the inserted secrets and the reference fills.

    Attributes:
        template: text with one ``{secret}`` placeholder.
        alphabet: the characters a secret is made of.
        length: characters per secret; the space R holds ``len(alphabet) ** length`` secrets.
        secrets: the inserted secrets (distinct).
        candidates: reference fills, distinct and disjoint from ``secrets`` (a uniform sample of
            the rest of R, or all of it when ``exhaustive``).
        exhaustive: True when ``candidates`` is every fill of R but the secrets, so that
            ``exposure(..., method="rank")`` is exact (relative to R without the other canaries).

    Examples:
        >>> from privmon.attacks import secret_sharer_canaries
        >>> canaries = secret_sharer_canaries("my pin is {secret}", n_canaries=2, length=4, seed=0)
        >>> canaries.texts
        ['my pin is 8652', 'my pin is 3000']
        >>> canaries.space_size, len(canaries.candidate_texts), canaries.exhaustive
        (10000, 1000, False)
    """

    template: str
    alphabet: str
    length: int
    secrets: tuple[str, ...]
    candidates: tuple[str, ...]
    exhaustive: bool

    @property
    def space_size(self) -> int:
        """|R|, the number of possible secrets."""
        return len(self.alphabet) ** self.length

    @property
    def texts(self) -> list[str]:
        """The canary texts to insert into the training data, one per secret."""
        return [self.template.replace(_PLACEHOLDER, s) for s in self.secrets]

    @property
    def candidate_texts(self) -> list[str]:
        """The template filled with each candidate secret (never trained on)."""
        return [self.template.replace(_PLACEHOLDER, s) for s in self.candidates]


def secret_sharer_canaries(
    template: str = "my secret number is {secret}",
    *,
    n_canaries: int = 20,
    alphabet: str = "0123456789",
    length: int = 6,
    n_candidates: int = 1000,
    seed: int = 0,
) -> SecretSharerCanaries:
    """Draw ``n_canaries`` distinct random secrets and ``n_candidates`` reference fills.

    Args:
        template: a text holding ``{secret}`` exactly once.
        n_canaries: secrets to insert, >= 1.
        alphabet: distinct characters a secret is drawn from (uniformly, per position).
        length: characters per secret, >= 1.
        n_candidates: reference fills, >= 1; when it reaches the size of R minus the canaries
            (and R has at most 10⁶ secrets), every other fill is listed and the rank exposure
            is exact.
        seed: seed of the draw (numpy ``default_rng``).

    Examples:
        >>> from privmon.attacks import secret_sharer_canaries
        >>> canaries = secret_sharer_canaries("the code is {secret}", n_canaries=3, length=2)
        >>> canaries.secrets
        ('86', '52', '30')
        >>> len(canaries.candidates), canaries.exhaustive  # every other fill: exact ranks
        (97, True)
    """
    if not isinstance(template, str) or template.count(_PLACEHOLDER) != 1:
        raise ValueError(f"template must be a string holding {_PLACEHOLDER} once, got {template!r}")
    if not isinstance(alphabet, str) or len(alphabet) < 2 or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must be a string of >= 2 distinct characters, got {alphabet!r}")
    n_canaries = check_int(n_canaries, name="n_canaries", minimum=1)
    length = check_int(length, name="length", minimum=1)
    n_candidates = check_int(n_candidates, name="n_candidates", minimum=1)
    seed = check_int(seed, name="seed")
    size = len(alphabet) ** length
    if n_canaries + 1 > size:
        raise ValueError(
            f"n_canaries must leave room for candidates: R holds {size} secrets "
            f"({len(alphabet)} characters ** length {length}), got n_canaries={n_canaries}"
        )
    rng = np.random.default_rng(seed)
    secrets = _distinct_draws(rng, alphabet, length, n_canaries, exclude=set())
    taken = set(secrets)
    exhaustive = n_candidates >= size - n_canaries and size <= _ENUMERATE_MAX
    if exhaustive:
        every = ("".join(c) for c in itertools.product(alphabet, repeat=length))
        candidates = tuple(s for s in every if s not in taken)
    else:
        n_candidates = min(n_candidates, size - n_canaries)
        candidates = _distinct_draws(rng, alphabet, length, n_candidates, exclude=taken)
    return SecretSharerCanaries(
        template=template,
        alphabet=alphabet,
        length=length,
        secrets=secrets,
        candidates=candidates,
        exhaustive=exhaustive,
    )


def _distinct_draws(
    rng: np.random.Generator, alphabet: str, length: int, count: int, *, exclude: set[str]
) -> tuple[str, ...]:
    """``count`` distinct uniform secrets not in ``exclude``, in draw order."""
    chars = np.array(list(alphabet))
    out: dict[str, None] = {}
    while len(out) < count:
        rows = chars[rng.integers(0, len(alphabet), size=(2 * (count - len(out)), length))]
        for s in ("".join(r) for r in rows):
            if s not in exclude and s not in out:
                out[s] = None
                if len(out) == count:
                    break
    return tuple(out)


@torch.no_grad()
def sequence_losses(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    *,
    batch_size: int = 64,
    chunk_tokens: int | None = None,
) -> np.ndarray:
    """Px of each text: −Σ_t log p(x_t | x_<t) over its predicted tokens (nats), float64.

    The texts are tokenized in batches with ``tokenizer(texts, padding=True,
    return_tensors="pt")`` (a tokenizer without a pad token is refused) and scored by
    :func:`~privmon.attacks.language_model.causal_lm_logits`, so the padding side does not
    matter. A text of one token predicts nothing: its Px is NaN (:func:`exposure` gives it NaN).
    The caller puts the model in eval mode.

    Examples:
        >>> import torch
        >>> from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        >>> from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
        >>> from privmon.attacks import sequence_losses
        >>> vocab = {c: i for i, c in enumerate(["<pad>", *" abcdefghijklmnopqrstuvwxyz"])}
        >>> chars = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        >>> chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # a token a letter
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>")
        >>> _ = torch.manual_seed(0)
        >>> config = GPT2Config(
        ...     vocab_size=len(vocab), n_embd=8, n_layer=1, n_head=1, bos_token_id=0, eos_token_id=0
        ... )
        >>> model = GPT2LMHeadModel(config).eval()  # untrained: about log 28 nats a token
        >>> sequence_losses(model, tokenizer, ["abc", "hello world"]).round(4).tolist()
        [6.5945, 33.2972]
    """
    batch_size = check_int(batch_size, name="batch_size", minimum=1)
    if not callable(tokenizer) or getattr(tokenizer, "pad_token", None) is None:
        raise ValueError(
            "tokenizer must be a Hugging Face tokenizer with a pad token "
            "(e.g. tokenizer.pad_token = tokenizer.eos_token)"
        )
    out: list[np.ndarray] = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start : start + batch_size], padding=True, return_tensors="pt")
        mask = enc.get("attention_mask")
        logits = causal_lm_logits(model, enc["input_ids"], mask)
        targets, counted = predicted_tokens(enc["input_ids"], mask)
        log_probs = token_log_probs(logits, targets, counted, chunk_tokens=chunk_tokens)
        total = -log_probs.nan_to_num(nan=0.0).sum(dim=1)
        # a text with no predicted token (one token long) has no loss: NaN, not −0.0, which
        # would rank it as fully memorized
        total = torch.where(counted.to(total.device).any(dim=1), total, math.nan)
        out.append(to_numpy(total.to(torch.float64)))
    return np.concatenate(out) if out else np.zeros(0)


def canary_exposure(
    model: nn.Module,
    tokenizer: Any,
    canaries: SecretSharerCanaries,
    *,
    method: Literal["rank", "gaussian"] = "rank",
    batch_size: int = 64,
) -> np.ndarray:
    """Each canary's exposure (bits) under ``model``: :func:`sequence_losses` of the canary texts
    and of the candidate texts, then :func:`exposure`. Runs under ``torch.no_grad()``; the
    caller puts the model in eval mode (a check of :class:`~privmon.PrivacyMonitor` does).

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        >>> from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
        >>> from privmon.attacks import canary_exposure, secret_sharer_canaries
        >>> canaries = secret_sharer_canaries("pin {secret}", n_canaries=2, length=2, seed=0)
        >>> vocab = {c: i for i, c in enumerate(["<pad>", "p", "i", "n", " ", *"0123456789"])}
        >>> digits = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        >>> digits.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=digits, pad_token="<pad>")
        >>> _ = torch.manual_seed(0)
        >>> config = GPT2Config(
        ...     vocab_size=len(vocab), n_embd=8, n_layer=1, n_head=1, bos_token_id=0, eos_token_id=0
        ... )
        >>> bits = canary_exposure(GPT2LMHeadModel(config).eval(), tokenizer, canaries)
        >>> bits.shape, bool(bits.max() <= np.log2(len(canaries.candidates) + 1))
        ((2,), True)
    """
    if not isinstance(canaries, SecretSharerCanaries):
        raise ValueError(f"canaries must be a SecretSharerCanaries, got {type(canaries).__name__}")
    own = sequence_losses(model, tokenizer, canaries.texts, batch_size=batch_size)
    ref = sequence_losses(model, tokenizer, canaries.candidate_texts, batch_size=batch_size)
    return exposure(own, ref, method=method)
