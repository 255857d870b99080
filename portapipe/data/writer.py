"""``portapipe tokenize``'s engine: corpora in, one dataset folder out, with worker processes.

The main process reads the inputs and cuts them into chunks (:mod:`.readers`); ``workers``
processes each turn a chunk into token ids (a Hugging Face tokenizer's ``encode_batch``, without
special tokens) and the document lengths; the main process writes the results *in input order*
into the folder (:mod:`.folder`) as they come. At most ``2 x workers + 2`` chunks are in flight,
so memory stays bounded whatever the corpus, and the output is the same bytes for any number of
workers (a chunk's tokens depend on the chunk alone). With one worker the chunks are encoded in
the main process. Every worker runs the tokenizer on one thread (the tokenizers library's own
thread pool is switched off), so ``workers`` is the number of cores busy encoding, and ends with
the process it works for, however that ends (:func:`_tie`). A jsonl chunk is parsed by pyarrow's
JSON reader; a chunk it does not read as objects with text at the field is read again line by
line, which names the bad line (see :func:`_jsonl`). The tokenizer is given about
:data:`BATCH_CHARS` characters a call, a longer document in slices (:func:`cuts`), so a long
document costs a few times its size, not the tokenizer's whole encoding of it.

Every document ends with the EOS id. Empty documents (an empty text, a blank jsonl string) are
left out and counted. A jsonl line that is not JSON, lacks the field or holds no text (a lone
surrogate escape), stops the write with its file and line, unless ``skip_bad`` (then counted).
Any problem raises ValueError (one line) and leaves nothing at ``out`` (the folder is written
under a temporary name and renamed at the end); so does a stop, whose workers are not waited for.
"""

from __future__ import annotations

import collections
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..ranks.lifeline import set_parent_death_signal
from . import folder
from .flat import DTYPES, dtype_for_vocab
from .readers import Chunk, Input, chunks, compressed, table_rows
from .tokenizer import find_eos, load_tokenizer, sha256, tokenizer_file, vocab_size


@dataclass
class Encoded:
    """A chunk's tokens and what it held."""

    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint16))  # in the output's dtype
    lengths: list[int] = field(default_factory=list)  # each finished document's tokens, EOS included
    bad: int = 0
    empty: int = 0
    size: int = 0
    max_id: int = 0
    error: str | None = None


# ---------------------------------------------------------------------------- the workers
_STATE: dict[str, Any] = {}
_PARALLELISM = "TOKENIZERS_PARALLELISM"  # the tokenizers library's switch for its thread pool


#: seconds between a worker's looks at whether the process it works for is still there
WATCH_S = 0.5


def _init(tokenizer: str, eos: int, dtype: str, text_field: str, skip_bad: bool, main_pid: int | None = None) -> None:
    """Set up a worker (``main_pid``: the process it works for) or this process (None) to encode."""
    if main_pid is not None:
        _tie(main_pid)
    # one thread per worker: the tokenizers library's own pool would make N workers N x cores threads
    os.environ[_PARALLELISM] = "false"
    _STATE.update(tokenizer=load_tokenizer(Path(tokenizer)), eos=eos, dtype=DTYPES[dtype], field=text_field, skip_bad=skip_bad,
                  saved={})


def _tie(main_pid: int) -> None:
    """End this worker when ``main_pid`` ends, however it ends (kill -9 too), never left blocked on
    a pipe: Linux's parent-death signal (the worker's parent, the fork server, has its own tied to
    ``main_pid``; spawned workers are its children), and a thread that looks every :data:`WATCH_S`
    seconds (a parent that died before the signal was set, other systems)."""
    set_parent_death_signal()

    def watch() -> None:
        while not folder.gone(main_pid):
            time.sleep(WATCH_S)
        os._exit(1)

    if folder.gone(main_pid):
        os._exit(1)
    threading.Thread(target=watch, name="portapipe-tokenize-watch", daemon=True).start()


#: characters of text per call to the tokenizer: its time per character grows with the batch
#: (a call keeps every document's encoding until it returns), about 20% slower at 1 MiB than at
#: 64 Ki characters, and is flat below that (see benchmarks/data.py); a longer document is given
#: in slices of at most this many (:func:`cuts`), so memory stays bounded whatever its length
BATCH_CHARS = 1 << 16


