"""Hugging Face ``transformers`` adapter: run a :class:`~privmon.PrivacyMonitor` from a ``Trainer``.

```python
from privmon.integrations.transformers import attach

trainer = transformers.Trainer(..., args=TrainingArguments(..., report_to=["tensorboard"]))
attach(trainer, monitor)  # adds a PrivacyMonitorCallback that knows its trainer
trainer.train()
```

The callback is thin: at the end of every optimizer step (``on_step_end``) it calls
``monitor.step(state.global_step)`` — the monitor decides whether a check is due and protects the
model's mode and every RNG — and when the monitor says stop it sets
``control.should_training_stop = True``, the Trainer's own mechanism.

Logging: after each check the callback passes the report's finite scalars to ``trainer.log`` —
the Trainer's own logging path — so they land in ``trainer.state.log_history`` (with ``step`` =
the check's global step) and reach every ``report_to`` integration (TensorBoard, MLflow, Weights &
Biases, …) through its ``on_log``. A ``TrainerCallback`` is not given the Trainer, so the callback
must be told it: :func:`attach` does that, as does ``PrivacyMonitorCallback(monitor,
trainer=trainer)`` added with ``trainer.add_callback``. A callback built without a trainer (e.g.
in ``Trainer(callbacks=[...])``) still steps the monitor and warns once that the figures do not
reach the Trainer's loggers; ``log_to_trainer=False`` opts out of the logging and the warning.

Console: the Trainer's console printers (its ``ProgressCallback``, or ``PrinterCallback`` with
``disable_tqdm``) would print every scalar of every check, dozens per query. They are left out
of that ``trainer.log`` call and are handed, instead, what ``console`` selects:

* ``"headline"`` (default): per query its AUC (``privacy/<query>/auc``) and the value and
  certified lower bound of its method with the highest lower bound (``privacy/<query>/adv``,
  ``privacy/<query>/lower``; in ``log_history`` as ``privacy/<query>/<method>/value`` and
  ``…/lower``), plus ``privacy/epsilon`` and ``privacy/dp_violation`` when an accountant is
  given: one short line per check;
* ``"all"``: every scalar, as ``log_history`` has them;
* ``"none"``: nothing;
* a sequence of ``fnmatch`` patterns over the tags (e.g. ``["privacy/*/auc"]``): those scalars.

Only the console changes: ``log_history`` and the ``report_to`` integrations get every figure
whatever ``console`` says.

Planned checks: at ``on_train_begin`` (after a resumed run's state is loaded) a monitor given no
``planned_checks`` plans them from ``state.max_steps``, the run's optimizer steps
(:meth:`~privmon.PrivacyMonitor.plan`): each check then certifies at 0.9·δ / planned checks. A
resumed run keeps the plan it was saved under.

Checkpoints: when the Trainer saves a checkpoint (``on_save``) the monitor's state is written
with ``torch.save`` as ``privmon_monitor.pt`` into that checkpoint folder
(``<output_dir>/checkpoint-<step>``). When ``trainer.train(resume_from_checkpoint=...)`` resumes
from such a folder, ``on_train_begin`` loads it back (``torch.load(..., weights_only=True)``: the
state holds only tensors and plain Python values), so the history continues without checking a
step twice. (The Trainer's own ``ExportableState`` mechanism cannot carry the monitor: it rebuilds
callbacks from JSON arguments.) The folder is found from ``args.resume_from_checkpoint`` when
set, else as ``<output_dir>/checkpoint-<global step resumed at>``. Sinks are not closed by the
callback: call ``monitor.close()`` when done.

``import privmon`` never imports ``transformers``: only importing this module does.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
except ImportError as err:
    raise ImportError(
        "privmon.integrations.transformers needs Hugging Face transformers: "
        "pip install 'privmon[transformers]'"
    ) from err

from privmon._validation import check_flag, check_has_methods
from privmon.callbacks.monitor import PrivacyMonitor
from privmon.integrations._common import new_report, plan_checks, publish
from privmon.report import Report, tags
from privmon.sinks.base import finite_scalars

__all__ = ["CONSOLE_MODES", "STATE_FILE", "PrivacyMonitorCallback", "attach", "console_scalars"]

logger = logging.getLogger("privmon")

STATE_FILE = "privmon_monitor.pt"
"""The file in each ``checkpoint-<step>`` folder that holds the monitor's state."""

