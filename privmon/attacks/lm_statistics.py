"""The language-model membership statistics as objects, registered once: what
:func:`~privmon.attacks.lm_statistic` and :class:`~privmon.queries.LanguageModelQuery` ask of a
statistic (its direction, whether it reads the texts or a reference model's logits, its score);
the batch's token-level figures come from :mod:`privmon.attacks.language_model`."""

from __future__ import annotations

import abc

import torch

from privmon._registry import Registry

__all__ = [
    "STATISTICS",
    "LMStatistic",
    "TokenInputs",
    "lm_statistic_of",
    "register_lm_statistic",
    "registered_lm_statistics",
    "unregister_lm_statistic",
]


class TokenInputs(abc.ABC):
    """What a statistic reads of one batch (:func:`~privmon.attacks.lm_statistic` builds it):
    Min-K%'s ``k`` and, computed when asked, the predicted tokens' log-probabilities and
    z-scores, the per-text mean loss, the lowest-``k`` mean and the texts' zlib sizes."""

    k: float

    @abc.abstractmethod
    def log_probs(self) -> torch.Tensor:
        """Each predicted token's log-probability under the target model, (n, T)."""

    @abc.abstractmethod
    def z_scores(self) -> torch.Tensor:
        """Each predicted token's z-score under the model's vocabulary distribution, (n, T)."""

    @abc.abstractmethod
    def loss(self, *, reference: bool = False) -> torch.Tensor:
        """The mean negative log-likelihood of each text, (n,), under the target model (or
        the reference model's logits), on the target logits' device."""

    @abc.abstractmethod
    def lowest_k(self, values: torch.Tensor) -> torch.Tensor:
        """Each text's mean of its ⌊k·T⌋ lowest counted ``values`` (n, T), (n,)."""

    @abc.abstractmethod
    def zlib_sizes(self) -> torch.Tensor:
        """Each text's zlib-compressed size, (n,) (a ValueError without the texts)."""


class LMStatistic:
    """One statistic of :func:`~privmon.attacks.lm_statistic`: its ``name``, its direction
    (``higher_is_member``), whether it reads the texts (``reads_texts``: the query decodes
    them) or a reference model (``reads_reference``), and its :meth:`score`. A new statistic
    subclasses it and is registered with :func:`register_lm_statistic`.

    Examples:
        >>> from privmon.attacks.lm_statistics import lm_statistic_of
        >>> lm_statistic_of("zlib").reads_texts, lm_statistic_of("min_k").higher_is_member
        (True, True)
    """

    name: str
    higher_is_member = False
    reads_texts = False
    reads_reference = False

    def score(self, inputs: TokenInputs) -> torch.Tensor:
        """The statistic of each text, (n,) on the logits' device."""
        raise NotImplementedError


class _Loss(LMStatistic):
    name = "loss"

    def score(self, inputs: TokenInputs) -> torch.Tensor:
        return inputs.loss()


class _Zlib(LMStatistic):
    name, reads_texts = "zlib", True

    def score(self, inputs: TokenInputs) -> torch.Tensor:
        loss = inputs.loss()
        return loss / inputs.zlib_sizes().to(loss.dtype)


class _MinK(LMStatistic):
    name, higher_is_member = "min_k", True

    def score(self, inputs: TokenInputs) -> torch.Tensor:
        return inputs.lowest_k(inputs.log_probs())


class _MinKPlusPlus(LMStatistic):
    name, higher_is_member = "min_k_plus_plus", True

    def score(self, inputs: TokenInputs) -> torch.Tensor:
        return inputs.lowest_k(inputs.z_scores())


class _Reference(LMStatistic):
    name, reads_reference = "reference", True

    def score(self, inputs: TokenInputs) -> torch.Tensor:
        loss = inputs.loss()
        return loss - inputs.loss(reference=True).to(loss.dtype)


_REGISTRY: Registry[LMStatistic] = Registry(
    LMStatistic,
    what="statistic",
    built_in=(_Loss(), _Zlib(), _MinK(), _MinKPlusPlus(), _Reference()),
)
STATISTICS: tuple[str, ...] = _REGISTRY.built_in
"""The built-in statistics (:mod:`privmon.attacks.language_model`'s docstring)."""


def register_lm_statistic(statistic: LMStatistic) -> None:
    """Make ``statistic`` one :func:`~privmon.attacks.lm_statistic` and
    :class:`~privmon.queries.LanguageModelQuery` accept by its name.

    Examples:
        >>> from privmon.attacks.lm_statistics import LMStatistic, register_lm_statistic
        >>> class Zero(LMStatistic):
        ...     name = "zero"
        >>> register_lm_statistic(Zero())
        >>> unregister_lm_statistic("zero")
    """
    _REGISTRY.register(statistic)


def unregister_lm_statistic(name: str) -> None:
    """Remove a statistic :func:`register_lm_statistic` added (the built-in ones stay).

    Examples:
        >>> from privmon.attacks.lm_statistics import unregister_lm_statistic
        >>> unregister_lm_statistic("loss")
        Traceback (most recent call last):
        ...
        ValueError: the built-in statistics ('loss', 'zlib', ...) stay registered
    """
    _REGISTRY.unregister(name)


def registered_lm_statistics() -> tuple[str, ...]:
    """The registered statistics' names, the built-in ones first.

    Examples:
        >>> from privmon.attacks.lm_statistics import registered_lm_statistics
        >>> registered_lm_statistics()[:2]
        ('loss', 'zlib')
    """
    return _REGISTRY.names()


def lm_statistic_of(name: str) -> LMStatistic:
    """The registered statistic of that name, or a ValueError naming the valid ones.

    Examples:
        >>> from privmon.attacks.lm_statistics import lm_statistic_of
        >>> lm_statistic_of("reference").reads_reference
        True
    """
    return _REGISTRY.get(name)