def cuts(text: str, size: int) -> list[int]:
    """Where ``text`` is cut into slices of at most ``size`` characters: ``[0, ..., len(text)]``
    (``[0, len(text)]`` when it fits one). Each slice ends just before the last space in its reach
    that a character other than whitespace follows, so the next slice starts with that space:
    byte-level BPE pre-tokenizers (GPT-2's, Llama 3's, Qwen's, the shipped tokenizer's) and
    Metaspace split there anyway, and their ids are the whole text's. A stretch of ``size``
    characters without such a space is cut at ``size`` characters."""
    out, start, n = [0], 0, len(text)
    while n - start > size:
        end = start + size
        at = text.rfind(" ", start + 1, end + 1)
        while at > start and text[at + 1].isspace():  # a space before whitespace: no split there
            at = text.rfind(" ", start + 1, at)
        start = at if at > start else end
        out.append(start)
    out.append(n)
    return out


def _calls(texts: list[str]) -> Iterator[tuple[list[str], list[bool]]]:
    """The texts as the tokenizer is given them: calls of about :data:`BATCH_CHARS` characters,
    a longer text in slices; with each piece, whether it ends its text."""
    pieces: list[str] = []
    ends: list[bool] = []
    size = 0
    for text in texts:
        bounds = cuts(text, BATCH_CHARS)
        for k in range(1, len(bounds)):
            pieces.append(text[bounds[k - 1] : bounds[k]])  # the text itself when it fits (no copy)
            ends.append(k == len(bounds) - 1)
            size += bounds[k] - bounds[k - 1]
            if size >= BATCH_CHARS:
                yield pieces, ends
                pieces, ends, size = [], [], 0
    if pieces:
        yield pieces, ends


def _encode(texts: list[str]) -> list[list[int]]:
    """Each text's ids, in one call to the tokenizer."""
    tok = _STATE["tokenizer"]
    fast = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in fast(texts, add_special_tokens=False)]


def _documents(texts: list[str], out: Encoded) -> np.ndarray:
    """Each non-empty text's ids followed by the EOS, back to back; counts the empty ones. The ids
    go into the output's dtype a call at a time (numpy refuses an id it cannot hold), so a long
    document never lives as Python integers whole."""
    eos, dtype = _STATE["eos"], _STATE["dtype"]
    kept = [t for t in texts if t]
    out.empty += len(texts) - len(kept)
    parts: list[np.ndarray] = []
    lengths: list[int] = []
    run = 0  # tokens of the document being encoded
    for pieces, ends in _calls(kept):
        ids: list[list[int]] = []
        for piece_ids, end in zip(_encode(pieces), ends):
            ids.append(piece_ids)
            run += len(piece_ids)
            if end:
                ids.append([eos])
                lengths.append(run + 1)
                run = 0
        parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids))))
    out.lengths = lengths
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def encode_chunk(chunk: Chunk) -> Encoded:
    """A chunk as tokens (in a worker, or in the main process with one worker)."""
    out = Encoded(size=chunk.size)
    try:
        if chunk.kind == "text":
            ids = _documents([_decode(chunk)], out)
        elif chunk.kind == "lines":
            ids = _documents(_decode(chunk).splitlines(), out)
        elif chunk.kind == "jsonl":
            ids = _documents(_jsonl(chunk, out), out)
        else:
            ids = _documents(_table(chunk), out)
    except ValueError as exc:
        out.error = str(exc)
        return out
    except OverflowError:
        out.error = f"{chunk.path}: a token id does not fit {_STATE['dtype']}"
        return out
    out.ids = ids  # as it is: a copy of a long document's ids would be one more of its sizes
    out.max_id = int(ids.max()) if ids.size else 0
    return out


def _decode(chunk: Chunk, lo: int = 0, hi: int | None = None) -> str:
    """Bytes ``lo .. hi`` of the chunk as text; ValueError naming the file and line when they are not UTF-8."""
    try:
        return chunk.data[lo:hi].decode("utf-8")
    except UnicodeDecodeError as exc:
        line = chunk.first_line + chunk.data.count(b"\n", 0, lo + exc.start)
        raise ValueError(f"{chunk.path}:{line}: not UTF-8 text ({exc.reason})") from None


