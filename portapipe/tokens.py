"""Token files: a flat binary array of uint16 or uint32 token ids, memory-mapped.

The layout nanoGPT's ``prepare.py`` and Megatron-style pipelines write (the ``.bin`` without an
index): token ids back to back in the machine's byte order (little-endian on x86 and ARM),
nothing else. ``data.format: tokens`` reads one; :func:`tokenize` writes one from a text with a
Hugging Face ``tokenizer.json``.

The token width:

- ``data.token_dtype: uint16 | uint32`` says it;
- ``auto`` [default] takes it from the file's sidecar ``<file>.json``, which
  :func:`tokenize` writes beside it (``{"format": "portapipe.tokens", "dtype", "vocab_size",
  "tokens", ...}``); without a sidecar ``auto`` is an error, since a uint32 file read as uint16
  (or the reverse) gives valid-looking ids and silently wrong data. nanoGPT's files are uint16.

:func:`tokenize` picks uint16 when the tokenizer's vocabulary fits (at most 65,536 ids) and
uint32 otherwise. Before any rank starts, the ids are checked against the model: the largest id
in the file must be below ``model.vocab_size`` and below the tokenizer's vocabulary
(``data.vocab_size``, or the sidecar's), which must not exceed ``model.vocab_size``.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import zlib
from array import array
from pathlib import Path
from typing import Any

import torch

DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
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


def resolve_dtype(path: Path, wanted: str) -> tuple[str | None, list[str]]:
    """(token width, problems) for ``data.token_dtype: wanted`` and the file's sidecar."""
    try:
        meta = read_meta(path)
    except ValueError as exc:
        return None, [f"data.path: {exc}"]
    if wanted == "auto":
        if meta is None:
            return None, [
                f"data.token_dtype: auto needs {sidecar(path).name} beside the token file (portapipe tokenize writes it) "
                "to know the token width; set data.token_dtype: uint16 or uint32 (nanoGPT's .bin files are uint16)"
            ]
        return meta["dtype"], []
    if meta is not None and meta["dtype"] != wanted:
        return None, [f"data.token_dtype: {wanted}, but {sidecar(path).name} says the file holds {meta['dtype']} ids"]
    return wanted, []


@functools.lru_cache(maxsize=8)
def _mapped(path: str, dtype: str, size: int, mtime_ns: int) -> torch.Tensor:
    n = size // torch.tensor([], dtype=DTYPES[dtype]).element_size()
    return torch.from_file(path, shared=False, size=n, dtype=DTYPES[dtype])


def open_tokens(path: Path, dtype: str) -> torch.Tensor:
    """The file as a 1-D tensor of ``dtype`` ids, memory-mapped (pages are read when used)."""
    st = path.stat()
    return _mapped(str(path), dtype, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _largest(path: str, dtype: str, size: int, mtime_ns: int) -> int:
    t = _mapped(path, dtype, size, mtime_ns)
    top = 0
    for i in range(0, t.numel(), _CHUNK):
        top = max(top, int(t[i : i + _CHUNK].to(torch.int64).max()))
    return top


def largest_id(path: Path, dtype: str) -> int:
    st = path.stat()
    return _largest(str(path), dtype, st.st_size, st.st_mtime_ns)


def file_problems(
    path: Path, wanted: str, vocab_size: int, check_ids: bool = True, data_vocab: int | None = None
) -> tuple[str | None, list[str]]:
    """(token width, what stops ``path`` from serving a model of ``vocab_size`` tokens).

    ``data_vocab`` (``data.vocab_size``) is the vocabulary of the tokenizer that wrote the file,
    None for the sidecar's; it must agree with the sidecar, fit the model and hold every id."""
    if not path.is_file():
        return None, [f"data.path: {str(path)!r} does not exist or is not a file"]
    dtype, out = resolve_dtype(path, wanted)
    if dtype is None:
        return None, out
    width = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    size = path.stat().st_size
    if size == 0:
        return None, [f"data.path: {str(path)!r} is empty"]
    if size % width:
        return None, [f"data.path: {path.name} has {size} bytes, not a whole number of {dtype} tokens; is data.token_dtype right?"]
    meta = read_meta(path)
    count = None if meta is None else meta.get("tokens")
    if isinstance(count, int) and not isinstance(count, bool) and count * width != size:
        # A file rewritten (another width, another text) under an old sidecar reads as valid-looking ids.
        return None, [
            f"data.path: {path.name} has {size} bytes, but {sidecar(path).name} says it holds {count} {dtype} tokens "
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
            out.append(f"data.path: {path.name} holds token ids up to {top}, past its vocabulary of {vocab} tokens ({where}); is data.token_dtype right?")
    return dtype, out


# ------------------------------------------------------------------------------ writing
def read_text(path: Path) -> str:
    """A UTF-8 text file, plain or gzipped (by magic number)."""
    try:
        raw = Path(path).read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a gzip cut short / damaged
        raise ValueError(f"cannot read {path}: {exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


#: the 1,024-token byte-level BPE tokenizer trained on the shipped corpus (examples/make_tokenizer.py;
#: in a checkout a link to examples/tokenizer/tokenizer.json, in a wheel the file)
SHIPPED_TOKENIZER = Path(__file__).with_name("data") / "tokenizer-1k.json"


def load_tokenizer(where: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a folder holding one."""
    file = where / "tokenizer.json" if where.is_dir() else where
    if not file.is_file():
        raise ValueError(f"{where} holds no tokenizer.json (a Hugging Face fast tokenizer file)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("portapipe tokenize needs the tokenizers library: pip install 'portapipe[data]'") from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises its own exception type
        raise ValueError(f"{file} is not a tokenizer the tokenizers library reads: {exc}") from None


def _pieces(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, only right after a blank line
    (so no word, and no run of newlines, is cut)."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + size)
        if end < 0:
            out.append(text[start:])
            break
        end += 2
        while end < len(text) and text[end] == "\n":
            end += 1
        out.append(text[start:end])
        start = end
    return out


def tokenize(text_path: Path, out_path: Path, tokenizer: Path, piece_chars: int = 1 << 20) -> dict[str, Any]:
    """Write ``text_path`` tokenized as a token file at ``out_path`` and its sidecar; return the sidecar.

    The text is encoded in pieces cut at blank lines (a batch of pieces at a time, in parallel
    by the tokenizers library), without special tokens, and written as it goes. Both files are
    written under temporary names and renamed, so a failure leaves no partial file.
    """
    tok = load_tokenizer(Path(tokenizer))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = dtype_for_vocab(vocab)
    code = "H" if dtype == "uint16" else "I"  # 2 and 4 bytes on every platform torch runs on
    text = read_text(Path(text_path))
    if not text:
        raise ValueError(f"{text_path} is empty")
    pieces = _pieces(text, piece_chars)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for i in range(0, len(pieces), 64):
                ids = array(code, (t for e in tok.encode_batch(pieces[i : i + 64], add_special_tokens=False) for t in e.ids))
                ids.tofile(f)
                n += len(ids)
        # An old description must not outlive the file it described (a stop between the two
        # renames then leaves no sidecar, which data.token_dtype: auto refuses).
        sidecar(out_path).unlink(missing_ok=True)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"format": FORMAT, "dtype": dtype, "vocab_size": vocab, "tokens": n, "tokenizer": str(tokenizer), "source": str(text_path)}
    side = sidecar(out_path)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, side)
    finally:
        tmp.unlink(missing_ok=True)
    return meta
