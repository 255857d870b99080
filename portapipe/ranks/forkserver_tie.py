"""Imported by multiprocessing's fork server (the local launcher preloads it there): ties the
server's life to the launcher that started it.

When the launcher is killed, the server would notice through its own pipe and exit through the
interpreter's shutdown, which with torch loaded takes seconds on a busy machine; Linux's
parent-death signal ends it at once instead (its ranks end themselves through their lifelines).
Imported anywhere else (a tool importing every module), it does nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .lifeline import set_parent_death_signal


def _preloaded_by_fork_server() -> bool:
    """True when this import runs inside multiprocessing's fork server, preloading modules."""
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and Path(code.co_filename).match("multiprocessing/forkserver.py"):
            return True
        frame = frame.f_back
    return False


if _preloaded_by_fork_server():
    set_parent_death_signal()
