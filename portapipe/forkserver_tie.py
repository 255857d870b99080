"""Imported only by multiprocessing's fork server (the local launcher preloads it there): ties
the server's life to the launcher that started it.

When the launcher is killed, the server would notice through its own pipe and exit through the
interpreter's shutdown, which with torch loaded takes seconds on a busy machine; Linux's
parent-death signal ends it at once instead (its ranks end themselves through their lifelines).
"""

from __future__ import annotations

from .lifeline import set_parent_death_signal

set_parent_death_signal()
