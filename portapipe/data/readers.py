"""The corpora ``portapipe tokenize`` reads, as a stream of chunks of documents.

Inputs (any mix, each given as a file, a folder or a glob):

- text, plain or compressed (gzip or zstd, told by the file's first bytes): one document per
  file, or one per line with ``split_lines``;
- jsonl (``.jsonl`` / ``.json``, compressed or not): one JSON object per line, the document the
  string at ``field``;
- parquet (``.parquet``): the string column ``field``, read a row group at a time (pyarrow);
- a Hugging Face dataset saved with ``datasets.save_to_disk`` (a folder with ``state.json``): the
  column ``field``, memory-mapped (``datasets``). A ``DatasetDict`` folder names its splits; a
  split saved without rows is an input without documents.

A folder holds inputs: every such file in it and below, in path order (a folder that is itself a
saved dataset is one input). Links are followed and each real file is read once: a file met again
(through a link, or named twice) and a link back to a folder above (a loop) are passed over, one
line on stderr each; ``**`` in a glob does not descend through links to folders. A compressed file
cut short is refused (gzip's missing end, a zstd frame that runs past the file's end: see
:mod:`.zstd_frames`), never read as the text before the cut.

Nothing is read whole but a text file's one document: :func:`chunks` cuts each input into pieces
of about :data:`CHUNK_BYTES` (1 MiB) at line ends (parquet by row group, a saved dataset by
:data:`HF_ROWS` rows), each of which a worker turns into tokens on its own. The cuts depend only on
the inputs, so the output does not depend on how many workers there are.
"""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .folder import is_dataset
from .zstd_frames import is_zstd, zstd_blocks

CHUNK_BYTES = 1 << 20  # small enough that a few MB keep several workers busy
HF_ROWS = 4096  # rows of a saved Hugging Face dataset per chunk
BLOCK_BYTES = 1 << 20  # decompressed bytes per read
GZIP_MAGIC = b"\x1f\x8b"
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


def _say(line: str) -> None:
    print(f"portapipe: tokenize: {line}", file=sys.stderr)


def expand(specs: list[str], warn: Callable[[str], None] = _say) -> list[Input]:
    """The inputs named by files, folders and globs, in order, each real file once (links
    resolved; a file met again through another name or link is passed over, ``warn`` saying so in
    one line); ValueError (one line) for a name that gives none."""
    out: list[Input] = []
    seen: dict[Path, Path] = {}  # real file -> the name it was first read under
    for spec in specs:
        if any(c in spec for c in "*?["):
            paths = _glob(spec)
            if not paths:
                raise ValueError(f"{spec} matches no file")
        else:
            paths = [Path(spec)]
        for path in paths:
            if path.is_dir():
                found = _top_folder(path, warn)
            elif path.is_file():
                found = [Input(path, _kind_of(path))]
            else:
                raise ValueError(f"{path} does not exist")
            for item in found:
                real = item.path.resolve()
                if real in seen:
                    warn(f"{item.path} is {seen[real]} again ({real}); it is read once")
                    continue
                seen[real] = item.path
                out.append(item)
    return out


def _glob(spec: str) -> list[Path]:
    """The paths a glob matches, in order. ``**`` does not descend through links to folders (a
    link loop would be walked about 40 levels deep; a folder matched is walked as :func:`_folder`
    walks one); hidden names match only a pattern that names them."""
    parts = Path(spec).parts
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    anchor, pattern = Path(*parts[:fixed]) if fixed else Path(), str(Path(*parts[fixed:]))
    hidden_ok = any(part.startswith(".") for part in parts[fixed:])
    return sorted(p for p in anchor.glob(pattern) if hidden_ok or not any(x.startswith(".") for x in p.relative_to(anchor).parts))


def _folder(path: Path, warn: Callable[[str], None], walked: dict[Path, Path], above: tuple[Path, ...] = ()) -> list[Input]:
    """The inputs in a folder and below, in path order; a saved dataset is one input, a dataset
    portapipe wrote none; hidden entries are passed over. Links are followed, each real folder
    walked once: a link back to a folder above (a loop), or to one walked already, is passed
    over with a line said (``walked``: real folder -> the name it was walked under)."""
    real = path.resolve()
    if real in above:
        warn(f"{path} leads back to {walked[real]} (a link loop); not followed")
        return []
    if real in walked:
        warn(f"{path} is {walked[real]} again ({real}); it is read once")
        return []
    walked[real] = path
    if _is_saved_dataset(path):
        return [Input(path, "hf")]
    found: list[Input] = []
    for entry in sorted(path.iterdir()):
        if entry.name.startswith("."):  # hidden: e.g. a dataset being written
            continue
        if entry.is_dir() and not is_dataset(entry):
            found += _folder(entry, warn, walked, (*above, real))
        elif entry.is_file() and _readable(entry):
            found.append(Input(entry, _kind_of(entry)))
        elif entry.is_symlink() and not entry.exists():
            warn(f"{entry} is a link that leads nowhere (or loops on itself); passed over")
    return found


