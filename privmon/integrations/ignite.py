"""PyTorch-Ignite adapter: run a :class:`~privmon.PrivacyMonitor` from an Ignite ``Engine``.

```python
from privmon.integrations.ignite import attach

handle = attach(trainer, monitor)  # after every iteration
trainer.run(loader, max_epochs=10)
```

The handler is thin: on ``event`` it calls ``monitor.step(engine.state.iteration)`` — the
iteration counter runs across epochs, like a global step — and calls ``engine.terminate()`` when the
monitor says stop (Ignite finishes the current iteration's handlers, fires ``TERMINATE`` and
``COMPLETED``, and leaves ``engine.state.iteration`` at the stopping step).

Metrics: after each check the report's finite scalars are written into ``engine.state.metrics``
(tag -> float, e.g. ``engine.state.metrics["privacy/loss/histogram/value"]``) and stay there
until the next check, so Ignite's logger handlers that read the metrics — ``TensorboardLogger``
/ ``MLflowLogger`` / ``WandBLogger`` with ``OutputHandler(metric_names="all")`` — log them. Attach
such a handler *after* this one on the same event so it sees the fresh figures. (Ignite's
MLflow handler drops names MLflow refuses, such as ``privacy/loss/tpr@fpr=0.01``, with a
warning; :class:`privmon.sinks.MlflowSink` logs them as ``tpr_at_fpr_0.01``.)
``attach(..., metrics=False)`` leaves ``engine.state.metrics`` alone.

To resume, put the monitor into Ignite's checkpoint dictionary: it has ``state_dict`` /
``load_state_dict``, e.g. ``Checkpoint({"model": model, "trainer": trainer, "privmon": monitor},
...)`` and ``Checkpoint.load_objects``. Sinks are not closed by the handler: call
``monitor.close()`` when done.

``import privmon`` never imports ``ignite``: only calling :func:`attach` does.
"""

from __future__ import annotations

from typing import Any

from privmon._validation import check_flag
from privmon.callbacks.monitor import PrivacyMonitor
from privmon.integrations._common import new_report, publish

__all__ = ["attach"]


def attach(engine: Any, monitor: PrivacyMonitor, event: Any = None, *, metrics: bool = True) -> Any:
    """Step ``monitor`` on ``event`` of ``engine`` (default ``Events.ITERATION_COMPLETED``).

    ``event`` may carry an Ignite filter (``Events.ITERATION_COMPLETED(every=50)``); the monitor's
    own ``every_n_steps`` still decides which iterations are checked. ``metrics``: write each
    report's finite scalars into ``engine.state.metrics`` (default True). Returns the
    ``RemovableEventHandle`` of the handler (``handle.remove()`` detaches it).
    """
    try:
        from ignite.engine import Events
    except ImportError as err:
        raise ImportError(
            "privmon.integrations.ignite needs PyTorch-Ignite: pip install 'privmon[ignite]'"
        ) from err
    if not callable(getattr(monitor, "step", None)):
        raise ValueError(f"monitor must be a privmon.PrivacyMonitor, got {monitor!r}")
    if not callable(getattr(engine, "add_event_handler", None)):
        raise ValueError(f"engine must be an ignite.engine.Engine, got {engine!r}")
    check_flag(metrics, name="metrics")
    if event is None:
        event = Events.ITERATION_COMPLETED

    def _privacy_check(engine: Any) -> None:
        before = monitor.last_report
        stop = monitor.step(int(engine.state.iteration))
        report = new_report(monitor, before)
        if report is not None and metrics:
            publish(monitor, report, engine.state.metrics.update, what="engine.state.metrics")
        if stop:
            engine.terminate()

    return engine.add_event_handler(event, _privacy_check)