CONSOLE_MODES: tuple[str, ...] = ("headline", "all", "none")
"""What the Trainer's console shows of each check, besides a sequence of tag patterns."""

Console = Literal["headline", "all", "none"] | Sequence[str]

# the Trainer's callbacks that print each log dict on the console
_CONSOLE_PRINTERS = (ProgressCallback, PrinterCallback)


def _check_console(console: Any) -> str | tuple[str, ...]:
    if isinstance(console, str):
        if console not in CONSOLE_MODES:
            raise ValueError(
                f"console must be one of {CONSOLE_MODES} or a sequence of tag patterns, "
                f"got {console!r}"
            )
        return console
    patterns = tuple(console) if isinstance(console, Sequence) else ()
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(
            f"console must be one of {CONSOLE_MODES} or a non-empty sequence of tag patterns "
            f"(e.g. [{tags.auc('*')!r}]), got {console!r}"
        )
    return patterns


def console_scalars(report: Report, console: Console = "headline") -> dict[str, float]:
    """The figures of ``report`` the Trainer's console shows for ``console`` (module docstring):
    finite values only, in the report's order."""
    mode = _check_console(console)
    scalars = finite_scalars(report)
    if mode == "all":
        return scalars
    if mode == "none":
        return {}
    if isinstance(mode, tuple):
        return {k: v for k, v in scalars.items() if any(fnmatch.fnmatchcase(k, p) for p in mode)}
    out: dict[str, float] = {}
    for name, result in report.queries.items():
        if tags.auc(name) in scalars:
            out[tags.auc(name)] = scalars[tags.auc(name)]
        figures = [(est.lower, est.value) for est in result.estimates.values()]
        figures = [(lo, v) for lo, v in figures if math.isfinite(lo) and math.isfinite(v)]
        if figures:
            lower, value = max(figures)  # the method with the highest certified lower bound
            out[tags.console_advantage(name)] = value
            out[tags.console_lower(name)] = lower
    for tag in (tags.EPSILON, tags.DP_VIOLATION):
        if tag in scalars:
            out[tag] = scalars[tag]
    return out


