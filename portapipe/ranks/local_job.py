"""Start ``world_size`` ranks on this machine and watch them until they return, fail, stall or stop.

Used by :func:`portapipe.ranks.launch.run_ranks` when no outer launcher (torchrun, mpirun) started
the ranks. The launcher process hosts the rendezvous store (its port is bound before any rank
starts, so concurrent jobs cannot race for it) and starts one process per rank, by default from
multiprocessing's fork server with torch preloaded (a rank starts in milliseconds, not seconds).

Each rank runs in its own process group and is linked to the launcher (:mod:`portapipe.ranks.lifeline`):
- a rank that dies (an exception, a signal, a crash) ends the job; the launcher names the first
  cause: a rank's own error before a rank killed by a signal or crashing, both before the
  connection errors its peers see because it is gone;
- a rank whose heartbeat stops for ``stall_timeout_s`` (stopped, frozen) is named and the job ended;
  so is one that beats but whose step takes far longer than the run's median step (and that long);
- SIGINT / SIGTERM to the launcher are forwarded once to every rank that has not received the
  signal itself; the ranks finish their step and return (see :mod:`portapipe.ranks.stop`), and the
  launcher returns their results; ranks still running after ``stop_grace_s`` are killed;
- when the launcher dies, every rank ends itself within a fraction of a second, and so does the
  fork server (:mod:`portapipe.ranks.forkserver_tie`).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from . import cpu_isa, lifeline, stop

#: A rank's first heartbeat may come this late (or launch.stall_timeout_s, if longer): unpickling
#: its function imports torch, which takes seconds on a loaded machine without the fork server.
STARTUP_S = 60.0
#: After the first failure, how long other ranks' failures are collected before choosing the cause.
SETTLE_S = 0.25

#: What the fork server imports once, so that no rank imports it again: torch, the launcher, and
#: what a training rank runs (the model, the schedules, the loop, checkpointing), which would
#: otherwise cost every rank of every launch (a restart's included) seconds of the same imports.
_PRELOAD = ["__main__", "torch", "torch.distributed", "portapipe.ranks.launch", "portapipe.ranks.forkserver_tie",
            "torch.distributed.checkpoint", "portapipe.train", "portapipe.compose", "portapipe.training.loop"]


class LaunchError(RuntimeError):
    """The job failed: ``str()`` is one line naming the rank and the cause; ``traceback`` the details.

    ``stop_signal`` is set when the job was ended by SIGINT / SIGTERM rather than by a fault;
    ``connecting`` when every rank that failed did so while its process groups connected (no
    rank's work had begun), so the job may be started again. ``error_types``: the names of the
    classes of the causing rank's exception, its own first (``("FileNotFoundError", "OSError",
    ...)``); empty where the cause was no Python error (a signal, a stall).
    """

    def __init__(
        self, message: str, rank: int | None = None, traceback: str = "", stop_signal: int | None = None, connecting: bool = False,
        error_types: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.stop_signal = stop_signal
        self.connecting = connecting
        self.error_types = error_types


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ------------------------------------------------------------------------------- rank side
def _rank_entry(
    rank: int,
    world_size: int,
    env: dict[str, str],
    link: Connection,
    launcher: tuple[int, list[int]],
    start_method: str,
    interval: float,
    job_dir: str,
    body: Callable[..., Any],
    body_args: tuple[Any, ...],
) -> None:
    """First code of a local rank: detach from the terminal's signals, tie to the launcher, run."""
    stop.install()  # first: a stop forwarded once this rank beats must find its handlers in place
    launcher_pid, launcher_fds = launcher
    if start_method == "fork":
        for fd in launcher_fds:  # copies of the launcher's ends would hide its death from us
            try:
                os.close(fd)
            except OSError:
                pass
    try:
        os.setpgid(0, 0)  # Ctrl-C reaches the launcher only, which forwards it exactly once
    except OSError:
        pass
    if start_method != "forkserver":  # the launcher is our parent: the kernel can tell us of its death
        lifeline.set_parent_death_signal()
        if os.getppid() != launcher_pid:
            os._exit(lifeline.LAUNCHER_GONE)
    lifeline.start(link, interval)
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    try:
        result = body(*body_args, job_dir=job_dir)
    except BaseException:
        sys.exit(1)  # recorded by the body; exit without multiprocessing printing it again
    tmp = Path(job_dir) / f"rank{rank}.result.tmp"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        write_record(job_dir, rank, f"its result cannot be returned: {error_line(exc)}", "", comm=False)
        sys.exit(1)
    os.replace(tmp, Path(job_dir) / f"rank{rank}.result")


def error_types(exc: BaseException) -> tuple[str, ...]:
    """The names of ``exc``'s class and its bases, its own first: what a launcher may classify a
    failure by without importing the modules that raise it."""
    return tuple(cls.__name__ for cls in type(exc).__mro__)


