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

Planned checks: at the handler's first call a monitor given no ``planned_checks`` plans them
from the run's length (:meth:`~privmon.PrivacyMonitor.plan`), when the handler runs on every
iteration (the default event, unfiltered): ``engine.state.max_iters``, else
``max_epochs × epoch_length`` when both are known (an epoch length Ignite cannot read from the
data leaves the checks unplanned). Each check then certifies at 0.9·δ / planned checks. Load a
checkpoint's monitor state before ``trainer.run``: a resumed run keeps the plan it was saved
under.

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
from privmon.integrations._common import new_report, plan_checks, publish

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
    # the monitor sees every iteration only on the plain event: a filter or another event
    # skips some, and the checks the run's length implies would be more than it gets
    every_iteration = event == Events.ITERATION_COMPLETED and getattr(event, "filter", None) is None
    planned = False

    def _privacy_check(engine: Any) -> None:
        nonlocal planned
        if not planned:  # before the run's first check
            planned = True
            if every_iteration:
                total, source = _total_iterations(engine.state), "the run's last iteration"
            else:
                total, source = None, f"the handler runs on {event!r}, not on every iteration"
            plan_checks(monitor, total, source=source)
        before = monitor.last_report
        stop = monitor.step(int(engine.state.iteration))
        report = new_report(monitor, before)
        if report is not None and metrics:
            publish(monitor, report, engine.state.metrics.update, what="engine.state.metrics")
        if stop:
            engine.terminate()

    return engine.add_event_handler(event, _privacy_check)


def _total_iterations(state: Any) -> int | None:
    """The iteration an Ignite run ends at: ``max_iters``, else ``max_epochs × epoch_length``;
    None when unknown."""
    max_iters = getattr(state, "max_iters", None)
    if max_iters is not None:
        return int(max_iters)
    epochs, length = state.max_epochs, state.epoch_length
    return None if epochs is None or length is None else int(epochs) * int(length)
