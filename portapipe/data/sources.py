"""A source of training tokens, whatever its format: what the samplers read.

:func:`open_source` tells the formats apart by what is on disk:

- a folder holding ``dataset.json``: a dataset ``portapipe tokenize`` wrote (:mod:`.folder`);
- ``PREFIX`` with ``PREFIX.bin`` and ``PREFIX.idx`` (or either file named): a Megatron-Core
  indexed dataset (:mod:`.megatron`);
- any other file: a flat token file (:mod:`.flat`), one document, its width from its source's
  ``token_dtype`` (``data.sources[i].token_dtype``, else ``data.token_dtype``) or its sidecar.

A dataset folder's ``dataset.json`` and a Megatron index say their own width; a source's own
``token_dtype`` (or ``data.token_dtype`` for ``data.path``) must not contradict it, and the
blend's fallback ``data.token_dtype`` applies to flat files alone.

``data.format: bytes`` reads a text file as one document of byte tokens (:func:`open_bytes`).
Each :class:`Source` holds its tokens memory-mapped (a byte corpus in memory) and answers where
the document holding a token starts, without an array per document.

A mapped file that is cut short under a running job would end the process with SIGBUS at the
next read past its new end, and one rewritten in place would be read as other tokens. So each
source records what its files were when it opened them (device, inode, size, modification
time) and :meth:`Source.check` compares, a few stat calls (microseconds), before and after each
batch is read (:mod:`.batches`): a file deleted, truncated, replaced or rewritten stops the run
with one line naming it. A file cut within the microseconds of a read itself can still raise
SIGBUS.
"""

from __future__ import annotations

import functools
import gzip
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import flat, folder
from .megatron import MegatronDataset, prefix_of

KINDS = ("bytes", "flat", "dataset", "megatron")


