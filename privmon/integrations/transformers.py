"""Hugging Face ``transformers`` adapter: run a :class:`~privmon.PrivacyMonitor` from a ``Trainer``.

:func:`attach` adds a thin :class:`PrivacyMonitorCallback`: at the end of every optimizer step it
steps the monitor at ``state.global_step``, sets ``control.should_training_stop`` when the
monitor says stop, and passes each report's finite scalars to ``trainer.log``, so they land in
``trainer.state.log_history`` and every ``report_to`` integration, while the console shows a
short line per check (``console``). The Trainer's own entries (loss, learning rate, grad norm)
are kept at every ``logging_steps``: privmon's entry is added beside them. It plans the checks
from ``state.max_steps`` and saves the monitor's state in each checkpoint folder
(:data:`STATE_FILE`), loaded back on resume.
User guide: *Hugging Face transformers*. ``import privmon`` never imports ``transformers``: only
importing this module does.
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
    from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback
except ImportError as err:
    raise ImportError(
        "privmon.integrations.transformers needs Hugging Face transformers: "
        "pip install 'privmon[transformers]'"
    ) from err

from privmon._shown import shown
from privmon._validation import check_flag, check_has_methods
from privmon.callbacks.monitor import PrivacyMonitor
from privmon.integrations._common import new_report, plan_checks, publish, publish_outcome
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
                f"got {shown(console)}"
            )
        return console
    patterns = tuple(console) if isinstance(console, Sequence) else ()
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(
            f"console must be one of {CONSOLE_MODES} or a non-empty sequence of tag patterns "
            f"(e.g. [{tags.auc('*')!r}]), got {shown(console)}"
        )
    return patterns


def console_scalars(report: Report, console: Console = "headline") -> dict[str, float]:
    """The figures of ``report`` the Trainer's console shows for ``console``: finite values
    only, in the report's order.

    Args:
        report: a check's report.
        console: ``"headline"`` (default): per query its AUC, and the value and certified lower
            bound of its method with the highest lower bound (``privacy/<query>/adv``,
            ``privacy/<query>/lower``), plus ``privacy/epsilon`` and ``privacy/dp_violation``
            when an accountant is given, each DP mechanism check that fired
            (``privacy/dp_checks/<check>/fired``) and, with early stopping, its threshold and
            decision (``privacy/stopping/threshold``, ``…/stop``); ``"all"``: every scalar;
            ``"none"``: nothing;
            or a sequence of ``fnmatch`` patterns over the tags.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import privmon
        >>> from privmon.integrations.transformers import console_scalars
        >>> from privmon.queries import LossQuery
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
        >>> monitor = privmon.PrivacyMonitor(
        ...     LossQuery(nn.Linear(4, 3)), [(x[:20], y[:20])], [(x[20:], y[20:])]
        ... )
        >>> report = monitor.check(100)
        >>> list(console_scalars(report))
        ['privacy/loss/auc', 'privacy/loss/adv', 'privacy/loss/lower']
        >>> list(console_scalars(report, ["privacy/*/tpr@*"]))
        ['privacy/loss/tpr@fpr=0.1', 'privacy/loss/tpr@fpr=0.01', 'privacy/loss/tpr@fpr=0.001']
    """
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
    for tag in (tags.EPSILON, tags.DP_VIOLATION, tags.STOPPING_THRESHOLD, tags.STOPPING_STOP):
        if tag in scalars:
            out[tag] = scalars[tag]
    for check in tags.fired_checks(scalars):  # a DP mechanism check that fired names itself
        out[tags.dp_check_fired(check)] = scalars[tags.dp_check_fired(check)]
    return out


class PrivacyMonitorCallback(TrainerCallback):
    """``transformers.TrainerCallback`` that steps ``monitor`` after every optimizer step.

    A ``TrainerCallback`` is not given the Trainer, so this one must be told it to log through
    ``trainer.log``: :func:`attach` does that. A callback built without a trainer (e.g. in
    ``Trainer(callbacks=[...])``) still steps the monitor, and warns once that the figures reach
    neither ``log_history`` nor ``report_to`` (``log_to_trainer=False`` silences it).

    Args:
        monitor: the :class:`~privmon.PrivacyMonitor` to step.
        trainer: the ``transformers.Trainer`` whose ``log`` receives each report's finite
            scalars (set by :func:`attach`).
        log_to_trainer: log the figures through ``trainer.log`` (default True).
        console: what the Trainer's console printers show of each check (:func:`console_scalars`):
            "headline" (default), "all", "none" or a sequence of ``fnmatch`` tag patterns;
            ``log_history`` and ``report_to`` get every figure whatever it says.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import privmon
        >>> from privmon.integrations.transformers import PrivacyMonitorCallback
        >>> from privmon.queries import LossQuery
        >>> x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
        >>> monitor = privmon.PrivacyMonitor(
        ...     LossQuery(nn.Linear(4, 3)), [(x[:20], y[:20])], [(x[20:], y[20:])]
        ... )
        >>> callback = PrivacyMonitorCallback(monitor, log_to_trainer=False)
        >>> callback.console  # pass it as Trainer(..., callbacks=[callback])
        'headline'
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
                f"got {shown(monitor)}"
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
            # CallbackHandler.on_log also sets control.should_log = False, which would drop
            # the Trainer's own entry (loss, grad_norm, learning_rate) due at this step, so
            # the flag the Trainer's flow callback set is put back.
            should_log = control.should_log
            printers = [] if self.console == "all" else self._console_printers()
            with self._without(printers):
                publish(self.monitor, report, self.trainer.log, what="the Trainer's log")
            control.should_log = should_log  # the Trainer takes the control we return
            figures = console_scalars(report, self.console) if printers else {}
            if figures:
                logs = {**figures, "epoch": state.epoch} if state.epoch is not None else figures
                for printer in printers:
                    printer.on_log(args, state, control, logs=dict(logs))
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """With early stopping, log its outcome's numbers through ``trainer.log`` (stopped or
        not, the stop's step, the highest figure and its step): ``log_history``, every
        ``report_to`` integration and the console."""
        if self.log_to_trainer and self.trainer is not None:
            publish_outcome(self.monitor, self.trainer.log, what="the Trainer's log")
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
        :data:`STATE_FILE` (a warning when none is found); then plan the checks of a monitor
        given no ``planned_checks`` from ``state.max_steps`` (:meth:`~privmon.PrivacyMonitor.plan`);
        a resumed run keeps the plan it was saved under."""
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
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # a damaged file fails anywhere in the unpickler
                raise ValueError(
                    f"privmon: the monitor's state file {path} cannot be read "
                    f"({type(err).__name__}); remove it and the monitor's history starts afresh"
                ) from err
            if not isinstance(payload, dict) or int(payload.get("global_step", -1)) != step:
                continue
            try:
                self.monitor.load_state_dict(payload.get("monitor", {}))
            except ValueError as err:
                raise ValueError(f"privmon: the monitor's state file {path}: {err}") from err
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
    ``report_to`` integration), while the console shows what ``console`` selects
    (:func:`console_scalars`). The callback does not close the monitor's sinks.

    Args:
        trainer: the ``transformers.Trainer``.
        monitor: the :class:`~privmon.PrivacyMonitor` to step.
        log_to_trainer, console: as for :class:`PrivacyMonitorCallback`.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        >>> import privmon
        >>> from privmon.integrations.transformers import attach
        >>> from privmon.queries import LanguageModelQuery
        >>> _ = torch.manual_seed(0)
        >>> config = GPT2Config(
        ...     n_layer=1, n_embd=8, n_head=2, vocab_size=20, bos_token_id=0, eos_token_id=0
        ... )
        >>> model = GPT2LMHeadModel(config)
        >>> ids = torch.randint(1, 20, (8, 6))
        >>> monitor = privmon.PrivacyMonitor(
        ...     LanguageModelQuery(model, "loss"),
        ...     [{"input_ids": ids[:4]}],
        ...     [{"input_ids": ids[4:]}],
        ...     every_n_steps=2,
        ... )
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     args = TrainingArguments(
        ...         output_dir=tmp,
        ...         max_steps=4,
        ...         per_device_train_batch_size=2,
        ...         report_to=[],
        ...         save_strategy="no",
        ...         disable_tqdm=True,
        ...         use_cpu=True,
        ...     )
        ...     train = [{"input_ids": i, "labels": i} for i in ids[:4]]
        ...     trainer = Trainer(model=model, args=args, train_dataset=train)
        ...     callback = attach(trainer, monitor)
        ...     _ = trainer.train()  # the console shows one short line per check
        {'privacy/loss/auc': ..., 'privacy/loss/adv': ..., 'privacy/loss/lower': ..., 'epoch': ...}
        {'privacy/loss/auc': ..., 'privacy/loss/adv': ..., 'privacy/loss/lower': ..., 'epoch': ...}
        {'train_runtime': ...}
        >>> [log["step"] for log in trainer.state.log_history if "privacy/loss/auc" in log]
        [2, 4]
        >>> monitor.close()
    """
    check_has_methods(
        trainer, "log", "add_callback", name="trainer", expected="a transformers.Trainer"
    )
    callback = PrivacyMonitorCallback(
        monitor, trainer=trainer, log_to_trainer=log_to_trainer, console=console
    )
    trainer.add_callback(callback)
    return callback
