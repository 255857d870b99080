"""A run's folders: that they can be written, and the lock that keeps a second run off them.

``log.dir`` (and ``checkpoint.dir`` when set) must be folders this process can write; symbolic
links that loop or lead nowhere are named. Each is locked with ``<folder>/.portapipe.lock``
holding the owner's pid; a lock left by a killed run is taken over with a note.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError
from . import files

LOCK_FILE = ".portapipe.lock"


def checkpoint_root(config: Config) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else Path(config.log.dir) / "checkpoints"


# ------------------------------------------------------------------------------ the lock
_named_dead: set[str] = set()  # pids of dead lock holders already named (a run holds two locks)


class FolderLock:
    """An exclusive ``flock`` on ``<folder>/.portapipe.lock``, which holds the owner's pid.

    The kernel drops the lock when its process dies, so a lock left by a killed run is free; its
    pid is still in the file and taking it over says so.
    """

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key = folder, key
        self.path = folder / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, say: Callable[[str], None]) -> None:
        """Take the lock (ConfigError naming the holder when a live run has it); a lock left by a
        dead process is taken over with one ``say`` line, unless the same pid was named already."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                [f"{self.key}: {self.folder} is in use by another run (pid {holder}); wait for it to end or use another {self.key}"]
            ) from None
        before = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if before and before != str(os.getpid()) and before not in _named_dead:
            _named_dead.add(before)
            say(f"{self.key}: taking over the lock of {self.folder} left by pid {before}, which no longer holds it (a run that was killed)")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None


class Locks:
    """The run's folder locks and the hold on the checkpoint it loads, released together (also
    usable as a context manager)."""

    def __init__(self, locks: list[FolderLock | files.ReadHold]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> Locks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


# ------------------------------------------------------------------------- the folders
def _broken_link(d: Path) -> str | None:
    """Why a symbolic link on the way to ``d`` leads nowhere (a loop, a missing target), or None."""
    for q in [*reversed(d.parents), d]:
        if not q.is_symlink():
            continue
        try:
            os.stat(q)
            continue
        except OSError as exc:
            loop = exc.errno == errno.ELOOP
        chain, at = [q], q
        while at.is_symlink() and len(chain) < 8:  # follow the links up to the first repeat
            at = Path(os.path.normpath(at.parent / os.readlink(at)))
            chain.append(at)
            if at in chain[:-1]:
                break
        where = "is" if q == d else f"lies under {str(q)!r}, which is"
        if loop:
            return f"{where} a loop of symbolic links ({' -> '.join(map(str, chain))}); point it at a folder"
        return f"{where} a symbolic link to {os.readlink(q)!r}, which does not exist; create that folder or point it elsewhere"
    return None


def _unwritable(d: Path) -> str | None:
    """Why folder ``d`` cannot hold a run's files (None when it can); creates it if missing."""
    if (why := _broken_link(d)) is not None:
        return why
    a = d
    while not a.exists() and a != a.parent:
        a = a.parent
    if a.exists() and not a.is_dir():
        return "is a file, not a folder" if a == d else f"lies under {str(a)!r}, which is a file, not a folder"
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".portapipe-write-test-"):
            pass
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    return None


def writable_problems(config: Config) -> list[str]:
    """``log.dir`` and ``checkpoint.dir`` can be written: one line per folder that cannot."""
    out = []
    log_dir = Path(config.log.dir)
    why = _unwritable(log_dir)
    if why:
        out.append(f"log.dir: {str(log_dir)!r} {why}")
    if config.checkpoint.dir:
        root = Path(config.checkpoint.dir)
        why = _unwritable(root)
        if why:
            out.append(f"checkpoint.dir: {str(root)!r} {why}")
    elif not out:
        why = _unwritable(checkpoint_root(config))
        if why:
            out.append(f"log.dir: {str(checkpoint_root(config))!r} (its checkpoints) {why}")
    return out


def lock_folders(config: Config, say: Callable[[str], None]) -> Locks:
    """Check that the run's folders can be written and lock them (ConfigError otherwise, with
    nothing left locked). The checkpoint folder is locked too, always: another run's
    ``checkpoint.dir`` may point into this ``log.dir``."""
    problems = writable_problems(config)
    if problems:
        raise ConfigError(problems)
    log_dir, root = Path(config.log.dir), checkpoint_root(config)
    folders = [(log_dir, "log.dir")]
    if root.resolve() != log_dir.resolve():
        folders.append((root, "checkpoint.dir" if config.checkpoint.dir else "log.dir"))
    _named_dead.clear()
    locks = Locks([])
    try:
        for folder, key in folders:
            lock = FolderLock(folder, key)
            lock.acquire(say)
            locks.locks.append(lock)
    except BaseException:
        locks.release()
        raise
    return locks
