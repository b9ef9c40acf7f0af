"""Hugging Face ``transformers`` adapter: run a :class:`~privmon.PrivacyMonitor` from a ``Trainer``.

```python
from privmon.integrations.transformers import PrivacyMonitorCallback

trainer = transformers.Trainer(..., callbacks=[PrivacyMonitorCallback(monitor)])
trainer.train()
```

The callback is thin: at the end of every optimizer step (``on_step_end``) it calls
``monitor.step(state.global_step)`` — the monitor decides whether a check is due and protects the
model's mode and every RNG — and when the monitor says stop it sets
``control.should_training_stop = True``, the Trainer's own mechanism.

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

import logging
import os
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as err:
    raise ImportError(
        "privmon.integrations.transformers needs Hugging Face transformers: "
        "pip install 'privmon[transformers]'"
    ) from err

from privmon.callbacks.monitor import PrivacyMonitor

__all__ = ["STATE_FILE", "PrivacyMonitorCallback"]

logger = logging.getLogger("privmon")

STATE_FILE = "privmon_monitor.pt"


class PrivacyMonitorCallback(TrainerCallback):
    """``transformers.TrainerCallback`` that steps ``monitor`` after every optimizer step.

    Args:
        monitor: the :class:`~privmon.PrivacyMonitor` to step.
    """

    def __init__(self, monitor: PrivacyMonitor) -> None:
        if not callable(getattr(monitor, "step", None)) or not callable(
            getattr(monitor, "state_dict", None)
        ):
            raise ValueError(
                f"monitor must be a privmon.PrivacyMonitor (with step and state_dict), "
                f"got {monitor!r}"
            )
        self.monitor = monitor

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.monitor.step(int(state.global_step)):
            control.should_training_stop = True
        return control

    # -- checkpoints ------------------------------------------------------------------------------
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
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
        step = int(state.global_step)
        if step == 0:  # a fresh run
            return control
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
            return control
        logger.warning(
            "privmon: training resumed at step %s but no %s was found in %s; the monitor's "
            "history starts afresh",
            step,
            STATE_FILE,
            candidates,
        )
        return control
