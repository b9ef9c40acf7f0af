"""Named parts of one kind that a pipeline asks by name instead of branching on it — the
estimator methods, the diffusion and the language-model statistics: the built-in ones, then any
a user registers, kept in the order registered. One home for the registering, the refusals and
the lookup, so that every kind says them the same way."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from privmon._shown import shown
from privmon._validation import check_choice

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """The parts of ``kind`` (each with a ``name``), by name; ``what`` names one in messages.

    Examples:
        >>> from privmon._registry import Registry
        >>> class Part:
        ...     def __init__(self, name):
        ...         self.name = name
        >>> parts = Registry(Part, what="part", built_in=[Part("a")])
        >>> parts.register(Part("b")); parts.names()
        ('a', 'b')
        >>> parts.get("c")
        Traceback (most recent call last):
        ...
        ValueError: part must be one of ('a', 'b'), got 'c'
    """

    def __init__(
        self, kind: type, *, what: str, built_in: Iterable[T] = (), kept: tuple[str, ...] = ()
    ) -> None:
        self.kind, self.what = kind, what
        self._parts: dict[str, T] = {}
        for part in built_in:
            self.register(part)
        self.built_in = (*self.names(), *kept)
        """The names that stay registered: the ``built_in`` parts', and ``kept`` (the built-in
        parts registered later, by a module of their own)."""

    def register(self, part: T) -> None:
        """Add ``part`` after those registered before (a TypeError for another kind, a
        ValueError for a name that is not a string or is taken)."""
        if not isinstance(part, self.kind):
            raise TypeError(
                f"{self.what} must be an instance of {self.kind.__name__}, got "
                f"{type(part).__name__}"
            )
        name = getattr(part, "name", None)
        if not isinstance(name, str) or name in self._parts:
            raise ValueError(f"{self.what} needs a name not yet registered, got {shown(name)}")
        self._parts[name] = part

    def unregister(self, name: str) -> None:
        """Remove a part :meth:`register` added; the built-in ones stay."""
        if name in self.built_in:
            raise ValueError(f"the built-in {self.what}s {self.built_in} stay registered")
        del self._parts[self.check(name)]

    def names(self) -> tuple[str, ...]:
        """The registered names, the built-in ones first, in the order registered."""
        return tuple(self._parts)

    def check(self, name: object) -> str:
        """``name``, a registered one, or a ValueError naming the valid ones."""
        return check_choice(name, self.names(), name=self.what)

    def get(self, name: object) -> T:
        """The registered part of that name (:meth:`check` first)."""
        return self._parts[self.check(name)]

    def parts(self) -> tuple[T, ...]:
        """The registered parts, in the order of :meth:`names`."""
        return tuple(self._parts.values())
