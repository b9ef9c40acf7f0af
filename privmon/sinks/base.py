"""The :class:`Sink` protocol: where a :class:`~privmon.report.Report` goes after each check.

A sink is any object with ``write(report)`` and ``close()``; nothing needs to inherit from
:class:`Sink`. :class:`~privmon.PrivacyMonitor` calls ``write`` once per successful check, on rank
0 only under ``torch.distributed``, and ``close`` from ``monitor.close()``. An exception raised by
``write`` is logged and skipped like any failure inside a check (``strict=True`` re-raises), so a
sink never stops training.

```python
class PrintSink:
    def write(self, report):
        print(report.step, report.scalars["privacy/loss/histogram/value"])

    def close(self):
        pass

monitor = privmon.PrivacyMonitor(query, members, nonmembers, sinks=[PrintSink()])
```

``report.scalars`` is a flat ``{tag: float}`` dict (the TensorBoard tags, all under
``privacy/``); :func:`finite_scalars` drops the NaN / infinite ones for loggers that refuse them.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from privmon.report import Report

__all__ = ["Sink", "finite_scalars"]


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(report)`` and ``close()`` (structural: no inheritance needed)."""

    def write(self, report: Report) -> None:
        """Record one check's report (called once per successful check, on rank 0)."""
        ...

    def close(self) -> None:
        """Flush and release what the sink owns (called by ``monitor.close()``)."""
        ...


def finite_scalars(report: Report) -> dict[str, float]:
    """The report's scalars without NaN / infinite values (e.g. an ε lower bound of ``inf``)."""
    return {k: float(v) for k, v in report.scalars.items() if math.isfinite(v)}
