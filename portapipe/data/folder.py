"""The dataset folder ``portapipe tokenize`` writes, and reading it back.

A folder of three files:

- ``tokens.bin``: every document's token ids back to back, the end-of-document id after each,
  uint16 (vocabularies of at most 65,536 ids) or uint32, little-endian;
- ``documents.bin``: the document index, int64 little-endian: the offset (in tokens) where each
  document starts, then the total token count (so document i is ``starts[i] .. starts[i + 1]``);
- ``dataset.json``: the description: ``format`` (``portapipe.dataset``), ``version``, ``dtype``,
  ``vocab_size``, ``eos_id``, ``documents``, ``tokens``, ``max_id`` (the largest id, so nothing
  scans the tokens to check them against a model), ``sources`` (each input file with its
  documents, tokens and what was skipped), ``tokenizer`` (its file and sha256) and
  ``tokens_blake2b`` (a digest of ``tokens.bin``).

The folder is written under a temporary name beside its final one and renamed when complete
(:func:`publish`), so an interrupted write leaves no folder that loads; reading checks the sizes
against the description, so files from different writes are refused too.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .flat import DTYPES, mapped

FORMAT = "portapipe.dataset"
VERSION = 1
DESCRIPTION = "dataset.json"
TOKENS = "tokens.bin"
DOCUMENTS = "documents.bin"
INDEX_DTYPE = np.dtype("<i8")
_CHUNK = 1 << 20  # index entries per step when checking the index (8 MB at a time, whatever the corpus)


def is_dataset(path: Path) -> bool:
    return path.is_dir() and (path / DESCRIPTION).is_file()


def read_description(path: Path) -> dict[str, Any]:
    """The description of dataset folder ``path``; ValueError (one line) when it is not one."""
    file = path / DESCRIPTION
    try:
        meta = json.loads(file.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{file} is not a portapipe dataset description (format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"{file} has version {meta.get('version')!r}; this portapipe reads version {VERSION} (run portapipe tokenize again)")
    for key in ("documents", "tokens", "vocab_size", "max_id"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 0:
            raise ValueError(f"{file}: {key} is {meta.get(key)!r}, not a count")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{file}: dtype {meta.get('dtype')!r} is not uint16 or uint32")
    return meta


def open_dataset(path: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """(description, tokens, document starts with the total appended), both memory-mapped.

    ValueError (one line) when a file is missing or its size disagrees with the description: an
    interrupted or mixed-up folder never reads as data."""
    meta = read_description(path)
    tokens_file, index_file = path / TOKENS, path / DOCUMENTS
    width = DTYPES[meta["dtype"]].itemsize
    for file, want in ((tokens_file, meta["tokens"] * width), (index_file, (meta["documents"] + 1) * INDEX_DTYPE.itemsize)):
        if not file.is_file():
            raise ValueError(f"{path} has no {file.name}; the folder is incomplete (run portapipe tokenize again)")
        size = file.stat().st_size
        if size != want:
            raise ValueError(f"{file} has {size} bytes, but {DESCRIPTION} says {want}; the files are from different writes (run portapipe tokenize again)")
    tokens = mapped(tokens_file, DTYPES[meta["dtype"]])
    starts = mapped(index_file, INDEX_DTYPE)
    st = index_file.stat()
    problem = _checked(str(index_file), st.st_size, st.st_mtime_ns, meta["tokens"])
    if problem:
        raise ValueError(f"{index_file}: {problem}")
    return meta, tokens, starts


@functools.lru_cache(maxsize=16)
def _checked(path: str, size: int, mtime_ns: int, total: int) -> str | None:
    """:func:`index_problem` once per version of an index (the launch checks, then each rank opens)."""
    return index_problem(mapped(Path(path), INDEX_DTYPE), total)


def index_problem(starts: np.ndarray, total: int) -> str | None:
    """What is wrong with a document index (starts then the total), None when it is sound:
    from 0 to ``total``, each document at least one token long. Read a chunk at a time."""
    if len(starts) < 2 or int(starts[0]) != 0 or int(starts[-1]) != total:
        return f"the document index does not run from 0 to the {total} tokens"
    for i in range(0, len(starts) - 1, _CHUNK):
        part = np.asarray(starts[i : i + _CHUNK + 1])
        if not bool((np.diff(part) > 0).all()):
            return "the document starts are not increasing (an empty or reordered document)"
    return None


# ------------------------------------------------------------------------------ writing
def temporary(out: Path) -> Path:
    """A fresh folder beside ``out`` to write into (named so that it never reads as ``out``);
    what earlier writes whose process is gone left there is removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for left in out.parent.glob(f".{out.name}.*.tmp"):
        pid = left.name[len(out.name) + 2 : -len(".tmp")]
        if pid.isdigit() and gone(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie, ended but not yet waited for, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # Linux: the state after the command's name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def write_description(folder: Path, meta: dict[str, Any]) -> None:
    with open(folder / DESCRIPTION, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, out: Path) -> None:
    """Put the complete folder ``tmp`` at ``out``; an earlier dataset there is replaced. A stop
    between the two renames leaves the earlier one aside (``.<name>.old``), never half of either."""
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
