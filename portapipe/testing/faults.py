"""Faults injected into a training run's ranks at chosen points: the restart suite's and the restart
benchmark's tool. A run never imports this module; it patches the rank it is installed in.

A :class:`Fault` names a rank, a point and a step (numbered as the metrics number steps: step N is
the N-th); the faults of a run fire one after another, each once: fault ``i`` is armed in a
process started after fault ``i - 1`` fired, so each launch of a restarted job meets the next one.
Firing writes ``fault<i>.json`` (the time, rank, point and step) into the marks folder, then acts.

Points:

- ``step``: before step N; ``update``: after step N's update (before its metrics row and checkpoint);
- ``first``: before the first step a process runs (the first step after a restart);
- ``checkpoint``: while checkpoint N is written (DCP's files are written, its manifest not yet);
- ``migration``: inside the EPLB migration after step N (the first layer's exchange done);
- ``write``: checkpoint N's writer fails with ENOSPC at byte ``at_byte`` of the rank's file (the
  action is the error), and the disk shows no free bytes to every rank of that launch.

Actions: ``kill`` (SIGKILL) or ``stop`` (SIGSTOP: a stall only the launcher's watch can see).

Rank 0 also notes in ``launches.jsonl`` when each process started its work, restored its checkpoint
and finished its first step (wall clock), which the restart benchmark reads.

Installed through the rank function, in place of :func:`portapipe.train.train_rank`::

    portapipe.train.train_rank = functools.partial(train_rank_with_faults, faults, marks)  # local launcher

or as the command (under torchrun each worker is one rank; the faults as JSON)::

    python -m portapipe.testing.faults FAULTS_JSON MARKS_DIR train config.yaml ...
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

POINTS = ("step", "update", "first", "checkpoint", "migration", "write")
ACTIONS = ("kill", "stop")


@dataclass(frozen=True)
class Fault:
    rank: int
    point: str
    step: int | None = None  # unused by "first"
    action: str = "kill"
    at_byte: int = 0  # "write": the bytes of the rank's file written before the disk is full

    def __post_init__(self) -> None:
        if self.point not in POINTS or self.action not in ACTIONS:
            raise ValueError(f"a fault's point is one of {POINTS} and its action one of {ACTIONS}; got {self.point!r}, {self.action!r}")
        if (self.step is None) != (self.point == "first"):
            raise ValueError(f"point {self.point!r}: {'no step' if self.point == 'first' else 'a step'} is needed")


class _Armed:
    """This process's faults: which is next, and the firing."""

    def __init__(self, faults: list[Fault], marks: Path, rank: int) -> None:
        self.faults, self.marks, self.rank = faults, marks, rank
        self.started = time.time()
        self.step = 0  # the step running (1-based)
        self.first: int | None = None  # the first step this process ran

    def next(self) -> tuple[int, Fault] | None:
        """The armed fault (its index): the first not fired, if the one before it fired before this process began."""
        for i, fault in enumerate(self.faults):
            if (self.marks / f"fault{i}.json").exists():
                continue
            if i and json.loads((self.marks / f"fault{i - 1}.json").read_text())["time"] >= self.started:
                return None  # the fault before fired during this launch: the next waits for the next launch
            return i, fault
        return None

    def at(self, point: str, step: int | None) -> Fault | None:
        """The armed fault of this rank at ``point`` and ``step``, marked as fired; None elsewhere."""
        found = self.next()
        if found is None:
            return None
        i, fault = found
        if fault.rank != self.rank or fault.point != point or (fault.step is not None and fault.step != step):
            return None
        record = {**asdict(fault), "time": time.time(), "pid": os.getpid(), "step_running": self.step}
        tmp = self.marks / f".fault{i}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.marks / f"fault{i}.json")
        return fault

    def disk_full(self) -> bool:
        """A ``write`` fault fired during this launch: the disk stays full for every rank of it."""
        for i, fault in enumerate(self.faults):
            path = self.marks / f"fault{i}.json"
            if fault.point == "write" and path.exists() and json.loads(path.read_text())["time"] >= self.started:
                return True
        return False

    def act(self, point: str, step: int | None) -> None:
        fault = self.at(point, step)
        if fault is not None:
            os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)


