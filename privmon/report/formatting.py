"""Numbers as the report shows them."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["cause_text", "fmt"]


def fmt(v: Any, digits: int = 4) -> str:
    """``v`` to ``digits`` significant digits; integers whole, tiny values in e-notation, None and
    NaN as a dash."""
    if v is None:
        return "—"
    v = float(v)
    if math.isnan(v):
        return "—"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.{digits}g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def cause_text(cause: str) -> str:
    """A DP violation's cause as a headline shows it: ``"clipping: a row …"`` becomes
    ``"clipping — a row …"``."""
    what, sep, evidence = cause.partition(": ")
    return f"{what} — {evidence}" if sep and " " not in what else cause
