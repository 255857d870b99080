"""Flat token files: uint16 or uint32 token ids back to back, nothing else, memory-mapped.

The layout nanoGPT's ``prepare.py`` writes (a Megatron ``.bin`` without its index): token ids in
the machine's byte order (little-endian on x86 and ARM). Without a document index such a file is
one document. portapipe's earlier ``tokenize`` wrote one with a sidecar ``<file>.json``
(``{"format": "portapipe.tokens", "dtype", "vocab_size", "tokens", ...}``); today's writes a
dataset folder (:mod:`.folder`), and these files stay readable.

The token width: the source's ``token_dtype`` (``data.sources[i].token_dtype``, else
``data.token_dtype``): ``uint16 | uint32`` says it; ``auto`` [default] takes it from the sidecar,
and without one is an error, since a uint32 file read as uint16 (or the reverse)
gives valid-looking ids and silently wrong data. nanoGPT's files are uint16.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
FORMAT = "portapipe.tokens"
_CHUNK = 1 << 24  # tokens per step when scanning for the largest id


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest width holding ids ``0 .. vocab_size - 1``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_meta(path: Path) -> dict[str, Any] | None:
    """The sidecar's contents, None when there is none; ValueError when it is not one of ours."""
    side = sidecar(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{side} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES:
        raise ValueError(f"{side} is not a portapipe token-file description (format {FORMAT!r}, dtype uint16 or uint32)")
    return meta


def resolve_dtype(path: Path, wanted: str, key: str = "data.path", dtype_key: str = "data.token_dtype") -> tuple[str | None, list[str]]:
    """(token width, problems) for ``<dtype_key>: wanted`` and the file's sidecar."""
    try:
        meta = read_meta(path)
    except ValueError as exc:
        return None, [f"{key}: {exc}"]
    if wanted == "auto":
        if meta is None:
            return None, [
                f"{dtype_key}: auto needs {sidecar(path).name} beside the token file (portapipe tokenize writes it) "
                f"to know the token width; set {dtype_key}: uint16 or uint32 (nanoGPT's .bin files are uint16)"
            ]
        return meta["dtype"], []
    if meta is not None and meta["dtype"] != wanted:
        return None, [f"{dtype_key}: {wanted}, but {sidecar(path).name} says the file holds {meta['dtype']} ids"]
    return wanted, []


@functools.lru_cache(maxsize=16)
def _mapped(path: str, dtype: str, size: int, mtime_ns: int, offset: int = 0) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    n = (size - offset) // width
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,))


def mapped(path: Path, dtype: Any, offset: int = 0) -> np.ndarray:
    """``path`` from byte ``offset`` on as a 1-D array of ``dtype``, memory-mapped read-only (pages
    are read when used); one mapping per file version."""
    st = path.stat()
    return _mapped(str(path), np.dtype(dtype).str, st.st_size, st.st_mtime_ns, offset)


def open_tokens(path: Path, dtype: str) -> np.ndarray:
    """A flat token file as a 1-D array of ``dtype`` ids, memory-mapped."""
    return mapped(path, DTYPES[dtype])


def largest(tokens: np.ndarray) -> int:
    """The largest id of ``tokens``, read a chunk at a time (a mapped file is never held whole)."""
    top = 0
    for i in range(0, len(tokens), _CHUNK):
        top = max(top, int(tokens[i : i + _CHUNK].max()))
    return top


@functools.lru_cache(maxsize=8)
def _largest(path: str, dtype: str, size: int, mtime_ns: int) -> int:
    return largest(_mapped(path, DTYPES[dtype].str, size, mtime_ns))


def largest_id(path: Path, dtype: str) -> int:
    st = path.stat()
    return _largest(str(path), dtype, st.st_size, st.st_mtime_ns)


def file_problems(
    path: Path, wanted: str, vocab_size: int, check_ids: bool = True, data_vocab: int | None = None, key: str = "data.path",
    dtype_key: str = "data.token_dtype",
) -> tuple[str | None, list[str]]:
    """(token width, what stops the flat file ``path`` from serving a model of ``vocab_size`` tokens).

    ``data_vocab`` (``data.vocab_size``) is the vocabulary of the tokenizer that wrote the file,
    None for the sidecar's; it must agree with the sidecar, fit the model and hold every id.
    ``key`` names the config key that gave ``path``, ``dtype_key`` the one that gave ``wanted``."""
    if not path.is_file():
        return None, [f"{key}: {str(path)!r} does not exist or is not a file"]
    dtype, out = resolve_dtype(path, wanted, key, dtype_key)
    if dtype is None:
        return None, out
    width = DTYPES[dtype].itemsize
    size = path.stat().st_size
    if size == 0:
        return None, [f"{key}: {str(path)!r} is empty"]
    if size % width:
        return None, [f"{key}: {path.name} has {size} bytes, not a whole number of {dtype} tokens; is {dtype_key} right?"]
    meta = read_meta(path)
    count = None if meta is None else meta.get("tokens")
    if isinstance(count, int) and not isinstance(count, bool) and count * width != size:
        # A file rewritten (another width, another text) under an old sidecar reads as valid-looking ids.
        return None, [
            f"{key}: {path.name} has {size} bytes, but {sidecar(path).name} says it holds {count} {dtype} tokens "
            f"({count * width} bytes); the file and its sidecar are from different tokenizations (run portapipe tokenize again)"
        ]
    said = None if meta is None or "vocab_size" not in meta else int(meta["vocab_size"])
    if data_vocab is not None and said is not None and data_vocab != said:
        return None, [f"data.vocab_size: {data_vocab}, but {sidecar(path).name} says the tokenizer that wrote {path.name} has {said} tokens"]
    vocab, where = (data_vocab, "data.vocab_size") if data_vocab is not None else (said, f"per {sidecar(path).name}")
    if vocab is not None and vocab > vocab_size:
        out.append(f"model.vocab_size: {vocab_size} is smaller than the vocabulary of the tokenizer that wrote {path.name} ({vocab} tokens, {where})")
    if check_ids:
        top = largest_id(path, dtype)
        if top >= vocab_size:
            out.append(f"model.vocab_size: {vocab_size} is too small for {path.name}, which holds token ids up to {top} (use vocab_size >= {top + 1})")
        elif vocab is not None and top >= vocab:
            out.append(f"{key}: {path.name} holds token ids up to {top}, past its vocabulary of {vocab} tokens ({where}); is {dtype_key} right?")
    return dtype, out
