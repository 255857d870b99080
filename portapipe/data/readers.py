"""The corpora ``portapipe tokenize`` reads, as a stream of chunks of documents.

Inputs (any mix, each given as a file, a folder or a glob):

- text, plain or compressed (gzip or zstd, told by the file's first bytes): one document per
  file (held whole while it is encoded: a tokenizer's ids for a text cut in two need not be the
  ids of the whole, whatever the cut), or one per line with ``split_lines``;
- jsonl (``.jsonl`` / ``.json``, compressed or not): one JSON object per line, the document the
  string at ``field``;
- parquet (``.parquet``): the string column ``field``, read a row group at a time (pyarrow);
- a Hugging Face dataset saved with ``datasets.save_to_disk`` (a folder with ``state.json``): the
  column ``field``, memory-mapped (``datasets``). A ``DatasetDict`` folder names its splits.

A folder holds inputs: every such file in it and below, in path order (a folder that is itself a
saved dataset is one input). Nothing is read whole but a text file's one document: :func:`chunks`
cuts each input into pieces of about :data:`CHUNK_BYTES` (1 MiB) at line ends (parquet by row group, a
saved dataset by :data:`HF_ROWS` rows), each of which a worker turns into tokens on its own. The
cuts depend only on the inputs, so the output does not depend on how many workers there are.
"""

from __future__ import annotations

import glob
import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .folder import is_dataset

CHUNK_BYTES = 1 << 20  # small enough that a few MB keep several workers busy
HF_ROWS = 4096  # rows of a saved Hugging Face dataset per chunk
_BLOCK = 1 << 20
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
JSON_SUFFIXES = (".jsonl", ".json")
KNOWN = (".txt", ".text", ".md", *JSON_SUFFIXES, ".parquet")


@dataclass(frozen=True)
class Input:
    """One input: a file or a saved dataset, and how it is read (text, jsonl, parquet, hf)."""

    path: Path
    kind: str

    @property
    def size(self) -> int:
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.path.glob("*.arrow"))
        return self.path.stat().st_size


@dataclass
class Chunk:
    """A piece of one input for a worker: raw bytes of whole lines (text pieces, lines, jsonl) or
    rows of a table (parquet row group ``index``, saved-dataset rows ``index .. stop``)."""

    source: int  # the input's place in the list
    kind: str  # text | lines | jsonl | parquet | hf
    path: str
    data: bytes = b""
    first_line: int = 1  # line number of the first line of ``data``
    index: int = 0
    stop: int = 0
    size: int = 0  # bytes of the input file this chunk stands for


def _kind_of(path: Path) -> str:
    name = path.name.lower()
    for ext in (".gz", ".zst", ".zstd"):
        name = name.removesuffix(ext)
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSON_SUFFIXES):
        return "jsonl"
    return "text"


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _readable(path: Path) -> bool:
    name = path.name.lower()
    for ext in (".gz", ".zst", ".zstd"):
        name = name.removesuffix(ext)
    return name.endswith(KNOWN)


def expand(specs: list[str]) -> list[Input]:
    """The inputs named by files, folders and globs, in order; ValueError (one line) for a name
    that gives none."""
    out: list[Input] = []
    for spec in specs:
        if any(c in spec for c in "*?["):
            matched = sorted(Path(p) for p in glob.glob(spec, recursive=True))
            if not matched:
                raise ValueError(f"{spec} matches no file")
            paths = matched
        else:
            paths = [Path(spec)]
        for path in paths:
            if path.is_dir():
                out += _top_folder(path)
            elif path.is_file():
                out.append(Input(path, _kind_of(path)))
            else:
                raise ValueError(f"{path} does not exist")
    return out


def _folder(path: Path) -> list[Input]:
    """The inputs in a folder and below, in path order; a saved dataset is one input, a dataset
    portapipe wrote none; hidden entries are passed over."""
    if _is_saved_dataset(path):
        return [Input(path, "hf")]
    found: list[Input] = []
    for entry in sorted(path.iterdir()):
        if entry.name.startswith("."):  # hidden: e.g. a dataset being written
            continue
        if entry.is_dir() and not is_dataset(entry):
            found += _folder(entry)
        elif entry.is_file() and _readable(entry):
            found.append(Input(entry, _kind_of(entry)))
    return found


def _top_folder(path: Path) -> list[Input]:
    found = _folder(path)
    if not found:
        raise ValueError(f"{path} holds no file portapipe tokenize reads (text, jsonl, parquet, or a saved Hugging Face dataset)")
    return found


# -------------------------------------------------------------------------- raw bytes
def open_raw(path: Path) -> BinaryIO:
    """The file's bytes, decompressed when its first bytes say gzip or zstd."""
    f = open(path, "rb")
    head = f.read(4)
    f.seek(0)
    if head[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=f)  # type: ignore[return-value]
    if head == ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            f.close()
            raise ValueError(f"{path} is zstd-compressed; reading it needs zstandard: pip install 'portapipe[data]'") from None
        return zstandard.ZstdDecompressor().stream_reader(f, closefd=True)  # type: ignore[no-any-return]
    return f


