"""PyTorch Lightning adapter: run a :class:`~privmon.PrivacyMonitor` from a Lightning ``Trainer``.

```python
from privmon.integrations.lightning import PrivacyMonitorCallback

trainer = lightning.pytorch.Trainer(callbacks=[PrivacyMonitorCallback(monitor)], ...)
trainer.fit(module)
```

The callback is thin: after every training batch it calls ``monitor.step(trainer.global_step)``
(the monitor decides whether a check is due, and it protects modes, BatchNorm statistics and RNGs),
and when the monitor says stop it sets ``trainer.should_stop = True`` — Lightning's own mechanism,
so ``min_epochs`` / ``min_steps`` still apply and validation still runs at the end as with
Lightning's ``EarlyStopping``. ``trainer.global_step`` counts optimizer steps, so with gradient
accumulation a check runs once per optimizer step, not once per batch.

Loggers: like Lightning's ``LearningRateMonitor``, the callback writes each new report's finite
scalars (``privacy/<query>/<method>/value``, ``…/lower``, ``privacy/<query>/auc``, …) to every
logger in ``trainer.loggers`` — TensorBoardLogger, CSVLogger, MLFlowLogger, WandbLogger, … —
with ``logger.log_metrics(scalars, step=report.step)``, the check's global step, from global rank
0 only. ``PrivacyMonitorCallback(monitor, log_to_loggers=False)`` turns that off (the monitor's
own sinks still write).

Planned checks: at ``on_train_start`` — after Lightning restored a checkpoint's callback state —
a monitor given no ``planned_checks`` plans them from the run's length
(:meth:`~privmon.PrivacyMonitor.plan`): ``trainer.estimated_stepping_batches`` when finite
(the optimizer steps until ``max_steps`` or ``max_epochs``, whichever ends the run first), else
``trainer.max_steps`` when set (the epochs' length unknown). Lightning's default when neither
is set is 1000 epochs, a plan far longer than a run stopped early by other means: pass
``max_steps`` / ``max_epochs`` or ``planned_checks``. Each check
then certifies at 0.9·δ / planned checks. A resumed run keeps the plan it was saved under.

The monitor's state (history of scalars, early-stopping counters, last checked step) travels in
Lightning checkpoints through the callback's ``state_dict`` / ``load_state_dict``: resuming with
``trainer.fit(module, ckpt_path=...)`` and a fresh monitor continues the history without checking
a step twice. Sinks are not closed by the callback: call ``monitor.close()`` when done.

Lightning is imported from ``lightning.pytorch`` (the ``lightning`` package), or from the standalone
``pytorch_lightning`` package when that is the only one installed. ``import privmon`` never imports
either: only importing this module does.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # one of the two at type-checking time
    from lightning.pytorch.callbacks import Callback
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # the standalone package
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError as err:
            raise ImportError(
                "privmon.integrations.lightning needs PyTorch Lightning: "
                "pip install 'privmon[lightning]' (or pip install lightning)"
            ) from err

from privmon._validation import check_flag
from privmon.callbacks.monitor import PrivacyMonitor
from privmon.integrations._common import new_report, plan_checks, publish

__all__ = ["PrivacyMonitorCallback"]


class PrivacyMonitorCallback(Callback):
    """Lightning callback that runs ``monitor`` after every training batch.

    Args:
        monitor: the :class:`~privmon.PrivacyMonitor` to step.
        log_to_loggers: write each new report's finite scalars to every entry of
            ``trainer.loggers`` at the check's global step (rank 0 only). Default True.

    Under a distributed strategy every rank steps its own monitor (the monitor decides what each
    rank queries and writes); the stop decision of a due check is combined across ranks with the
    strategy's ``reduce_boolean_decision`` (any rank stops all), as Lightning's ``EarlyStopping``
    does, so that no rank waits for another that has left the loop.
    """

    def __init__(self, monitor: PrivacyMonitor, *, log_to_loggers: bool = True) -> None:
        if not callable(getattr(monitor, "step", None)) or not callable(
            getattr(monitor, "state_dict", None)
        ):
            raise ValueError(
                f"monitor must be a privmon.PrivacyMonitor (with step and state_dict), "
                f"got {monitor!r}"
            )
        self.monitor = monitor
        self.log_to_loggers = check_flag(log_to_loggers, name="log_to_loggers")

    @property
    def state_key(self) -> str:
        """This callback's key in a Lightning checkpoint: distinct monitors (different
        queries) keep distinct entries."""
        names = tuple(getattr(q, "name", "?") for q in getattr(self.monitor, "queries", ()))
        return self._generate_state_key(queries=names)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Plan the monitor's checks from the run's length (module docstring)."""
        # estimated_stepping_batches already ends the run at the first of max_steps and
        # max_epochs; max_steps alone serves where the epochs' length is unknown
        try:
            estimated = float(trainer.estimated_stepping_batches)
        except Exception:  # e.g. gradient accumulation that changes between epochs
            estimated = math.inf
        if math.isfinite(estimated):
            plan_checks(self.monitor, estimated, source="trainer.estimated_stepping_batches")
            return
        max_steps = int(getattr(trainer, "max_steps", -1))
        plan_checks(self.monitor, max_steps if max_steps > 0 else None, source="trainer.max_steps")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Step the monitor at ``trainer.global_step``, log a new report to the loggers and set
        ``trainer.should_stop`` when the monitor (on any rank) says stop."""
        step = int(trainer.global_step)
        if step == 0:  # no optimizer step yet (gradient accumulation): nothing trained to audit
            return
        before = self.monitor.last_report
        stop = bool(self.monitor.step(step))
        report = new_report(self.monitor, before)
        if report is not None and self.log_to_loggers and trainer.is_global_zero:
            for lg in trainer.loggers:
                write = functools.partial(lg.log_metrics, step=int(report.step))
                publish(self.monitor, report, write, what=type(lg).__name__)
        if step % self.monitor.every_n_steps == 0:  # the same steps on every rank
            stop = bool(trainer.strategy.reduce_boolean_decision(stop, all=False))
        if stop:
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, saved in Lightning checkpoints."""
        return {"monitor": self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the monitor's state from a Lightning checkpoint."""
        self.monitor.load_state_dict(state_dict["monitor"])