class PrivacyMonitorCallback(TrainerCallback):
    """``transformers.TrainerCallback`` that steps ``monitor`` after every optimizer step.

    Args:
        monitor: the :class:`~privmon.PrivacyMonitor` to step.
        trainer: the ``transformers.Trainer`` whose ``log`` receives each report's finite
            scalars (set by :func:`attach`).
        log_to_trainer: log the figures through ``trainer.log`` (default True).
        console: what the Trainer's console printers show of each check: "headline" (default),
            "all", "none" or a sequence of ``fnmatch`` tag patterns (module docstring);
            ``log_history`` and ``report_to`` get every figure whatever it says.
    """

    def __init__(
        self,
        monitor: PrivacyMonitor,
        *,
        trainer: Any = None,
        log_to_trainer: bool = True,
        console: Console = "headline",
    ) -> None:
        if not callable(getattr(monitor, "step", None)) or not callable(
            getattr(monitor, "state_dict", None)
        ):
            raise ValueError(
                f"monitor must be a privmon.PrivacyMonitor (with step and state_dict), "
                f"got {monitor!r}"
            )
        if trainer is not None:
            check_has_methods(trainer, "log", name="trainer", expected="a transformers.Trainer")
        self.monitor = monitor
        self.trainer = trainer
        self.log_to_trainer = check_flag(log_to_trainer, name="log_to_trainer")
        self.console = _check_console(console)
        self._warned = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Step the monitor at ``state.global_step``, log a new report through the Trainer and
        set ``control.should_training_stop`` when the monitor says stop."""
        before = self.monitor.last_report
        if self.monitor.step(int(state.global_step)):
            control.should_training_stop = True
        report = new_report(self.monitor, before)
        if report is not None and self.log_to_trainer and self.trainer is not None:
            # Trainer.log adds "epoch" to the dict it is given and appends a copy with "step"
            # (state.global_step, the check's step) to state.log_history, then calls every
            # callback's on_log: the report_to integrations write the figures there.
            printers = [] if self.console == "all" else self._console_printers()
            with self._without(printers):
                publish(self.monitor, report, self.trainer.log, what="the Trainer's log")
            figures = console_scalars(report, self.console) if printers else {}
            if figures:
                logs = {**figures, "epoch": state.epoch} if state.epoch is not None else figures
                for printer in printers:
                    printer.on_log(args, state, control, logs=dict(logs))
        return control

    def _console_printers(self) -> list[Any]:
        handler = getattr(self.trainer, "callback_handler", None)
        callbacks = getattr(handler, "callbacks", [])
        return [cb for cb in callbacks if isinstance(cb, _CONSOLE_PRINTERS)]

    @contextmanager
    def _without(self, printers: list[Any]) -> Iterator[None]:
        """The Trainer's callbacks without ``printers`` for the duration (restored after)."""
        if not printers:
            yield
            return
        handler = self.trainer.callback_handler
        every = handler.callbacks
        handler.callbacks = [cb for cb in every if not any(cb is p for p in printers)]
        try:
            yield
        finally:
            handler.callbacks = every

    # -- checkpoints ------------------------------------------------------------------------------
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Save the monitor's state as :data:`STATE_FILE` in the checkpoint folder just written."""
        if getattr(args, "should_save", True):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(folder):
                payload = {
                    "global_step": int(state.global_step),
                    "monitor": self.monitor.state_dict(),
                }
                torch.save(payload, os.path.join(folder, STATE_FILE))
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """On a resumed run, restore the monitor's state from the checkpoint's
        :data:`STATE_FILE` (a warning when none is found); then plan the monitor's checks from
        ``state.max_steps`` (module docstring)."""
        self._restore(args, state)
        plan_checks(self.monitor, state.max_steps, source="state.max_steps")
        return control

    def _restore(self, args: Any, state: Any) -> None:
        """Load the monitor's state on a resumed run (on_train_begin)."""
        if self.log_to_trainer and self.trainer is None and not self._warned:
            self._warned = True
            logger.warning(
                "privmon: the PrivacyMonitorCallback does not know its Trainer, so the privacy "
                "figures reach neither log_history nor report_to; use "
                "privmon.integrations.transformers.attach(trainer, monitor) (or "
                "log_to_trainer=False to silence this)"
            )
        step = int(state.global_step)
        if step == 0:  # a fresh run
            return
        candidates = []
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str):
            candidates.append(resume)
        candidates.append(os.path.join(args.output_dir, f"checkpoint-{step}"))
        for folder in candidates:
            path = os.path.join(folder, STATE_FILE)
            if not os.path.isfile(path):
                continue
            payload = torch.load(path, map_location="cpu", weights_only=True)
            if int(payload.get("global_step", -1)) != step:
                continue
            self.monitor.load_state_dict(payload["monitor"])
            return
        logger.warning(
            "privmon: training resumed at step %s but no %s was found in %s; the monitor's "
            "history starts afresh",
            step,
            STATE_FILE,
            candidates,
        )


def attach(
    trainer: Any,
    monitor: PrivacyMonitor,
    *,
    log_to_trainer: bool = True,
    console: Console = "headline",
) -> Any:
    """Add a :class:`PrivacyMonitorCallback` for ``monitor`` to ``trainer`` and return it.

    The callback steps the monitor after every optimizer step and, unless ``log_to_trainer`` is
    False, logs each report's finite scalars through ``trainer.log`` (``log_history`` and every
    ``report_to`` integration), while the console shows what ``console`` selects ("headline":
    a short line per check; "all", "none", or tag patterns; module docstring).
    """
    check_has_methods(
        trainer, "log", "add_callback", name="trainer", expected="a transformers.Trainer"
    )
    callback = PrivacyMonitorCallback(
        monitor, trainer=trainer, log_to_trainer=log_to_trainer, console=console
    )
    trainer.add_callback(callback)
    return callback
