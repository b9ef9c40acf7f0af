"""PyTorch-Ignite adapter: run a :class:`~privmon.PrivacyMonitor` from an Ignite ``Engine``.

:func:`attach` adds a thin handler: it steps the monitor at ``engine.state.iteration`` (a global
step across epochs), calls ``engine.terminate()`` when the monitor says stop, plans the checks
from the run's length, and writes each report's finite scalars into ``engine.state.metrics``,
where Ignite's logger handlers find them (early stopping's decision among them, and its outcome
when the run completes or terminates). To resume, put the monitor into Ignite's
``Checkpoint`` dictionary (it has ``state_dict`` / ``load_state_dict``). User guide:
*PyTorch-Ignite*. ``import privmon`` never imports ``ignite``: only calling :func:`attach` does.
"""

from __future__ import annotations

from typing import Any

from privmon._shown import shown
from privmon._validation import check_flag
from privmon.callbacks.monitor import PrivacyMonitor
from privmon.integrations._common import new_report, plan_checks, publish, publish_outcome

__all__ = ["attach"]


def attach(engine: Any, monitor: PrivacyMonitor, event: Any = None, *, metrics: bool = True) -> Any:
    """Step ``monitor`` on ``event`` of ``engine`` (default ``Events.ITERATION_COMPLETED``).

    At its first call the handler plans the checks of a monitor given no ``planned_checks``
    (:meth:`~privmon.PrivacyMonitor.plan`) from ``engine.state.max_iters``, else
    ``max_epochs × epoch_length``, when it runs on every iteration (the default event,
    unfiltered); otherwise, or when the length is unknown, the checks stay unplanned. Ignite
    finishes the iteration's handlers after ``terminate()``, and ``engine.state.iteration`` stays
    at the stopping step. The handler does not close the monitor's sinks: call
    ``monitor.close()`` when done.

    Args:
        engine: the Ignite ``Engine`` that trains.
        monitor: the :class:`~privmon.PrivacyMonitor` to step.
        event: the event to run on; may carry a filter (``Events.ITERATION_COMPLETED(every=50)``),
            while the monitor's ``every_n_steps`` still decides which iterations are checked.
        metrics: write each report's finite scalars into ``engine.state.metrics`` (default
            True), where they stay until the next check; attach logger handlers (e.g.
            ``OutputHandler(metric_names="all")``) after this one on the same event.

    Returns:
        The check handler's ``RemovableEventHandle`` (``handle.remove()`` detaches it; the
        handler that writes early stopping's outcome at the run's end stays).

    Examples:
        >>> import torch
        >>> from ignite.engine import Engine
        >>> from torch import nn
        >>> import privmon
        >>> from privmon.integrations.ignite import attach
        >>> from privmon.queries import LossQuery
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 3)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
        >>> def train_step(engine, batch):
        ...     optimizer.zero_grad()
        ...     nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        ...     optimizer.step()
        >>> monitor = privmon.PrivacyMonitor(
        ...     LossQuery(model), [(x[:20], y[:20])], [(x[20:], y[20:])], every_n_steps=5
        ... )
        >>> trainer = Engine(train_step)
        >>> handle = attach(trainer, monitor)
        >>> _ = trainer.run([(x[:20], y[:20])] * 5, max_epochs=2)
        >>> monitor.last_report.step, "privacy/loss/auc" in trainer.state.metrics
        (10, True)
        >>> monitor.close()
    """
    try:
        from ignite.engine import Events
    except ImportError as err:
        raise ImportError(
            "privmon.integrations.ignite needs PyTorch-Ignite: pip install 'privmon[ignite]'"
        ) from err
    if not callable(getattr(monitor, "step", None)):
        raise ValueError(f"monitor must be a privmon.PrivacyMonitor, got {shown(monitor)}")
    if not callable(getattr(engine, "add_event_handler", None)):
        raise ValueError(f"engine must be an ignite.engine.Engine, got {shown(engine)}")
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

    said = False

    def _outcome(engine: Any) -> None:  # once, at COMPLETED or TERMINATE (both may fire)
        nonlocal said
        if metrics and not said:
            said = True
            publish_outcome(monitor, engine.state.metrics.update, what="engine.state.metrics")

    for end in (Events.TERMINATE, Events.COMPLETED):
        engine.add_event_handler(end, _outcome)
    return engine.add_event_handler(event, _privacy_check)


def _total_iterations(state: Any) -> int | None:
    """The iteration an Ignite run ends at: ``max_iters``, else ``max_epochs × epoch_length``;
    None when unknown."""
    max_iters = getattr(state, "max_iters", None)
    if max_iters is not None:
        return int(max_iters)
    epochs, length = state.max_epochs, state.epoch_length
    return None if epochs is None or length is None else int(epochs) * int(length)
