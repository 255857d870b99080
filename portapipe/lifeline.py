"""The link between a local launcher and each of its ranks: heartbeats one way, the launcher's life the other.

Each rank holds one end of a socket pair whose other end only the launcher holds. A daemon
thread in the rank (:func:`start`) sends a beat every ``interval`` seconds carrying the stop
signal the rank has recorded so far (0 for none), and watches its end: end-of-file means the
launcher is gone (killed with SIGKILL, crashed), and the rank ends itself at once, so no rank
keeps training headless or races a new run. Where the launcher is the rank's parent (start
methods spawn and fork) Linux's parent-death signal ends the rank even sooner.

The beat comes from a thread on purpose. A rank blocked in a collective, waiting for a slow or
stopped peer, keeps beating; only a process that is stopped as a whole (SIGSTOP, a frozen
machine, native code holding the GIL for good) falls silent, so the launcher names the stalled
rank, not the peers waiting for it. Progress inside a healthy process is guarded elsewhere
(collective timeouts, the rank's wall-clock watchdog).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

from . import stop

#: Exit status of a rank that ended itself because its launcher is gone (nobody reads it).
LAUNCHER_GONE = 70


def beat_interval(stall_timeout_s: float) -> float:
    """Seconds between beats: often enough that a stall is seen well within its timeout."""
    if stall_timeout_s <= 0:
        return 0.25
    return max(0.02, min(0.25, stall_timeout_s / 10))


def set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        return libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(link: Connection, interval: float) -> None:
    try:
        while True:
            link.send_bytes(bytes([stop.received() or 0]))
            # The launcher never writes: a readable end means end-of-file, i.e. the launcher is gone.
            if link.poll(interval):
                link.recv_bytes()
    except (EOFError, OSError):
        os._exit(LAUNCHER_GONE)


def start(link: Connection, interval: float) -> threading.Thread:
    """Beat on ``link`` and end this process when the launcher's end closes."""
    thread = threading.Thread(target=_watch, args=(link, interval), name="portapipe-lifeline", daemon=True)
    thread.start()
    return thread
