"""The on-disk checkpoint: a folder of torch.distributed.checkpoint files plus a manifest.

``<checkpoint.dir>/step_NNNNNNNN/`` holds what DCP writes (``.metadata`` and one
``__R_0.distcp`` per rank) and ``manifest.json``, written last: format, run id, step, the layout
and config the checkpoint was written with, the trainer's progress, and the size and SHA-256 of
every other file. A save goes to ``.step_NNNNNNNN.<run id>.tmp`` and is renamed into place only
once the manifest is in it, so a save that did not finish is never mistaken for a checkpoint.

A checkpoint is *complete* when its manifest reads, every listed file is there with its size
and checksum, no unlisted data file is there, and every rank's part carries the manifest's run
id and step (a small ``stamp.<rank>`` entry each rank writes into its own file). Everything here
runs without a process group: the launcher checks checkpoints before any rank starts.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..metrics.log import strict

FORMAT = "portapipe-dcp/1"
MANIFEST = "manifest.json"
PREFIX = "step_"
DATA_SUFFIX = ".distcp"
METADATA = ".metadata"


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for; the message says where and why."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint of another portapipe version, whose manifest format this one does not read: never
    passed over for an older checkpoint (a resume would then overwrite it), always named."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message is one line: which, where, why, and the
    previous complete checkpoint."""


def os_error_in(exc: BaseException) -> OSError | None:
    """The operating system's error behind ``exc``: in its causes, or in a DCP
    CheckpointException's per-rank failures (``failures``: rank -> (exception, traceback))."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop(0)
        if isinstance(e, tuple):
            todo.extend(e[:1])
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [e.__cause__, e.__context__, *(getattr(e, "failures", None) or {}).values()]
    return None


#: Free bytes below which a failed write is put down to a full file system.
FULL_BELOW = 1 << 20


def write_error(exc: BaseException, final: Path, previous: Path | None) -> CheckpointWriteError:
    """``exc`` (raised while checkpoint ``final`` was written) as one line; DCP's own message
    holds every rank's flattened traceback. Call it before the partial save is removed: torch's
    writer may report a full disk only as a short write ("unexpected pos"), so the free space
    left beside ``final`` is looked at too."""
    cause = os_error_in(exc)
    try:
        free: int | None = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    if cause is not None:
        why = (cause.strerror or os.strerror(cause.errno)).lower()  # "no space left on device"
    elif free is not None and free < FULL_BELOW:
        why = f"{os.strerror(errno.ENOSPC).lower()} ({free} bytes free)"
    else:
        text = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {text[0][:200] if text else ''}"
    before = f"the previous complete checkpoint is {previous}" if previous is not None else "no earlier checkpoint of this run is complete"
    return CheckpointWriteError(f"checkpoint {final} could not be written: {why}; {before}")


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def tmp_dir(root: Path, step: int, run_id: str) -> Path:
    """Where a save of ``step`` by run ``run_id`` is written before it is complete."""
    return root / f".{PREFIX}{step:08d}.{run_id}.tmp"


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, flush it to disk, rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(path: Path, record: dict[str, Any]) -> None:
    """``record`` as strict JSON: a float that is not finite is written as null, never fails the save."""
    atomic_write(path, lambda f: f.write(json.dumps(strict(record), indent=1, allow_nan=False).encode()))


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes", "sha256"}`` of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def stamp_tensor(run_id: str, step: int, rank: int) -> torch.Tensor:
    """What each rank writes into its own part: the run id and step it belongs to."""
    text = json.dumps({"run_id": run_id, "step": step, "rank": rank}).encode()
    return torch.tensor(list(text), dtype=torch.uint8)


def _stamp_of(t: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(t.tolist()).decode())


@dataclass
class Entry:
    """One checkpoint folder as found on disk."""

    path: Path
    step: int | None
    complete: bool
    why: str | None = None  # why it is not complete
    manifest: dict[str, Any] | None = None
    other_version: bool = False  # written by a portapipe whose manifest format this one does not read

    @property
    def run_id(self) -> str | None:
        return None if self.manifest is None else self.manifest.get("run_id")

    def as_json(self) -> dict[str, Any]:
        m = self.manifest or {}
        return {
            "path": str(self.path),
            "step": self.step,
            "run_id": m.get("run_id"),
            "layout": m.get("layout"),
            "complete": self.complete,
            "why_not": self.why,
        }


def _dir_step(d: Path) -> int | None:
    name = d.name
    if name.startswith(PREFIX):
        digits = name[len(PREFIX) :]
    elif name.startswith("." + PREFIX) and name.endswith(".tmp"):
        digits = name[len(PREFIX) + 1 :].split(".", 1)[0]
    else:
        return None
    return int(digits) if digits.isdigit() else None


def read_manifest(d: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder ``d``; CheckpointError saying what is wrong with it."""
    path = d / MANIFEST
    if not path.is_file():
        raise CheckpointError("no manifest.json (a save that did not finish)")
    try:
        manifest = json.loads(path.read_bytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"manifest.json is not valid JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"manifest.json is not a {FORMAT} manifest (a JSON {type(manifest).__name__})")
    if manifest.get("format") != FORMAT:
        raise CheckpointFormatError(format_line(manifest.get("format")))
    for key, kind in (("run_id", str), ("step", int), ("files", dict), ("layout", dict), ("config", dict), ("trainer", dict)):
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"manifest.json lacks {key!r}")
    return manifest