def _blocks(path: Path) -> Iterator[bytes]:
    """The file's decompressed bytes, a block at a time; ValueError (one line) when it cannot be
    read or decompressed."""
    try:
        with open_raw(path) as raw:
            while block := raw.read(_BLOCK):
                yield block
    except ValueError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except Exception as exc:  # zstandard.ZstdError
        if type(exc).__module__.startswith("zstandard"):
            raise ValueError(f"cannot read {path}: {exc}") from None
        raise


def cut_point(buf: bytearray, limit: int) -> int:
    """Where the next piece of ``buf`` ends: after the last line end before ``limit``, else after
    the first one past it (0: ``buf`` holds none yet). Read from the content alone, so the cuts
    never depend on how the file was read."""
    pos = buf.rfind(b"\n", 0, limit)
    if pos < 0:
        pos = buf.find(b"\n", limit)
    return pos + 1 if pos >= 0 else 0


def _byte_chunks(i: int, item: Input, kind: str) -> Iterator[Chunk]:
    """A text file's document whole; lines and jsonl in pieces of about CHUNK_BYTES of whole lines."""
    buf, line = bytearray(), 1
    for block in _blocks(item.path):
        buf += block
        while kind != "text" and len(buf) > CHUNK_BYTES:
            end = cut_point(buf, CHUNK_BYTES)
            if not end:
                break  # no line end yet: read on
            piece = bytes(buf[:end])
            del buf[:end]
            yield Chunk(i, kind, str(item.path), piece, line, size=len(piece))
            line += piece.count(b"\n")
    yield Chunk(i, kind, str(item.path), bytes(buf), line, size=len(buf))


def _parquet_chunks(i: int, item: Input, field: str) -> Iterator[Chunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{item.path} is parquet; reading it needs pyarrow: pip install 'portapipe[data]'") from None
    try:
        meta = pq.ParquetFile(item.path).metadata
    except Exception as exc:  # pyarrow's own error types
        raise ValueError(f"cannot read {item.path}: {exc}") from None
    names = meta.schema.names
    if field not in names:
        raise ValueError(f"{item.path} has no column {field!r} (it has {', '.join(names)}); name the text column with --field")
    size = item.path.stat().st_size
    groups = meta.num_row_groups
    for g in range(groups):
        yield Chunk(i, "parquet", str(item.path), index=g, size=size // groups + (size % groups if g == groups - 1 else 0))


def open_saved(path: Path) -> Any:
    """A dataset saved with ``datasets.save_to_disk`` (memory-mapped); ValueError (one line) otherwise."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} is a saved Hugging Face dataset; reading it needs datasets: pip install 'portapipe[data]'") from None
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(f"{path} is a DatasetDict; name one of its splits: {', '.join(str(path / s) for s in splits)}")
    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets' own error types
        raise ValueError(f"cannot read the saved dataset {path}: {exc}") from None


def _hf_chunks(i: int, item: Input, field: str) -> Iterator[Chunk]:
    ds = open_saved(item.path)
    if field not in ds.column_names:
        raise ValueError(f"{item.path} has no column {field!r} (it has {', '.join(ds.column_names)}); name the text column with --field")
    rows, size = len(ds), item.size
    for start in range(0, rows, HF_ROWS):
        stop = min(rows, start + HF_ROWS)
        yield Chunk(i, "hf", str(item.path), index=start, stop=stop, size=size * stop // rows - size * start // rows)


def table_rows(chunk: Chunk, field: str, saved: dict[str, Any]) -> tuple[list[Any], str]:
    """(the ``field`` values of a parquet or saved-dataset chunk's rows, where they are, in words);
    ``saved``: the saved datasets opened so far in this process, by path."""
    if chunk.kind == "parquet":
        import pyarrow.parquet as pq  # present: the chunk was cut from its metadata (_parquet_chunks)

        try:
            column = pq.ParquetFile(chunk.path).read_row_group(chunk.index, columns=[field]).column(0)
        except Exception as exc:  # pyarrow's own error types
            raise ValueError(f"cannot read {chunk.path}: {exc}") from None
        return column.to_pylist(), f"{chunk.path}, row group {chunk.index}"
    if chunk.path not in saved:
        saved[chunk.path] = open_saved(Path(chunk.path))
    return saved[chunk.path][chunk.index : chunk.stop][field], f"{chunk.path}, rows {chunk.index}..{chunk.stop - 1}"


def chunks(inputs: list[Input], field: str, split_lines: bool) -> Iterator[Chunk]:
    """Every input cut into chunks, in order (see the module docstring)."""
    for i, item in enumerate(inputs):
        if item.kind == "parquet":
            yield from _parquet_chunks(i, item, field)
        elif item.kind == "hf":
            yield from _hf_chunks(i, item, field)
        else:
            yield from _byte_chunks(i, item, "lines" if item.kind == "text" and split_lines else item.kind)
