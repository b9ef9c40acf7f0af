"""Table synthesizers: run a :class:`~privmon.PrivacyMonitor` while a ctgan ``CTGAN`` /
``TVAE`` or an SDV ``CTGANSynthesizer`` / ``TVAESynthesizer`` / ``CopulaGANSynthesizer`` fits.

Their ``fit`` runs every epoch inside one call, with no callback. :func:`attach` watches it
through torch's public global module-forward hook: before the released module (CTGAN's
generator, TVAE's decoder) first runs after an epoch ends — its weights and BatchNorm statistics
are then exactly those at the end of that epoch — and once more after ``fit`` returns, it steps
the monitor with the epoch as its step (``every_n_steps`` counts epochs). With
early stopping, the fit ends at the first check whose figure crosses the budget, and the
synthesizer is left with the weights of the last check within it (one copy kept in memory), so
its ``sample()`` releases data from a point the monitor vouched for. User guide: *Synthetic
tables*.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from privmon.callbacks.monitor import PrivacyMonitor
from privmon.integrations._common import new_report, plan_checks
from privmon.queries.synthesizers import SynthesizerModel, synthesizer_model

__all__ = ["SynthesizerRun", "SynthesizerStopped", "attach"]


class SynthesizerStopped(Exception):
    """Raised inside a synthesizer's ``fit`` to end it at a stop; the ``with attach(...)``
    block that caused it catches it (it only escapes a fit run outside that block)."""


class SynthesizerRun:
    """What :func:`attach` returns: a context manager around one ``fit`` of the synthesizer.

    Attributes:
        stopped_at: the epoch whose check stopped the fit (None: it ran to its end).
        restored_epoch: the epoch whose weights the synthesizer was left with after a stop
            (the last check whose figure was within the budget; 0, the initial weights, when
            none was); the monitor says it on the console, to every sink and in the report.
        epochs: the epochs the fit completed.
    """

    def __init__(self, synthesizer: Any, monitor: PrivacyMonitor) -> None:
        self.model: SynthesizerModel = synthesizer_model(synthesizer)
        if not isinstance(monitor, PrivacyMonitor):
            raise TypeError(
                f"monitor must be a privmon.PrivacyMonitor, got {type(monitor).__name__}"
            )
        self.monitor = monitor
        self.stopped_at: int | None = None
        self.restored_epoch: int | None = None
        self.epochs = 0
        self._kept: tuple[int, list[dict[str, torch.Tensor]]] | None = None
        self._checking = False
        self._hook: Any = None

    def __enter__(self) -> SynthesizerRun:
        if self._hook is not None or self.epochs:
            raise RuntimeError(
                "a SynthesizerRun watches one fit: for another, call attach() again with a "
                "fresh monitor (a monitor's steps, the epochs, only move forward)"
            )
        plan_checks(self.monitor, self.model.planned_epochs(), source=f"{self.model.name} epochs")
        self._hook = register_module_forward_pre_hook(self._before_forward)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        self._hook.remove()
        self._hook = None
        if exc is None:
            try:
                self._epochs_ended()  # the fit's last epoch, which no optimizer step follows
            except SynthesizerStopped:
                self._restore()
            return False
        if isinstance(exc, SynthesizerStopped) and self.stopped_at is not None:
            self._restore()
            return True
        return False

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """torch's global module-forward pre-hook: the released module is about to run; did an
        epoch end since it last ran?"""
        if self._checking or self.model.model is None:  # the checks' own forwards; SDV before
            return  # its model exists
        try:
            released = self.model.modules()
        except ValueError:  # no generator yet
            return
        if not any(module is m for m in released):
            return
        if self._kept is None:
            self._kept = (0, self.model.weights())  # what a stop at the first check restores
        self._epochs_ended()

    def _epochs_ended(self) -> None:
        """Step the monitor at the epoch just completed; raise SynthesizerStopped on a stop."""
        done = self.model.epochs_done()
        if done <= self.epochs:
            return
        self.epochs = done
        before = self.monitor.last_report
        self._checking = True
        try:
            stop = self.monitor.step(done)
        finally:
            self._checking = False
        if stop:
            self.stopped_at = done
            raise SynthesizerStopped(f"privmon stopped the fit at epoch {done}")
        report = new_report(self.monitor, before)
        decision = None if report is None else report.stopping
        if decision is not None and decision.last_within == done:  # within the budget
            self._keep(done)

    def _keep(self, epoch: int) -> None:
        """The weights of a check within the budget, copied into the one copy kept."""
        if self._kept is None:
            self._kept = (epoch, self.model.weights())
            return
        with torch.no_grad():
            for kept, now in zip(self._kept[1], self.model.modules(), strict=True):
                for key, value in now.state_dict().items():
                    kept[key].copy_(value)
        self._kept = (epoch, self._kept[1])

    def _restore(self) -> None:
        if self._kept is None:  # stopped before any weight existed: nothing to put back
            return
        epoch, weights = self._kept
        self.model.load_weights(weights)
        self.model.end_stopped_fit()
        self.restored_epoch = epoch
        self.monitor.say_restored(step=epoch)  # the console, every sink, the report's verdict


def attach(synthesizer: Any, monitor: PrivacyMonitor) -> SynthesizerRun:
    """Watch one ``fit`` of ``synthesizer`` with ``monitor``: ``with attach(...): fit(...)``.

    The monitor's steps are the synthesizer's epochs (``every_n_steps=10``: a check every 10
    epochs, and its checks are planned from the synthesizer's epochs); its queries are usually
    :class:`~privmon.queries.SynthesizerQuery` objects of the same synthesizer. Training is left
    exactly as it was: with or without the monitor, the weights are bit-identical.

    Examples:
        >>> import pandas as pd
        >>> from ctgan import TVAE
        >>> import privmon
        >>> from privmon.integrations.synthesizers import attach
        >>> from privmon.queries import SynthesizerQuery
        >>> pool = pd.DataFrame({"x": [0.01 * i for i in range(300)], "c": ["a", "b", "c"] * 100})
        >>> members, heldout, reference = pool.iloc[:40], pool.iloc[40:80], pool.iloc[100:]
        >>> tvae = TVAE(epochs=4, batch_size=20, enable_gpu=False)
        >>> monitor = privmon.PrivacyMonitor(
        ...     SynthesizerQuery(tvae, reference, n_samples=500), [members], [heldout],
        ...     every_n_steps=2,  # epochs
        ... )
        >>> with attach(tvae, monitor) as run:
        ...     tvae.fit(members, discrete_columns=["c"])
        >>> monitor.history.steps.tolist(), run.stopped_at
        ([2, 4], None)
    """
    return SynthesizerRun(synthesizer, monitor)
