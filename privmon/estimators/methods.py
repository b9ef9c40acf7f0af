"""The advantage estimators' methods, registered once: each method is an object
(:class:`EstimatorMethod`) that the pipeline asks for its grid, smoothing, plug-ins, rule and
per-record risk; the monitor, the CLI, the figures' names and the run reader read the built-in
names (:data:`METHODS`) from here."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Literal, Protocol, cast

import torch

from privmon._registry import Registry
from privmon.estimators.record_binning import ClassCounts

__all__ = [
    "METHODS",
    "RISK_METHOD",
    "EstimatorMethod",
    "MemoryRule",
    "Method",
    "applicable_methods",
    "check_method",
    "estimator_method",
    "register_method",
    "registered_methods",
    "unregister_method",
]

Method = Literal["histogram", "kde"]

METHODS: tuple[Method, ...] = ("histogram", "kde")
"""The built-in methods (:mod:`privmon.estimators.builtin_methods`), those a monitor reports."""

RISK_METHOD: Method = "histogram"
"""The method whose cross-fitted rule the per-record risks of :func:`~privmon.analyse` read."""


class MemoryRule(Protocol):
    """A rule learned on scores kept in memory (:mod:`privmon.estimators.in_memory`)."""

    def figures(
        self, m, h, *, prior: float, folds: int, deltas, scale, bandwidth, ridge
    ) -> tuple[float, float, float, float]:
        """Held-out true / false positives of the cross-fitted rules, the larger of the
        certificates at ``deltas`` (the run's δ share, the call's δ)."""
        ...


class EstimatorMethod(abc.ABC):
    """One advantage estimator, as the pipeline asks it (:mod:`privmon.estimators.stages`):
    ``name`` (its figures' prefix), whether it applies to ``discrete`` scores, its grid
    (:meth:`default_bins`, :meth:`reads_memory`), its smoothing (:meth:`smooth`), its plug-ins
    (``plugin_reads_density``, :meth:`grid_plugin`, :meth:`raw_plugin`, :meth:`memory_plugin`),
    the rule it learns on scores in memory (:meth:`memory_rule`) and its per-record risk
    (:meth:`individual_risk`). A new method subclasses it (or a built-in method) and is
    registered with :func:`register_method`.

    Examples:
        >>> from privmon.estimators.methods import EstimatorMethod, estimator_method
        >>> isinstance(estimator_method("kde"), EstimatorMethod)
        True
    """

    name: str
    discrete: bool = True
    """It applies to scores taking few values (a density estimate does not)."""
    plugin_reads_density: bool = False
    """Its grid plug-in reads the classes' smoothed full-data densities (:meth:`grid_plugin`)."""

    @abc.abstractmethod
    def default_bins(self, d: int) -> int:
        """Cells per dimension of its grid for ``d``-dimensional scores (1-D: the grids of one
        pass divide the finest)."""

    def reads_memory(self, members: torch.Tensor, nonmembers: torch.Tensor, *, bins, bandwidth):
        """2-D: whether its rule reads the scores in memory (:meth:`memory_rule`) rather than
        its grid of ``bins`` cells per axis."""
        return False

    @abc.abstractmethod
    def memory_rule(self, d: int) -> MemoryRule:
        """The rule it learns on ``d``-dimensional scores kept in memory."""

    @abc.abstractmethod
    def smooth(self, bins, width, counts, ns, covs, *, bandwidth, extended: int):
        """Stage 2 (:mod:`privmon.estimators.smoothing`): the smoothed masses of rows of cell
        counts, the first ``extended`` on the extended grid, the others cropped to it."""

    @abc.abstractmethod
    def grid_plugin(self, total, rows, *, prior: float, n) -> torch.Tensor:
        """Its plug-in from the classes' cell counts ``total`` (2, cells) of ``n`` records, or
        (``plugin_reads_density``) their smoothed masses ``rows`` on the extended grid."""

    @abc.abstractmethod
    def raw_plugin(
        self, raw: ClassCounts, members, nonmembers, *, prior, bandwidth, bins, n_samples, seed
    ) -> torch.Tensor:
        """1-D: its plug-in on the scores' own scale (``raw``: their cell counts); a
        ValueError / RuntimeError loses the plug-in alone (NaN)."""

    @abc.abstractmethod
    def memory_plugin(
        self, m, h, *, prior, bandwidth, bins, low, span, ridge, n_samples, seed
    ) -> float:
        """Its plug-in of scores kept in memory (above 2-D, or a rule read in memory)."""

    @abc.abstractmethod
    def individual_risk(self, x, m, h, *, prior, delta, bins, bandwidth, n_dropped) -> Any:
        """Its :class:`~privmon.estimators.risk.IndividualRisk` of queries ``x`` given the
        member / non-member scores (finite, checked): :func:`~privmon.individual_risk`."""


_REGISTRY: Registry[EstimatorMethod] = Registry(EstimatorMethod, what="method", kept=METHODS)


def register_method(method: EstimatorMethod) -> None:
    """Make ``method`` a method :func:`~privmon.analyse`, :func:`~privmon.optimal_advantage`
    and :func:`~privmon.individual_risk` accept by its name (after those registered before).

    Examples:
        >>> from privmon.estimators.builtin_methods import HistogramMethod
        >>> from privmon.estimators.methods import register_method, unregister_method
        >>> class Coarse(HistogramMethod):
        ...     name = "coarse"
        ...     def default_bins(self, d):
        ...         return 10
        >>> register_method(Coarse())
        >>> "coarse" in registered_methods()
        True
        >>> unregister_method("coarse")
    """
    _REGISTRY.register(method)


def unregister_method(name: str) -> None:
    """Remove a method :func:`register_method` added (the built-in ones stay).

    Examples:
        >>> from privmon.estimators.methods import unregister_method
        >>> unregister_method("kde")
        Traceback (most recent call last):
        ...
        ValueError: the built-in methods ('histogram', 'kde') stay registered
    """
    _REGISTRY.unregister(name)


def registered_methods() -> tuple[str, ...]:
    """The registered methods' names, built-in ones first, in the order registered.

    Examples:
        >>> from privmon.estimators.methods import registered_methods
        >>> registered_methods()
        ('histogram', 'kde')
    """
    return _REGISTRY.names()


def estimator_method(name: str) -> EstimatorMethod:
    """The registered method of that name (:func:`check_method` first).

    Examples:
        >>> from privmon.estimators.methods import estimator_method
        >>> estimator_method("histogram").default_bins(1)
        100
    """
    return _REGISTRY.get(name)


def check_method(method: str) -> Method:
    """``method`` as a :data:`Method`, or a ValueError naming the valid (registered) ones."""
    return cast(Method, _REGISTRY.check(method))  # a registered name beside the built-in ones


def applicable_methods(methods: Sequence[str], *, discrete: bool) -> tuple[str, ...]:
    """The methods of ``methods`` that apply to a query's scores, in the order given: a density
    estimate (the KDE) does not apply to scores taking few values (``discrete``)."""
    known = _REGISTRY.names()
    return tuple(m for m in methods if not discrete or m not in known or _REGISTRY.get(m).discrete)