def format_line(found: Any) -> str:
    """Why a manifest of format ``found`` is not read here: a newer or an older portapipe wrote it."""
    prefix, _, version = FORMAT.rpartition("/")
    number = found[len(prefix) + 1:] if isinstance(found, str) and found.startswith(prefix + "/") else ""
    if number.isdigit():
        which = "a newer" if int(number) > int(version) else "an older"
        return f"written by {which} portapipe (manifest format {found!r}; this version reads {FORMAT!r}): read it with that version"
    if found is None:
        return (f"written by an older portapipe (a manifest without a format: one pickle per rank, bound to its layout; this "
                f"version reads {FORMAT!r}): read it with that version")
    return f"manifest.json is not a {FORMAT} manifest (format {found!r})"


def verify(d: Path, run_id: str | None = None) -> Entry:
    """Check checkpoint folder ``d`` completely (see the module docstring); never raises for damage."""
    step = _dir_step(d)
    try:
        if d.name.startswith("."):
            raise CheckpointError("a save that did not finish (temporary folder)")
        manifest = read_manifest(d)
        if manifest["step"] != step:
            raise CheckpointError(f"manifest.json says step {manifest['step']} but the folder is step {step}")
        if run_id is not None and manifest["run_id"] != run_id:
            raise CheckpointError(f"belongs to run {manifest['run_id']}, not to this folder's run {run_id}")
        _check_files(d, manifest)
        _check_stamps(d, manifest)
    except CheckpointError as exc:
        return Entry(d, step, False, str(exc), _manifest_or_none(d), isinstance(exc, CheckpointFormatError))
    return Entry(d, step, True, None, manifest)


def _manifest_or_none(d: Path) -> dict[str, Any] | None:
    try:
        return read_manifest(d)
    except CheckpointError:
        return None


def _check_files(d: Path, manifest: dict[str, Any]) -> None:
    files: dict[str, Any] = manifest["files"]
    if METADATA not in files:
        raise CheckpointError("manifest.json lists no .metadata")
    for name, want in sorted(files.items()):
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"part {name} is missing")
        size = path.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(f"part {name} has {size} bytes, the manifest says {want.get('bytes')} (truncated or replaced)")
        if file_digest(path)["sha256"] != want.get("sha256"):
            raise CheckpointError(f"part {name} does not match its checksum (damaged or from another save)")
    extra = sorted(p.name for p in d.iterdir() if p.name.endswith(DATA_SUFFIX) and p.name not in files)
    if extra:
        raise CheckpointError(f"unlisted part(s) {', '.join(extra)} (left by another save)")


