"""Where a warning points: the user's line, however deep inside privmon it is raised."""

from __future__ import annotations

import inspect
import os

__all__ = ["stacklevel_to_user"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def stacklevel_to_user() -> int:
    """The ``stacklevel`` of the first frame outside privmon, counted from this function's
    caller (1): the user's call, whether it came through ``step()`` or ``check()``."""
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
