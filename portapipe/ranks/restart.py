"""Starting a local job again after a fault, as torchrun's ``--max-restarts`` does for its workers.

The launcher ends every rank on a fault (:mod:`.local_job`: a rank died, raised or stalled, or a
collective timed out); :class:`Restarts` then starts the job again with the arguments the job's
:meth:`~Restarts.resume` gives (a training run: a resume from its newest complete checkpoint),
saying so in one line on stderr:

    portapipe: restart 1 (2 left): rank 1 was killed by SIGKILL; resuming from step 15 in 1 s

- how often: at most ``max_restarts`` restarts within the last ``window_s`` seconds (0: in the
  whole launch), so a run of weeks that faults now and then goes on while a crash loop stops;
  past that the job ends with the last cause;
- how soon: ``backoff_s`` before a restart, doubled for each restart in a row that resumes from no
  later point than the one before (the job is not getting anywhere), at most :data:`BACKOFF_CAP_S`;
  a stop signal (SIGINT / SIGTERM) while waiting ends the job;
- what is not retried: a stop signal, and what the job's :meth:`~Restarts.unrecoverable` names
  (a training run: a config error, a checkpoint or a data file that cannot be read). A job may also
  end a launch whose ranks returned as a fault (:meth:`~Restarts.fault_in`: a divergence), and
  decide itself when that is not worth another launch.

Under torchrun and mpirun this process is one rank: their own options restart the job there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import stop
from .local_job import LaunchError, signal_name

#: The longest wait before a restart, however many came before it in a row.
BACKOFF_CAP_S = 300.0


@dataclass(frozen=True)
class Fault:
    """Why a launch ended early: ``line`` names the cause; ``error`` the launcher's (None where the
    ranks returned and the job called their results a fault, e.g. a divergence)."""

    line: str
    error: LaunchError | None = None


@dataclass(frozen=True)
class Restart:
    """The restart about to happen: its number in the launch (1 for the first), the restarts left
    after it, and the fault it answers."""

    number: int
    left: int
    fault: Fault


class Restarts:
    """The restarts of one local job (see the module docstring); a job overrides :meth:`resume`,
    and :meth:`unrecoverable` and :meth:`fault_in` where it knows more."""

    def __init__(self, max_restarts: int, window_s: float = 0.0, backoff_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if max_restarts < 0 or window_s < 0 or backoff_s < 0:
            raise ValueError(f"max_restarts, window_s and backoff_s must be >= 0, got {max_restarts}, {window_s}, {backoff_s}")
        self.max, self.window, self.backoff = max_restarts, window_s, backoff_s
        self.clock, self.sleep = clock, sleep
        self.times: list[float] = []  # when each restart of the launch happened (clock)
        self.streak = 0  # restarts in a row that resumed from no later point than the one before
        self.resumed_from: int | None = None

    # ------------------------------------------------------------------ what a job overrides
    def resume(self, restart: Restart) -> tuple[tuple[Any, ...], int]:
        """The next launch's arguments and the step it resumes from (0: from the start)."""
        raise NotImplementedError

    def unrecoverable(self, error: LaunchError) -> str | None:
        """Why a restart cannot fix ``error`` (it would fail the same way), or None."""
        return None

    def fault_in(self, results: list[Any]) -> Fault | None:
        """A fault in the results of ranks that returned (worth a restart), or None: they are final."""
        return None

    # ------------------------------------------------------------------------------- the loop
    def run(self, launch: Callable[[tuple[Any, ...]], list[Any]], args: tuple[Any, ...]) -> list[Any]:
        """``launch(args)`` until it returns results that are final; between launches a restart.

        Raises the launch's LaunchError where it is not restarted: a stop signal; a cause
        :meth:`unrecoverable` names (saying so); no restart left (saying so). Results that hold a
        fault with no restart left are returned as they are.
        """
        while True:
            results: list[Any] | None = None
            try:
                results = launch(args)
            except LaunchError as err:
                if err.stop_signal is not None:
                    raise
                if (why := self.unrecoverable(err)) is not None:
                    raise _amended(err, f"not restarted: {why}") from None
                fault = Fault(" ".join(str(err).split()), err)
            else:
                found = self.fault_in(results)
                if found is None:
                    return results
                fault = found
            left = self.left()
            if left == 0:
                if fault.error is None:
                    return results  # type: ignore[return-value]  (the ranks' own record of the fault)
                raise _amended(fault.error, f"not restarted: {self.spent()}") from None
            restart = Restart(len(self.times) + 1, left - 1, fault)
            args, step = self.resume(restart)
            wait = self._backoff(step)
            when = f" in {wait:g} s" if wait else ""
            print(f"portapipe: restart {restart.number} ({restart.left} left): {fault.line}; resuming from step {step}{when}",
                  file=sys.stderr, flush=True)
            self._wait(wait, fault)
            self.times.append(self.clock())

    def left(self) -> int:
        """Restarts left now: ``max_restarts`` less those within the window."""
        now = self.clock()
        counted = [t for t in self.times if not self.window or now - t < self.window]
        return max(0, self.max - len(counted))

    def spent(self) -> str:
        """Why no restart is left, for the last line."""
        within = f" within launch.restart_window_s {self.window:g} s" if self.window else ""
        return f"the {self.max} restart{'s' * (self.max != 1)} of launch.max_restarts were used{within}"

    def _backoff(self, step: int) -> float:
        """The wait before a restart resuming from ``step``: doubled while the restarts get nowhere."""
        self.streak = self.streak + 1 if self.resumed_from is not None and step <= self.resumed_from else 0
        self.resumed_from = step
        return min(BACKOFF_CAP_S, self.backoff * 2**self.streak) if self.backoff else 0.0

    def _wait(self, seconds: float, fault: Fault) -> None:
        """Sleep ``seconds``; a stop signal recorded meanwhile ends the job (LaunchError)."""
        end = self.clock() + seconds
        while True:
            sig = stop.received() if stop.installed() else None
            if sig is not None:
                raise LaunchError(f"stopped by {signal_name(sig)} while waiting to restart after: {fault.line}", stop_signal=sig)
            remaining = end - self.clock()
            if remaining <= 0:
                return
            self.sleep(min(0.1, remaining))


def _amended(err: LaunchError, note: str) -> LaunchError:
    """``err`` with ``note`` after its line, everything else kept (a traceback that only repeated the line repeats the new one)."""
    line = f"{' '.join(str(err).split())}; {note}"
    details = err.traceback if err.traceback.strip() != str(err).strip() else line
    return LaunchError(line, err.rank, details, err.stop_signal, err.connecting, err.error_types)