#: a jsonl chunk past this size holds a line longer than a chunk (:func:`~.readers.cut_point`), which
#: is read with json.loads (holding the text) rather than pyarrow (holding about 4x the line)
ARROW_BYTES = 4 << 20


def _jsonl(chunk: Chunk, out: Encoded) -> list[str]:
    """The chunk's documents: pyarrow's JSON reader when every line is an object with text at the
    field, else (a bad line, a missing field, no pyarrow, a chunk of very long lines) line by line,
    which says what is wrong and where, or skips and counts such lines."""
    texts = _jsonl_arrow(chunk.data) if len(chunk.data) <= ARROW_BYTES else None
    return texts if texts is not None else _jsonl_lines(chunk, out)


def _have_arrow() -> bool:
    try:
        import pyarrow.json  # noqa: F401
    except ImportError:
        return False
    return True


def _jsonl_arrow(data: bytes) -> list[str] | None:
    """Each line's text read by pyarrow (C++, several times json.loads' speed), or None when the
    lines are not all objects holding a string at the field (the line-by-line reader decides)."""
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        return None
    if not data.strip():
        return None
    try:
        data.decode("utf-8")  # pyarrow lets bytes that are not UTF-8 pass in a field it skips; json.loads refuses the line
    except UnicodeDecodeError:
        return None
    key = _STATE["field"]
    # the field alone, typed: any other field is not parsed into columns, a field of another type is an error
    parse = pj.ParseOptions(explicit_schema=pa.schema([(key, pa.string())]), unexpected_field_behavior="ignore")
    try:
        column = pj.read_json(io.BytesIO(data), parse_options=parse,
                              read_options=pj.ReadOptions(use_threads=False, block_size=len(data) + 1)).column(0)
    except (pa.ArrowException, UnicodeDecodeError):  # a bad line somewhere, or a field that is not text
        return None
    if column.null_count:  # a line without the field, or with null there
        return None
    lines = data.count(b"\n") + (not data.endswith(b"\n"))
    # pyarrow takes two objects on one line as two rows, json.loads refuses the line: count the lines holding something
    if len(column) != lines and len(column) != sum(1 for raw in data.split(b"\n") if raw.strip()):
        return None
    return column.to_pylist()


def _jsonl_lines(chunk: Chunk, out: Encoded) -> list[str]:
    texts = []
    key = _STATE["field"]
    for n, raw in enumerate(chunk.data.split(b"\n"), chunk.first_line):
        if not raw.strip():
            continue
        text, problem = _line_text(raw, key)
        if problem is None:
            texts.append(text)
        elif _STATE["skip_bad"]:
            out.bad += 1
        else:
            raise ValueError(f"{chunk.path}:{n}: {problem}")
    return texts


def _line_text(raw: bytes, key: str) -> tuple[str, str | None]:
    """(a jsonl line's text at ``key``, None), or ("", what is wrong with the line)."""
    try:
        record = json.loads(raw)
    except ValueError as exc:
        return "", f"not JSON ({exc}); --skip-bad skips such lines"
    text = record.get(key) if isinstance(record, dict) else None
    if not isinstance(text, str):
        what = "no field" if not isinstance(record, dict) or key not in record else f"a {type(text).__name__}, not text, in field"
        return "", f"{what} {key!r}; --field names the text's field, --skip-bad skips such lines"
    try:
        text.encode("utf-8")  # JSON's escapes can name half of a UTF-16 pair, which no text holds
    except UnicodeEncodeError as exc:
        return "", (f"field {key!r} holds a lone surrogate escape ({text[exc.start].encode('unicode_escape').decode()}), not text; "
                    "--skip-bad skips such lines")
    return text, None


