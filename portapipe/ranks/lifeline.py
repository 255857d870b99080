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
rank, not the peers waiting for it.

A process that keeps beating but stops getting anywhere (a busy loop, a step that never ends)
is seen through progress: the rank's work calls :func:`mark_progress` after each step, each beat
carries the count and the process's CPU time, and the launcher names a rank whose step takes far
longer than the run's median step so far (:class:`ProgressWatch`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import statistics
import struct
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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


#: A beat: the stop signal recorded (0: none), steps done, whether the rank is past its last one
#: (or in untimed work), CPU seconds, when the last step ended (the machine's monotonic clock, the
#: same in every process; moved on by untimed work) and the rank's median step so far (0: not
#: enough steps yet).
BEAT = struct.Struct("<BQ?ddd")
#: A step is far longer than the run's median when it takes this many medians (and the stall timeout).
PROGRESS_FACTOR = 20.0
#: Steps timed before a rank's median is trusted (the first, which includes the start, is not timed).
PROGRESS_MIN_STEPS = 3
_KEPT = 1000  # the median is over this many latest steps

_steps = 0
_done = False
_last = 0.0
_durations: list[float] = []
_paused = False


def mark_progress(last: bool = False) -> None:
    """Say that this rank finished a step (``last``: its final one; what follows is not timed)."""
    global _steps, _done, _last
    now = time.monotonic()
    if _steps:
        _durations.append(now - _last)
        if len(_durations) > _KEPT:
            del _durations[0]
    _steps, _done, _last = _steps + 1, last, now


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Work of a rank that is not timed as part of its step (waiting for a checkpoint being
    written): the step's time leaves it out."""
    global _paused, _last
    _paused, began = True, time.monotonic()
    try:
        yield
    finally:
        _last, _paused = _last + (time.monotonic() - began), False


def _beat() -> bytes:
    median = statistics.median(_durations[-_KEPT:]) if len(_durations) >= PROGRESS_MIN_STEPS else 0.0
    return BEAT.pack(stop.received() or 0, _steps, _done or _paused, time.process_time(), _last, median)


@dataclass
class Beat:
    """What one beat says (see :data:`BEAT`)."""

    stop_signal: int
    steps: int
    done: bool
    cpu_s: float
    last_step_at: float
    median_s: float

    @classmethod
    def decode(cls, msg: bytes) -> Beat:
        return cls(*BEAT.unpack(msg))


@dataclass
class ProgressWatch:
    """The launcher's view of each rank's steps: when each last finished one, its CPU time then,
    its median step."""

    world: int
    steps: list[int] = field(init=False)
    since: list[float] = field(init=False)  # when the rank's last step ended (monotonic)
    cpu_then: list[float] = field(init=False)
    cpu_now: list[float] = field(init=False)
    done: list[bool] = field(init=False)
    medians: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.steps, self.since, self.done = [0] * self.world, [0.0] * self.world, [False] * self.world
        self.cpu_then, self.cpu_now, self.medians = [0.0] * self.world, [0.0] * self.world, [0.0] * self.world

    def update(self, rank: int, beat: Beat) -> None:
        self.cpu_now[rank], self.done[rank], self.medians[rank] = beat.cpu_s, beat.done, beat.median_s
        if (beat.steps, beat.last_step_at) != (self.steps[rank], self.since[rank]):  # a step ended, or untimed work
            self.steps[rank], self.since[rank], self.cpu_then[rank] = beat.steps, beat.last_step_at, beat.cpu_s

    def stalled(self, now: float, live: list[int], floor_s: float) -> tuple[int, str] | None:
        """The rank whose step takes over ``PROGRESS_FACTOR`` medians and ``floor_s``, and one line naming it.

        All ranks wait once one stops getting anywhere; the one that burns CPU meanwhile is the
        cause (its peers sleep in a collective), else the one that finished a step the longest ago.
        """
        watched = [r for r in live if self.steps[r] > 0 and not self.done[r]]
        timed = [m for m in self.medians if m > 0]
        if not timed or not watched:
            return None
        median = statistics.median(timed)  # the run's: the middle of the ranks' medians
        limit = max(floor_s, PROGRESS_FACTOR * median)
        over = [r for r in watched if now - self.since[r] > limit]
        busy = lambda r: (self.cpu_now[r] - self.cpu_then[r], now - self.since[r])  # noqa: E731
        busiest = max(watched, key=busy)
        if busiest not in over and not any(now - self.since[r] > 2 * limit for r in over):
            return None  # the busiest rank finished its last step a moment after its peers: its turn comes
        rank = busiest if busiest in over else max(over, key=busy)
        took, cpu = now - self.since[rank], self.cpu_now[rank] - self.cpu_then[rank]
        return rank, (
            f"rank {rank} stalled: step {self.steps[rank] + 1} has taken {took:.1f} s, {took / median:.0f} times the run's median "
            f"step of {median:.3g} s, and used {cpu:.1f} s of CPU meanwhile (its heartbeat went on: a busy loop or a step that "
            "never ends)"
        )


def _watch(link: Connection, interval: float) -> None:
    try:
        while True:
            link.send_bytes(_beat())
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