@dataclass
class Source:
    """One corpus: its tokens and documents, and what is known of its vocabulary."""

    key: str  #: the config key that names it (``data.path``, ``data.sources[1].path``), for messages
    path: Path
    kind: str  #: one of :data:`KINDS`
    tokens: np.ndarray
    files: tuple[Path, ...]
    vocab_size: int | None = None  #: the tokenizer's vocabulary, when recorded
    max_id: int | None = None  #: the largest id, when known without a scan
    eos_id: int | None = None
    dtype_key: str = "data.token_dtype"  #: the config key that says a flat file's width, for messages
    _starts: np.ndarray | None = field(default=None, repr=False)  # a dataset folder's index
    _megatron: MegatronDataset | None = field(default=None, repr=False)
    _opened: tuple[tuple[int, int, int, int], ...] = field(default=(), repr=False)  # each file as it was opened

    def __post_init__(self) -> None:
        if self.kind != "bytes":  # mapped files; a text read as bytes is in memory
            self._opened = tuple(_identity(os.stat(f)) for f in self.files)

    def check(self) -> None:
        """DataReadError (one line naming the file) when one of the source's mapped files was
        deleted, truncated, replaced or rewritten since it was opened."""
        for file, then in zip(self.files, self._opened):
            try:
                now = _identity(os.stat(file))
            except FileNotFoundError:
                raise DataReadError(f"{self.key}: {file} was deleted after the run opened it; {_STOPS}") from None
            if now == then:
                continue
            if now[:2] != then[:2]:
                what = "replaced (another file has its name now)"
            elif now[2] < then[2]:
                what = f"truncated ({then[2]:,} -> {now[2]:,} bytes)"
            else:
                what = f"rewritten ({then[2]:,} -> {now[2]:,} bytes, modified since)"
            raise DataReadError(f"{self.key}: {file} was {what} after the run opened it; {_STOPS}")

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def has_documents(self) -> bool:
        """Whether the source knows its document boundaries (a flat file or a text is one document)."""
        return self.kind in ("dataset", "megatron")

    @property
    def documents(self) -> int:
        if self._starts is not None:
            return len(self._starts) - 1
        if self._megatron is not None:
            return self._megatron.documents
        return 1

    def document_start(self, token: np.ndarray) -> np.ndarray:
        """The offset where the document holding each of ``token`` (offsets, any shape) starts."""
        token = np.asarray(token, dtype=np.int64)
        if self._starts is not None:
            return np.asarray(self._starts[np.searchsorted(self._starts, token, side="right") - 1], dtype=np.int64)
        if self._megatron is not None:
            return np.asarray(self._megatron.document_start(token.reshape(-1)), dtype=np.int64).reshape(token.shape)
        return np.zeros_like(token)

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens."""
        if self._megatron is not None:
            return self._megatron.document(i)
        if self._starts is not None:
            return self.tokens[int(self._starts[i]) : int(self._starts[i + 1])]
        if i != 0:
            raise IndexError(f"{self.name} is one document")
        return self.tokens


def open_source(
    path: Path, key: str, token_dtype: str = "auto", data_vocab: int | None = None, dtype_key: str = "data.token_dtype", own: bool = True
) -> Source:
    """The source at ``path`` (see the module docstring); ValueError with one line naming ``key``.

    ``token_dtype``: a flat file's width, said by ``dtype_key``; ``own``: whether that key is the
    source's own (then a dataset folder's or a Megatron index's width must agree with it), not
    the blend's fallback for flat files."""
    if folder.is_dataset(path):
        try:
            meta, tokens, starts = folder.open_dataset(path)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
        if own and token_dtype not in ("auto", meta["dtype"]):
            raise ValueError(f"{dtype_key}: {token_dtype}, but {path / folder.DESCRIPTION} says the dataset holds {meta['dtype']} ids")
        if data_vocab is not None and data_vocab != meta["vocab_size"]:
            raise ValueError(f"data.vocab_size: {data_vocab}, but {path / folder.DESCRIPTION} says its tokenizer has {meta['vocab_size']} tokens")
        files = (path / folder.DESCRIPTION, path / folder.TOKENS, path / folder.DOCUMENTS)
        return Source(key, path, "dataset", tokens, files, meta["vocab_size"], meta["max_id"], meta.get("eos_id"), _starts=starts)
    if path.is_dir():
        raise ValueError(f"{key}: {path} is a folder without {folder.DESCRIPTION}: not a dataset portapipe tokenize wrote")
    prefix = prefix_of(path)
    if prefix is not None:
        try:
            mds = MegatronDataset(prefix)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{key}: {exc}") from None
        if own and token_dtype != "auto":
            raise ValueError(f"{dtype_key}: {token_dtype} has no effect on the Megatron dataset {prefix} (its index says {mds.dtype.name}); remove it")
        return Source(key, prefix, "megatron", mds.tokens, (mds.idx_path, mds.bin_path), data_vocab, _megatron=mds)
    if not path.is_file():
        raise ValueError(
            f"{key}: {str(path)!r} does not exist; name a dataset folder (portapipe tokenize), a Megatron prefix "
            "(PREFIX.bin + PREFIX.idx) or a token file"
        )
    dtype, problems = flat.file_problems(path, token_dtype, 1 << 32, check_ids=False, data_vocab=data_vocab, key=key, dtype_key=dtype_key)
    if dtype is None or problems:
        raise ValueError("; ".join(problems))
    meta = flat.read_meta(path) or {}
    vocab = data_vocab if data_vocab is not None else meta.get("vocab_size")
    files = (path,) + ((flat.sidecar(path),) if meta else ())
    return Source(key, path, "flat", flat.open_tokens(path, dtype), files, vocab, dtype_key=dtype_key)


class DataReadError(ValueError):
    """The data file cannot be read; the message is one line naming the file and why."""


_STOPS = "the run stops rather than read other data than it started with (put the file back as it was, or start a new run)"


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file's version apart: the device and inode (the file), its size and modification time (its content)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _read_bytes(path: str, key: str) -> np.ndarray:
    """The file's bytes as a uint8 array; gzip files (by magic number) are decompressed."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DataReadError(f"{key}: cannot read {path!r}: {exc.strerror or exc}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataReadError(f"{key}: {path!r} looks gzipped but cannot be decompressed ({exc})") from None
    out = np.frombuffer(raw, dtype=np.uint8)
    out.flags.writeable = False
    return out


def open_bytes(path: Path, key: str = "data.path") -> Source:
    """A text (plain or gzipped) as one document of byte tokens, in memory (a corpus of a few MB)."""
    if not path.is_file():
        raise DataReadError(f"{key}: {str(path)!r} does not exist or is not a file")
    tokens = _read_bytes(str(path), key)
    if not len(tokens):
        raise DataReadError(f"{key}: {str(path)!r} is empty")
    return Source(key, path, "bytes", tokens, (path,), 256, int(tokens.max()))


def describe(source: Source) -> dict[str, Any]:
    """What a source is, in a few plain numbers (for the metrics' and checkpoints' records)."""
    return {"name": source.name, "path": str(source.path), "kind": source.kind, "tokens": len(source.tokens), "documents": source.documents}
