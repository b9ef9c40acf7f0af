"""Where reports go: TensorBoard event files and JSON lines."""

from privmon.sinks.jsonl import JsonlSink
from privmon.sinks.tensorboard import TensorBoardSink

__all__ = ["JsonlSink", "TensorBoardSink"]
