"""PyTorch Lightning adapter: run a :class:`~privmon.PrivacyMonitor` from a Lightning ``Trainer``.

:class:`PrivacyMonitorCallback` is thin: after every training batch it steps the monitor at
``trainer.global_step`` (optimizer steps), sets ``trainer.should_stop`` when the monitor says
stop (Lightning's own mechanism, as ``EarlyStopping``), plans the checks from the run's length,
writes each report's finite scalars to every logger in ``trainer.loggers`` (as
``LearningRateMonitor`` does; early stopping's decision among them, and its outcome at the end
of training), and carries the monitor's state in Lightning checkpoints.
User guide: *PyTorch Lightning*. Lightning is imported from ``lightning.pytorch``, else from the
standalone ``pytorch_lightning``; ``import privmon`` imports neither, only this module does.
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

from privmon._shown import shown
from privmon._validation import check_flag
from privmon.callbacks.monitor import PrivacyMonitor
from privmon.integrations._common import new_report, plan_checks, publish, publish_outcome

__all__ = ["PrivacyMonitorCallback"]


class PrivacyMonitorCallback(Callback):
    """Lightning callback that runs ``monitor`` after every training batch.

    The monitor's state (history, early-stopping counters, last checked step) travels in
    Lightning checkpoints through :meth:`state_dict`: ``trainer.fit(module, ckpt_path=...)`` with
    a fresh monitor continues the history without checking a step twice. Under a distributed
    strategy every rank steps its own monitor, and the stop decision of a due check is combined
    across ranks with the strategy's ``reduce_boolean_decision`` (any rank stops all), as
    Lightning's ``EarlyStopping`` does. The callback does not close the monitor's sinks.

    Args:
        monitor: the :class:`~privmon.PrivacyMonitor` to step.
        log_to_loggers: write each new report's finite scalars to every entry of
            ``trainer.loggers`` at the check's global step (rank 0 only). Default True.

    Examples:
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import privmon
        >>> from privmon.integrations.lightning import PrivacyMonitorCallback
        >>> from privmon.queries import LossQuery
        >>> class Classifier(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = nn.Linear(4, 3)
        ...     def training_step(self, batch, batch_idx):
        ...         return nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
        >>> module = Classifier()
        >>> monitor = privmon.PrivacyMonitor(
        ...     LossQuery(module.net), [(x[:20], y[:20])], [(x[20:], y[20:])], every_n_steps=5
        ... )
        >>> trainer = pl.Trainer(
        ...     max_steps=10,
        ...     callbacks=[PrivacyMonitorCallback(monitor)],
        ...     logger=False,
        ...     enable_checkpointing=False,
        ...     enable_progress_bar=False,
        ...     enable_model_summary=False,
        ... )
        >>> trainer.fit(module, DataLoader(TensorDataset(x[:20], y[:20]), batch_size=4))
        >>> monitor.last_report.step, len(monitor.history.steps)
        (10, 2)
        >>> monitor.close()
    """

    def __init__(self, monitor: PrivacyMonitor, *, log_to_loggers: bool = True) -> None:
        if not callable(getattr(monitor, "step", None)) or not callable(
            getattr(monitor, "state_dict", None)
        ):
            raise ValueError(
                f"monitor must be a privmon.PrivacyMonitor (with step and state_dict), "
                f"got {shown(monitor)}"
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
        """Plan the checks of a monitor given no ``planned_checks`` from the run's length
        (:meth:`~privmon.PrivacyMonitor.plan`): ``trainer.estimated_stepping_batches`` when
        finite, else ``trainer.max_steps`` when set. Runs after Lightning restored a
        checkpoint's callback state, so a resumed run keeps the plan it was saved under."""
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

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """With early stopping, log its outcome's numbers (stopped or not, the stop's step, the
        highest figure and its step) to every logger at the last step (rank 0 only)."""
        if not self.log_to_loggers or not trainer.is_global_zero:
            return
        for lg in trainer.loggers:
            write = functools.partial(lg.log_metrics, step=int(trainer.global_step))
            publish_outcome(self.monitor, write, what=type(lg).__name__)

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, saved in Lightning checkpoints."""
        return {"monitor": self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the monitor's state from a Lightning checkpoint."""
        self.monitor.load_state_dict(state_dict["monitor"])