def _table(chunk: Chunk) -> list[str]:
    """A parquet row group's or a saved dataset's rows of the text column (None rows skipped with ``skip_bad``)."""
    key = _STATE["field"]
    values, where = table_rows(chunk, key, _STATE["saved"])
    for i, v in enumerate(values):
        if not isinstance(v, str) and not (v is None and _STATE["skip_bad"]):
            raise ValueError(f"{where}: row {i} of column {key!r} is {type(v).__name__}, not text")
    return [v for v in values if isinstance(v, str)]


# ------------------------------------------------------------------------- the main process
@dataclass
class Totals:
    documents: int = 0
    tokens: int = 0
    bad: int = 0
    empty: int = 0
    bytes: int = 0
    max_id: int = 0
    per_input: dict[int, dict[str, int]] = field(default_factory=dict)


class _Output:
    """The files being written, fed the chunks' results in input order."""

    def __init__(self, tmp: Path, dtype: str, inputs: list[Input]) -> None:
        self.tokens: BinaryIO = open(tmp / folder.TOKENS, "wb")
        self.index: BinaryIO = open(tmp / folder.DOCUMENTS, "wb")
        self.index.write(np.zeros(1, dtype=folder.INDEX_DTYPE).tobytes())
        self.width = DTYPES[dtype].itemsize
        self.digest = hashlib.blake2b(digest_size=16)
        self.totals = Totals(per_input={i: {"documents": 0, "tokens": 0, "bad": 0, "empty": 0} for i in range(len(inputs))})
        self.end = 0  # where the last finished document ends

    def add(self, chunk: Chunk, got: Encoded) -> None:
        if got.error is not None:
            raise ValueError(got.error)
        t, mine = self.totals, self.totals.per_input[chunk.source]
        before = t.tokens
        self._write(got.ids)
        lengths = got.lengths
        if lengths:
            ends = self.end + np.cumsum(np.asarray(lengths, dtype=np.int64))
            self.index.write(ends.astype(folder.INDEX_DTYPE).tobytes())
            self.end = int(ends[-1])
        for key, n in (("documents", len(lengths)), ("tokens", t.tokens - before), ("bad", got.bad), ("empty", got.empty)):
            mine[key] += n
        t.documents += len(lengths)
        t.bad, t.empty, t.bytes = t.bad + got.bad, t.empty + got.empty, t.bytes + got.size
        t.max_id = max(t.max_id, got.max_id)

    def _write(self, ids: np.ndarray) -> None:
        self.tokens.write(ids.data)
        self.digest.update(ids.data)
        self.totals.tokens += ids.nbytes // self.width

    def close(self) -> None:
        for f in (self.tokens, self.index):
            if not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()


@dataclass
class Options:
    """What ``portapipe tokenize`` was asked (see the command's help)."""

    tokenizer: Path
    eos: int | None = None
    field: str = "text"
    split_lines: bool = False
    dtype: str = "auto"
    workers: int = 1
    skip_bad: bool = False
    progress: bool = False
    eos_from: str = "--eos"  # where an EOS given by the caller comes from (the command's defaults say theirs)


def resolve(options: Options) -> tuple[str, int, str, int]:
    """(dtype, EOS id, where the EOS comes from, vocabulary size); ValueError (one line) for a
    tokenizer that does not fit the dtype or names no EOS."""
    tok = load_tokenizer(options.tokenizer)
    vocab = vocab_size(tok)
    dtype = dtype_for_vocab(vocab) if options.dtype == "auto" else options.dtype
    if vocab > 1 << (8 * DTYPES[dtype].itemsize):
        raise ValueError(f"--dtype {dtype} holds ids below {1 << (8 * DTYPES[dtype].itemsize)}, but the tokenizer has {vocab} tokens; use uint32 (or auto)")
    if options.eos is not None:
        eos, where = options.eos, options.eos_from
    else:
        found = find_eos(tok, options.tokenizer)
        if found is None:
            raise ValueError(f"the tokenizer {tokenizer_file(options.tokenizer)} names no end-of-document token (no eos_token in a "
                             "tokenizer_config.json beside it, no special token such as <|endoftext|>); give its id with --eos ID")
        eos, where = found
    if not 0 <= eos < vocab:
        raise ValueError(f"--eos {eos} is not an id of the tokenizer (0..{vocab - 1})")
    return dtype, eos, where, vocab