def _check_stamps(d: Path, manifest: dict[str, Any]) -> None:
    """Every rank's part carries the manifest's run id and step."""
    world = int(manifest["layout"].get("world_size", 0))
    try:
        meta = read_dcp_metadata(d)
        wanted = {r: f"stamp.{r}" for r in range(world)}
        missing = [k for k in wanted.values() if k not in meta]
        if missing:
            raise CheckpointError(f"part(s) of rank(s) {', '.join(k.split('.')[1] for k in missing)} missing")
        stamps = {"stamp": {str(r): torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for r, k in wanted.items()}}
        load_no_dist(d, stamps)
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged file DCP cannot read, whatever the exception
        raise CheckpointError(f"DCP cannot read it ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    for r, t in stamps["stamp"].items():
        s = _stamp_of(t)
        if s.get("run_id") != manifest["run_id"] or s.get("step") != manifest["step"]:
            raise CheckpointError(f"the part of rank {r} belongs to run {s.get('run_id')} step {s.get('step')}, not to this manifest's")


def read_dcp_metadata(d: Path) -> dict[str, Any]:
    """DCP's index of a checkpoint: flattened key -> storage metadata (size, dtype)."""
    from torch.distributed.checkpoint import FileSystemReader

    return dict(FileSystemReader(str(d)).read_metadata().state_dict_metadata)


def load_no_dist(d: Path, state: dict[str, Any]) -> None:
    """Fill ``state``'s tensors (nested dicts, DCP keys) from checkpoint ``d`` in this process alone."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is what we ask for
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(d)), no_dist=True)


def scan(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` (complete or not, temporary ones too), oldest step first."""
    if not root.is_dir():
        return []
    found = [(s, d.name, d) for d in root.iterdir() if d.is_dir() and (s := _dir_step(d)) is not None]
    return [d for _, _, d in sorted(found)]


def newest_complete(root: Path, run_id: str | None = None, warn: Callable[[str], None] | None = None) -> Entry | None:
    """The newest complete checkpoint under ``root`` (of run ``run_id`` when given).

    Each damaged or foreign checkpoint newer than it is named in one ``warn`` line; temporary
    folders of unfinished saves are passed over silently (they never were checkpoints). One that
    another portapipe version wrote is not passed over: CheckpointFormatError names it.
    """
    for d in reversed(scan(root)):
        if d.name.startswith("."):
            continue
        entry = verify(d, run_id)
        if entry.complete:
            return entry
        if entry.other_version:
            raise CheckpointFormatError(f"checkpoint {d} was {entry.why}")
        if warn is not None:
            warn(f"checkpoint {d} is not usable: {entry.why}; trying the previous one")
    return None


def resolve(path: Path, warn: Callable[[str], None] | None = None) -> Entry:
    """``path`` as a checkpoint: the folder itself, or the newest complete one in it (or in its
    ``checkpoints/``). CheckpointError when there is none."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; give a checkpoint folder ({PREFIX}NNNNNNNN) or a folder of checkpoints")
    if (path / MANIFEST).exists() or _dir_step(path) is not None:
        entry = verify(path)
        if entry.other_version:
            raise CheckpointFormatError(f"{path} was {entry.why}")
        if not entry.complete:
            raise CheckpointError(f"{path} is not a complete checkpoint: {entry.why}")
        return entry
    for root in (path, path / "checkpoints"):
        if scan(root):
            entry = newest_complete(root, warn=warn)
            if entry is None:
                raise CheckpointError(f"{root} holds no complete checkpoint (`portapipe checkpoints {root}` says why)")
            return entry
    raise CheckpointError(f"{path} holds no checkpoints (no {PREFIX}NNNNNNNN folders in it or in its checkpoints/)")


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished save into place; a folder already there (an unusable checkpoint of the
    same step) is moved out of the way first and then removed. Named like an unfinished save, so
    that a kill between the renames leaves nothing the next run does not clear."""
    trash = None
    if final.exists():
        trash = final.with_name(f".{final.name}.replaced-{os.getpid()}-{time.time_ns()}.tmp")
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ReadHold:
    """A shared lock on a checkpoint folder while a run reads it (``checkpoint.load``):
    :func:`remove` passes over a folder held so, so a run pruning it cannot delete it mid-read."""

    def __init__(self, d: Path, fd: int) -> None:
        self.path, self.fd = d, fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None


def hold_for_reading(d: Path) -> ReadHold | None:
    """Hold checkpoint folder ``d`` for reading; None when it was removed (or is being removed)."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits for a removal under way to finish
    try:
        same = os.fstat(fd).st_ino == os.stat(d).st_ino and (d / MANIFEST).is_file()
    except OSError:
        same = False
    if not same:
        os.close(fd)
        return None
    return ReadHold(d, fd)


def remove(d: Path) -> bool:
    """Remove a checkpoint folder, manifest first: a half-removed checkpoint is incomplete.
    A folder another run holds for reading (:func:`hold_for_reading`) is left; False then."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        (d / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def prune(root: Path, run_id: str, keep: int, newest: int) -> None:
    """Keep run ``run_id``'s newest ``keep`` checkpoints up to step ``newest`` (the one just
    written); drop its older ones and its unfinished saves.

    Checkpoints of other runs are never touched (a folder holds one run; see :mod:`.run`), nor
    one that another run is loading from (a later prune removes it), nor are this run's past
    ``newest``: a resumed run passed over them as damaged, so counting them among the kept would
    prune the checkpoints it can resume from; it replaces them as it goes.
    """
    mine = []
    for d in scan(root):
        step = _dir_step(d)
        if step is None or step > newest:
            continue
        if d.name.startswith("."):
            if d.name.endswith(f".{run_id}.tmp"):
                shutil.rmtree(d, ignore_errors=True)
            continue
        m = _manifest_or_none(d)
        if m is not None and m.get("run_id") == run_id:
            mine.append(d)
    for d in mine[:-keep]:
        remove(d)
