"""The advantage estimators' methods, listed once: the monitor, the CLI, the figures' names and
the run reader all read them from here, so adding a method is a change to the estimators and
to the tag owner (:mod:`privmon.report.tags`) only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from privmon._shown import shown

__all__ = ["METHODS", "Method", "applicable_methods", "check_method"]

Method = Literal["histogram", "kde"]

METHODS: tuple[Method, ...] = ("histogram", "kde")


def check_method(method: str) -> Method:
    """``method`` as a :data:`Method`, or a ValueError naming the valid ones."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {shown(method)}")
    return method


def applicable_methods(methods: Sequence[str], *, discrete: bool) -> tuple[str, ...]:
    """The methods of ``methods`` that apply to a query's scores, in the order given: the KDE
    smooths a density, which scores taking few values (``discrete``) do not have."""
    return tuple(m for m in methods if not (discrete and m == "kde"))