def write_dataset(inputs: list[Input], out: Path, options: Options) -> dict[str, Any]:
    """Tokenize ``inputs`` into the dataset folder ``out``; return its description (see
    :mod:`.folder`). ValueError (one line) for bad input; nothing is left at ``out`` then."""
    dtype, eos, eos_from, vocab = resolve(options)
    if not inputs:
        raise ValueError("no input: name files, folders or globs")
    if any(item.kind == "jsonl" for item in inputs) and not _have_arrow():
        print("portapipe: tokenize: pyarrow is not installed, so jsonl is read line by line, several times slower "
              "(pip install 'portapipe[data]' for its JSON reader)", file=sys.stderr)
    tmp = folder.temporary(out)
    t0 = time.perf_counter()
    output = _Output(tmp, dtype, inputs)
    try:
        args = (str(options.tokenizer), eos, dtype, options.field, options.skip_bad)
        with _progress(options.progress, inputs) as bar:
            for chunk, got in _encoded(chunks(inputs, options.field, options.split_lines), options.workers, args):
                output.add(chunk, got)
                if bar is not None:
                    bar.update(got.size)
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(docs=output.totals.documents, tok_s=f"{output.totals.tokens / elapsed:.3g}", refresh=False)
        output.close()
        t = output.totals
        if t.documents == 0:
            skipped = f" ({t.bad} bad line(s), {t.empty} empty document(s) skipped)" if t.bad or t.empty else ""
            raise ValueError(f"the corpus is empty: no document in {len(inputs)} input(s){skipped}")
        tok_file = tokenizer_file(options.tokenizer)
        meta = {
            "format": folder.FORMAT, "version": folder.VERSION, "dtype": dtype, "vocab_size": vocab, "eos_id": eos, "eos_from": eos_from,
            "documents": t.documents, "tokens": t.tokens, "max_id": t.max_id, "bad_skipped": t.bad, "empty_skipped": t.empty,
            "field": options.field, "split_lines": options.split_lines,
            "tokenizer": {"path": str(tok_file), "sha256": sha256(tok_file)},
            "sources": [{"path": str(item.path), "kind": item.kind, **t.per_input[i]} for i, item in enumerate(inputs)],
            "tokens_blake2b": output.digest.hexdigest(),
            "input_bytes": t.bytes, "seconds": round(time.perf_counter() - t0, 3),
        }
        folder.write_description(tmp, meta)
        folder.publish(tmp, out)
    except BaseException:
        output.close()
        folder.discard(tmp)
        raise
    return meta


def _encoded(todo: Any, workers: int, args: tuple[Any, ...]) -> Any:
    """(chunk, its tokens) in input order: in this process for one worker, else in ``workers``
    processes with a bounded number in flight."""
    if workers <= 1:
        before = os.environ.get(_PARALLELISM)
        try:
            _init(*args)
            for chunk in todo:
                yield chunk, encode_chunk(chunk)
        finally:  # this process's setting as it was (the library reads it at each call)
            if before is None:
                os.environ.pop(_PARALLELISM, None)
            else:
                os.environ[_PARALLELISM] = before
        return
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":  # the server imports the workers' modules once, each worker is forked with them;
        # it is tied to this process's life as the ranks' server is (no effect once a server runs)
        context.set_forkserver_preload(["portapipe.data.writer", "tokenizers", "portapipe.ranks.forkserver_tie"])
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init, initargs=(*args, os.getpid()))
    pending: collections.deque[tuple[Chunk, Future[Encoded]]] = collections.deque()
    finished = False
    try:
        for chunk in todo:
            pending.append((chunk, pool.submit(encode_chunk, chunk)))
            while len(pending) > 2 * workers + 2:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
        finished = True
    finally:
        if not finished:  # an error or a stop: a worker deep in a long chunk is not waited for
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _progress(show: bool, inputs: list[Input]) -> Any:
    """A progress bar over the input bytes (their total when none is compressed), or nothing."""
    if not show:
        return _NoBar()
    from tqdm import tqdm

    packed = any(compressed(item.path) for item in inputs if item.kind not in ("parquet", "hf"))
    total = None if packed else sum(item.size for item in inputs)
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
