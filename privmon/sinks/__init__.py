"""Where reports go: the :class:`Sink` protocol, TensorBoard event files, JSON lines, MLflow,
Weights & Biases.

Any object with ``write(report)`` and ``close()`` is a sink (:class:`Sink`); pass it as
``PrivacyMonitor(..., sinks=[...])``. Framework loggers (Lightning's ``trainer.loggers``, Hugging
Face's ``report_to``, Ignite's ``engine.state.metrics``) are fed by :mod:`privmon.integrations`.
"""

from privmon.sinks.base import Sink, finite_scalars
from privmon.sinks.jsonl import JsonlSink
from privmon.sinks.mlflow import MlflowSink
from privmon.sinks.tensorboard import TensorBoardSink
from privmon.sinks.wandb import WandbSink

__all__ = ["JsonlSink", "MlflowSink", "Sink", "TensorBoardSink", "WandbSink", "finite_scalars"]