def error_line(exc: BaseException) -> str:
    """An exception as the user reads it: its own name and message (``CheckpointWriteError: ...``),
    not the module path Python's traceback prints before a name that is not built in."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def write_record(job_dir: str, rank: int, error: str, traceback_text: str, comm: bool, connecting: bool = False,
                 types: tuple[str, ...] = ()) -> None:
    """Record why this rank failed, stamped to the nanosecond before its connections close;
    ``connecting``: it failed while a process group connected its ranks; ``types``: its exception's
    class names (:func:`error_types`)."""
    record = {"rank": rank, "time_ns": time.time_ns(), "error": error, "traceback": traceback_text, "comm": comm, "connecting": connecting,
              "types": list(types)}
    with open(Path(job_dir) / f"rank{rank}.error.json", "w") as f:
        json.dump(record, f)


# --------------------------------------------------------------------------- launcher side
class LocalJob:
    """One launch: start the ranks, watch links, exits, heartbeats and signals; collect results."""

    def __init__(
        self,
        body: Callable[..., Any],
        body_args: tuple[Any, ...],
        world_size: int,
        threads: int,
        stall_timeout_s: float,
        stop_grace_s: float,
        wall_timeout_s: float,
        pg_timeout_s: float,
        start_method: str,
    ) -> None:
        self.body, self.body_args, self.world = body, body_args, world_size
        self.threads, self.stall, self.grace, self.wall = threads, stall_timeout_s, stop_grace_s, wall_timeout_s
        self.pg_timeout_s, self.start_method = pg_timeout_s, start_method
        self.interval = lifeline.beat_interval(stall_timeout_s)
        self.dir = Path(tempfile.mkdtemp(prefix="portapipe-job-"))
        self.procs: list[Any] = []
        self.links: list[Connection] = []
        self.started = 0.0
        self.last_beat: list[float] = []
        self.beaten: list[bool] = []
        self.reported: list[int] = []  # the stop signal each rank says it has received
        self.progress = lifeline.ProgressWatch(world_size)
        self.exited: dict[int, tuple[float, int | None]] = {}  # rank -> (when seen, exit code)
        self.killed_by_us: set[int] = set()
        self.pending: list[int] = []  # signals received by the launcher, not yet acted on
        self.stop_sig: int | None = None
        self.stop_at = 0.0
        self.told: set[int] = set()  # ranks the stop signal was forwarded to
        self._results: list[Any] = []

    # ---------------------------------------------------------------- public
    def run(self) -> list[Any]:
        inherited = stop.installed()  # the caller recorded stop signals until now (portapipe train does)
        saved = self._install_handlers()
        store = None
        try:
            early = stop.received() if inherited else None
            if early is not None:
                raise LaunchError(f"stopped by {signal_name(early)} before the ranks started: nothing was trained", stop_signal=early)
            store = self._start()
            failure = self._watch()
        finally:
            self._end_all()
            for sig, handler in saved.items():
                signal.signal(sig, handler)
            del store
            shutil.rmtree(self.dir, ignore_errors=True)
        if failure is not None:
            raise failure
        return self._results

    # ---------------------------------------------------------------- start
    def _install_handlers(self) -> dict[int, Any]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}
        saved = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            saved[sig] = signal.getsignal(sig)
            signal.signal(sig, lambda signum, frame: self.pending.append(signum))
        return saved

    def _start(self) -> Any:
        from torch.distributed import TCPStore

        store = TCPStore(
            "127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=max(self.pg_timeout_s, 1.0)),
        )
        env = {
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            # Every rank is a client of the launcher's store, as under torchrun's agent.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": str(max(1, self.threads)),
        }
        if cpu_isa.ENV in os.environ:  # a fork server started before the cap was set lacks it
            env[cpu_isa.ENV] = os.environ[cpu_isa.ENV]
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs; then it has them
        self.started = time.monotonic()
        for rank in range(self.world):
            mine, theirs = ctx.Pipe(duplex=True)
            self.links.append(mine)
            launcher = (os.getpid(), [link.fileno() for link in self.links])
            args = (rank, self.world, env, theirs, launcher, self.start_method, self.interval, str(self.dir), self.body, self.body_args)
            proc = ctx.Process(target=_rank_entry, args=args, name=f"portapipe-rank{rank}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.last_beat.append(time.monotonic())
            self.beaten.append(False)
            self.reported.append(0)
        return store

    # ---------------------------------------------------------------- watch
    def _watch(self) -> LaunchError | None:
        tick = self.interval
        while len(self.exited) < self.world:
            live = {self.links[r]: r for r in range(self.world) if r not in self.exited}
            for link in wait(list(live), timeout=tick):
                self._drain(live[link])
            now = time.monotonic()
            if self.pending:
                failure = self._on_signals(now)
                if failure is not None:
                    return failure
            if self.stop_sig is not None and now >= self.stop_at + 2 * self.interval + 0.05:
                self._forward(self.stop_sig, only_unaware=True)
            if self.stop_sig is not None and now > self.stop_at + self.grace:
                return LaunchError(
                    f"stopped by {signal_name(self.stop_sig)}, but the ranks did not finish within "
                    f"launch.stop_grace_s = {self.grace:g} s and were killed",
                    stop_signal=self.stop_sig,
                )
            stalled = self._stalled(now) or self._not_progressing(now)
            if stalled is not None:
                return stalled
            if any(not self._succeeded(r) for r in self.exited):
                return self._failure()
        self._results = [self._load_result(r) for r in range(self.world)]
        return None

    def _drain(self, rank: int) -> None:
        link = self.links[rank]
        try:
            while link.poll():
                beat = lifeline.Beat.decode(link.recv_bytes())
                self.last_beat[rank] = time.monotonic()
                self.beaten[rank] = True
                self.reported[rank] = beat.stop_signal
                self.progress.update(rank, beat)
        except (EOFError, OSError):
            seen = time.monotonic()
            proc = self.procs[rank]
            proc.join(5.0)  # its exit status follows its link's end within moments
            self.exited[rank] = (seen, proc.exitcode)
            link.close()

    def _succeeded(self, rank: int) -> bool:
        # The fork server reports 255 for every child once it is gone itself (e.g. a SIGTERM sent
        # to the launcher's whole process group): a result file is the rank's own word.
        code = self.exited[rank][1]
        return (self.dir / f"rank{rank}.result").is_file() and code in (0, 255, None)

    def _stalled(self, now: float, quick: bool = False, context: str = "while its peers timed out waiting for it") -> LaunchError | None:
        """A live rank silent past its limit (``quick``: past a few beats, used once peers failed
        or waited long for it, which ``context`` says)."""
        if self.stall <= 0:
            return None
        for rank in range(self.world):
            if rank in self.exited or (quick and not self.beaten[rank]):
                continue
            silent = now - self.last_beat[rank]
            if quick:
                limit = max(1.0, 8 * self.interval)
            else:
                limit = self.stall if self.beaten[rank] else max(self.stall, STARTUP_S)
            if silent > limit:
                self._drain(rank)  # a beat may be waiting unread
                if rank in self.exited or time.monotonic() - self.last_beat[rank] <= limit:
                    continue
                state = _process_state(self.procs[rank].pid)
                why = " and its process is stopped (SIGSTOP or a debugger)" if state == "T" else ""
                limit_text = context if quick else f"(launch.stall_timeout_s = {self.stall:g})"
                return LaunchError(f"rank {rank} stalled: no heartbeat for {silent:.1f} s {limit_text}{why}; every rank was ended", rank=rank)
        return None

    def _not_progressing(self, now: float) -> LaunchError | None:
        """A rank that beats but whose step takes far longer than the run's median (not while
        stopping: the stop's checkpoint is timed by launch.stop_grace_s)."""
        if self.stall <= 0 or self.stop_sig is not None or any(self.reported):
            return None
        found = self.progress.stalled(now, [r for r in range(self.world) if r not in self.exited], self.stall)
        if found is None:
            return None
        # A process stopped as a whole (SIGSTOP, a frozen machine) fell silent too: that rank is the cause, and not busy.
        silent = self._stalled(now, quick=True, context=f"while its peers waited {now - self.progress.since[found[0]]:.1f} s for it")
        return silent or LaunchError(f"{found[1]}; every rank was ended", rank=found[0])

    # ---------------------------------------------------------------- signals
    def _on_signals(self, now: float) -> LaunchError | None:
        while self.pending:
            sig = self.pending.pop(0)
            if self.stop_sig is None:
                self.stop_sig, self.stop_at = sig, now
                continue
            # A second signal means now: the ranks get it too (see portapipe.ranks.stop) and end at once.
            self._forward(sig, only_unaware=False)
            return LaunchError(f"stopped by a second {signal_name(sig)}: the ranks were ended at once, without a checkpoint", stop_signal=sig)
        return None

    def _forward(self, sig: int, only_unaware: bool) -> None:
        """Send ``sig`` to the live ranks. With ``only_unaware``, once to each rank that has beaten
        (its handlers are in place only then: a rank still starting would die of it) and has not
        received it itself (a second signal would mean 'now' to it)."""
        for rank, proc in enumerate(self.procs):
            if rank in self.exited or (only_unaware and (self.reported[rank] or not self.beaten[rank] or rank in self.told)):
                continue
            self.told.add(rank)
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, TypeError):
                pass

    # ---------------------------------------------------------------- failures
    def _failure(self) -> LaunchError:
        """Collect the other ranks' failures for a moment, then name the first cause."""
        deadline = time.monotonic() + SETTLE_S
        while len(self.exited) < self.world and time.monotonic() < deadline:
            live = {self.links[r]: r for r in range(self.world) if r not in self.exited}
            for link in wait(list(live), timeout=max(0.0, deadline - time.monotonic())):
                self._drain(live[link])
        if self.stop_sig is not None and self.told:
            died = [r for r, (_, code) in self.exited.items() if code is not None and code < 0]
            if died and all(self.exited[r][1] == -self.stop_sig for r in died):
                return LaunchError(f"stopped by {signal_name(self.stop_sig)} before the ranks could stop gracefully", stop_signal=self.stop_sig)
        # Peers whose collective timed out waiting for a stalled rank fail before its heartbeat
        # limit is reached: the silent rank, not their timeouts, is the cause.
        return choose_cause(self._records(), self._abnormal_exits(), self.wall, stalled=self._stalled(time.monotonic(), quick=True))

    def _records(self) -> dict[int, dict[str, Any]]:
        out = {}
        for path in self.dir.glob("rank*.error.json"):
            with open(path) as f:
                rec = json.load(f)
            out[int(rec["rank"])] = rec
        return out

    def _abnormal_exits(self) -> list[tuple[float, int, int | None, str]]:
        """(seen, rank, exit code, watchdog stacks) of ranks that ended without a Python error."""
        out = []
        for rank, (seen, code) in self.exited.items():
            if self._succeeded(rank) or (self.dir / f"rank{rank}.error.json").is_file() or rank in self.killed_by_us:
                continue
            stacks_path = self.dir / f"rank{rank}.stacks"
            stacks = stacks_path.read_text(errors="replace") if stacks_path.is_file() else ""
            out.append((seen, rank, code, stacks))
        return sorted(out)

    def _load_result(self, rank: int) -> Any:
        with open(self.dir / f"rank{rank}.result", "rb") as f:
            return pickle.load(f)

    def _end_all(self) -> None:
        """Kill whatever still runs (each rank leads its own process group: its children go too)."""
        for rank, proc in enumerate(self.procs):
            # Not proc.is_alive(): once the fork server is gone it reports every child as dead.
            if proc.pid is None or rank in self.exited:
                continue
            self.killed_by_us.add(rank)
            for kill in (os.killpg, os.kill):
                try:
                    kill(proc.pid, signal.SIGKILL)
                    break
                except (ProcessLookupError, PermissionError, OSError):
                    continue
        for proc in self.procs:
            proc.join(10.0)
        for link in self.links:
            link.close()