class _FullDisk:
    """A file opened for writing whose disk fills at byte ``at_byte``: the write that crosses it
    writes what fits and raises ENOSPC."""

    def __init__(self, stream: Any, at_byte: int) -> None:
        self._stream, self._left = stream, at_byte

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self._left:
            self._stream.write(memoryview(data).cast("B")[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= size
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def install(faults: list[Fault], marks: Path, rank: int) -> None:
    """Patch this rank's process for ``faults`` (see the module docstring)."""
    import portapipe.balancing.runtime as balancing_runtime
    import portapipe.training.loop as loop
    from torch.distributed.checkpoint.filesystem import FileSystem

    from ..checkpoint.io import Checkpointer
    from ..training.checkpoints import CheckpointPolicy
    from ..training.hooks import StepHook

    armed = _Armed(faults, marks, rank)
    notes: dict[str, Any] = {"pid": os.getpid(), "started": armed.started}

    def note(**kv: Any) -> None:
        notes.update(kv)
        if rank == 0:
            with open(marks / "launches.jsonl", "a") as f:
                f.write(json.dumps(notes) + "\n")

    class FaultHook(StepHook):
        def before_step(self, step: int) -> None:
            armed.step = step + 1
            if armed.first is None:
                armed.first = armed.step
                armed.act("first", None)
            armed.act("step", armed.step)

        def after_update(self, step: int, last: bool) -> None:
            armed.act("update", step + 1)

        def after_record(self, step: int, row: dict[str, Any] | None) -> None:
            if step + 1 == armed.first:
                note(first_step_done=time.time(), first_step=step + 1)

    hooks = loop.step_hooks
    loop.step_hooks = lambda *args, **kwargs: [*hooks(*args, **kwargs), FaultHook()]

    restore = CheckpointPolicy.restore

    def timed_restore(self: Any) -> Any:
        began = time.time()
        out = restore(self)
        note(restore_began=began, restore_done=time.time())
        return out

    CheckpointPolicy.restore = timed_restore  # type: ignore[method-assign]

    finish = Checkpointer._finish

    def finish_with_fault(self: Any, step: int, *args: Any) -> Any:
        armed.act("checkpoint", step)
        return finish(self, step, *args)

    Checkpointer._finish = finish_with_fault  # type: ignore[method-assign]

    migrate = balancing_runtime.migrate_parameters

    def hook(phase: str, _rank: int) -> None:
        if phase == "build":
            armed.act("migration", armed.step)

    def migrate_with_fault(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 8:  # fault, the ninth argument: the balancer passes it along, None outside tests
            args = (*args[:8], hook, *args[9:])
        return migrate(*args, **kwargs)

    balancing_runtime.migrate_parameters = migrate_with_fault

    create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with create_stream(self, path, mode) as stream:
            name = Path(path).parent.name  # the save's temporary folder: .step_NNNNNNNN.<run id>.tmp
            step = int(name[6:14]) if name.startswith(".step_") and name[6:14].isdigit() else None
            fault = armed.at("write", step) if "w" in mode and step is not None else None
            yield stream if fault is None else _FullDisk(stream, fault.at_byte)

    FileSystem.create_stream = full_disk_stream  # type: ignore[method-assign]

    usage = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        real = usage(path)
        return real._replace(free=0) if armed.disk_full() else real

    shutil.disk_usage = disk_usage  # what a rank that reports the failed save looks at (the disk is full for all of them)
    note()


def train_rank_with_faults(faults: list[Fault], marks: str, backend: Any, config_dict: dict[str, Any], plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`portapipe.train.train_rank` with ``faults`` installed first (``marks``: their folder)."""
    from ..train import train_rank

    install(faults, Path(marks), int(os.environ["RANK"]))
    return train_rank(backend, config_dict, plan)


def faulty(faults: list[Fault], marks: Path) -> Any:
    """The rank function to put in place of ``portapipe.train.train_rank`` (picklable)."""
    marks.mkdir(parents=True, exist_ok=True)
    return functools.partial(train_rank_with_faults, faults, str(marks))


def fired(marks: Path) -> list[dict[str, Any]]:
    """The faults that fired, in order."""
    out = []
    i = 0
    while (marks / f"fault{i}.json").exists():
        out.append(json.loads((marks / f"fault{i}.json").read_text()))
        i += 1
    return out


def main(argv: list[str]) -> int:
    """``FAULTS_JSON MARKS_DIR portapipe-arguments...``: ``portapipe`` with the faults in its ranks
    (this process, when torchrun made it one; else the ranks its launcher starts)."""
    import portapipe.train

    from ..cli import main as cli

    faults = [Fault(**f) for f in json.loads(argv[0])]
    marks = Path(argv[1])
    if "RANK" in os.environ:
        marks.mkdir(parents=True, exist_ok=True)
        install(faults, marks, int(os.environ["RANK"]))
    else:
        portapipe.train.train_rank = faulty(faults, marks)
    return cli(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