def _top_folder(path: Path, warn: Callable[[str], None]) -> list[Input]:
    found = _folder(path, warn, {})
    if not found:
        raise ValueError(f"{path} holds no file portapipe tokenize reads (text, jsonl, parquet, or a saved Hugging Face dataset)")
    return found


# -------------------------------------------------------------------------- raw bytes
def compressed(path: Path) -> bool:
    """Whether the file is gzip or zstd, by its first bytes."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head[:2] == GZIP_MAGIC or is_zstd(head)


def _blocks(path: Path, block: int | None = None) -> Iterator[bytes]:
    """The file's bytes, decompressed when its first bytes say gzip or zstd, ``block`` bytes (by
    default :data:`BLOCK_BYTES`) at a time; ValueError (one line) when it cannot be read or
    decompressed, or is truncated (a gzip stream without its end, a zstd frame cut short)."""
    size = block or BLOCK_BYTES
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(0)
            if is_zstd(head):
                yield from zstd_blocks(f, size)
                return
            raw: BinaryIO = gzip.GzipFile(fileobj=f) if head[:2] == GZIP_MAGIC else f  # type: ignore[assignment]
            while data := raw.read(size):
                yield data
    except ImportError:  # zstandard, the data extra's
        raise ValueError(f"{path} is zstd-compressed; reading it needs zstandard: pip install 'portapipe[data]'") from None
    except ValueError as exc:  # a zstd file cut short, or not zstd past its first frame
        raise ValueError(f"cannot read {path}: {exc}") from None
    except EOFError:  # gzip's own word for a stream cut before its end-of-stream marker
        raise ValueError(f"cannot read {path}: truncated: the gzip stream ends before its end-of-stream marker") from None
    except (OSError, zlib.error) as exc:
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


def _byte_chunks(i: int, item: Input, kind: str, limit: int, block: int | None) -> Iterator[Chunk]:
    """A text file's document whole; lines and jsonl in pieces of about ``limit`` bytes of whole lines."""
    buf, line = bytearray(), 1
    for data in _blocks(item.path, block):
        buf += data
        while kind != "text" and len(buf) > limit:
            end = cut_point(buf, limit)
            if not end:
                break  # no line end yet: read on
            piece = bytes(memoryview(buf)[:end])  # one copy, not two: a piece may be one long line
            del buf[:end]
            yield Chunk(i, kind, str(item.path), piece, line, size=len(piece))
            line += piece.count(b"\n")
    last = bytes(buf)
    del buf  # not held beside its copy while the piece is encoded
    yield Chunk(i, kind, str(item.path), last, line, size=len(last))


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


def _saved_without_rows(path: Path) -> bool:
    """Whether a saved dataset lists no data file (``save_to_disk`` of no rows writes none, which
    ``datasets.load_from_disk`` cannot load)."""
    try:
        return json.loads((path / "state.json").read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def open_saved(path: Path) -> Any:
    """A dataset saved with ``datasets.save_to_disk`` (memory-mapped), None for one saved without
    rows; ValueError (one line) otherwise."""
    if _saved_without_rows(path):
        return None
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
    if ds is None:  # no rows: an input without documents, as an empty file is
        return
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


def chunks(inputs: list[Input], field: str, split_lines: bool, chunk_bytes: int | None = None, block_bytes: int | None = None) -> Iterator[Chunk]:
    """Every input cut into chunks, in order (see the module docstring): lines and jsonl in pieces
    of about ``chunk_bytes`` [:data:`CHUNK_BYTES`], read ``block_bytes`` [:data:`BLOCK_BYTES`] at a
    time (the pieces depend on neither's value but the first)."""
    limit = chunk_bytes or CHUNK_BYTES
    for i, item in enumerate(inputs):
        if item.kind == "parquet":
            yield from _parquet_chunks(i, item, field)
        elif item.kind == "hf":
            yield from _hf_chunks(i, item, field)
        else:
            yield from _byte_chunks(i, item, "lines" if item.kind == "text" and split_lines else item.kind, limit, block_bytes)