def choose_cause(
    records: dict[int, dict[str, Any]],
    abnormal: list[tuple[float, int, int | None, str]],
    wall_timeout_s: float,
    stalled: LaunchError | None = None,
) -> LaunchError:
    """The first cause of a failed job.

    A rank's own error (an exception that is not a communication error) comes first, then a rank
    that ended without a Python error (a signal, a crash, its watchdog), then a rank whose
    heartbeat stopped, then the communication errors that peers of a vanished or stalled rank
    see. Within a kind, the earliest. The cause is ``connecting`` when every recorded failure
    happened while a process group connected its ranks (and no rank died or stalled).
    """
    own = sorted((r["time_ns"], rank) for rank, r in records.items() if not r.get("comm"))
    comm = sorted((r["time_ns"], rank) for rank, r in records.items() if r.get("comm"))
    if own:
        rank = own[0][1]
    elif abnormal:
        _, rank, code, stacks = abnormal[0]
        if code is not None and code < 0:
            msg = f"rank {rank} was killed by {signal_name(-code)}"
            if -code == signal.SIGILL:
                msg += f": {cpu_isa.sigill_hint()}"
        elif stacks:
            msg = f"rank {rank} exceeded its wall-clock limit of {wall_timeout_s:g} s (its stacks were dumped)"
        elif code == lifeline.LAUNCHER_GONE:
            msg = f"rank {rank} lost its launcher"
        else:
            msg = f"rank {rank} exited with code {code} without a Python error (a crash or an exit from native code)"
        return LaunchError(msg, rank=rank, traceback=stacks or msg)
    elif stalled is not None:
        return stalled
    elif comm:
        rank = comm[0][1]
    else:
        return LaunchError("the ranks ended without a result or an error")
    rec = records[rank]
    connecting = all(r.get("connecting") for r in records.values())
    return LaunchError(f"rank {rank} failed: {rec['error']}", rank=rank, traceback=rec["traceback"], connecting=connecting,
                       error_types=tuple(rec.get("types", ())))


def _process_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of ``pid`` (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
