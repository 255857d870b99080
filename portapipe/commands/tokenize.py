"""``portapipe tokenize [INPUT ...] OUT [--tokenizer DIR] [--eos ID] ...``: corpora as a token dataset.

Encodes the INPUTs (files, folders, globs, any mix: text plain / .gz / .zst, one document per
file or per line with --split-lines; jsonl (.jsonl / .json, compressed or not) with --field;
parquet with --field the column; a folder saved by Hugging Face ``datasets.save_to_disk``) with
the Hugging Face tokenizer in DIR (its ``tokenizer.json``, or that file), and writes the dataset
folder OUT that ``data.format: tokens`` reads: the ids back to back (uint16 when the vocabulary
has at most 65,536 tokens, else uint32), the EOS id after every document, a document index and
``dataset.json`` describing it all (docs/training.md). --workers processes encode in parallel,
each on one thread (the tokenizers library's own thread pool is off, so N workers keep N cores
busy); the output is the same bytes for any number of them.

The EOS is --eos ID, else the tokenizer's own (the ``eos_token`` of a ``tokenizer_config.json``
beside it, or a special token such as ``<|endoftext|>``); a tokenizer with neither needs --eos.
Without INPUT: the corpus shipped with portapipe (one document) with the 1,024-token tokenizer
trained on it (``examples/make_tokenizer.py``) and, as its EOS, the token of byte 0xff, which
the ASCII corpus never holds: so ``portapipe tokenize runs/shakespeare-1k`` works from any folder.
Inputs of one's own need their --tokenizer (the shipped one, made for that corpus, is never
taken for them unasked).

Prints the description as one JSON line and a one-line summary on stderr (a progress bar with
documents, MB/s and tokens/s while it runs, when stderr is a terminal). Exit 0 on success, 2 for
bad input, in one line (nothing is written then: the folder is written under a temporary name
and renamed when complete); SIGINT / SIGTERM stop it at once, in one line, with 130 / 143 and
nothing written. The workers end with it, however it ends (kill -9 too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class _Stopped(BaseException):
    """A stop signal, raised where the command is (a BaseException: no ``except Exception`` keeps it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stops_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`_Stopped` for the duration (main thread only), so the
    write unwinds: its temporary folder removed, its workers ended."""
    from ..ranks.stop import STOP_SIGNALS

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stop(signum: int, frame: Any) -> None:
        for sig in STOP_SIGNALS:  # one stop: a second signal does not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped(signum)

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, raise_stop)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _problem(inputs: list[str], out: Path, tokenizer: str | None) -> str | None:
    """What is wrong with the arguments before anything is read."""
    from ..data.folder import is_dataset

    if tokenizer is None:
        return f"--tokenizer is needed for {' '.join(inputs)}: name the tokenizer its token data is for (leave INPUT out for the shipped corpus and its tokenizer)"
    if out.is_file():
        return f"OUT {out} is a file; name a folder to write the dataset into"
    if out.is_dir() and not is_dataset(out) and any(out.iterdir()):
        return f"OUT {out} is a folder holding other files; name a new folder (or an earlier dataset, which is replaced)"
    for spec in inputs:
        p = Path(spec)
        if p.exists() and (p.resolve() == out.resolve() or out.resolve() in p.resolve().parents):
            return f"OUT {out} is (or is inside) the input {spec}; choose another folder"
    return None


def run(args: argparse.Namespace) -> int:
    from ..data.readers import expand
    from ..data.shipped import DEFAULT_CORPUS, SHIPPED_TOKENIZER, shipped_eos
    from ..data.tokenizer import load_tokenizer
    from ..data.writer import Options, write_dataset
    from ..ranks.pinning import usable_cores
    from ..ranks.stop import exit_code

    *inputs, out_arg = args.paths
    out = Path(out_arg)
    shipped = not inputs
    tokenizer = args.tokenizer or (str(SHIPPED_TOKENIZER) if shipped else None)
    problem = _problem(inputs or [str(DEFAULT_CORPUS)], out, tokenizer)
    meta: dict[str, Any] = {}
    if problem is None:
        t0 = time.perf_counter()
        try:
            with _stops_raise():
                items = expand(inputs or [str(DEFAULT_CORPUS)])
                eos, eos_from = args.eos, "--eos"
                if shipped and eos is None and args.tokenizer is None:
                    eos, eos_from = shipped_eos(load_tokenizer(SHIPPED_TOKENIZER)), "the shipped corpus's default (byte 0xff's token)"
                options = Options(
                    Path(tokenizer), eos=eos, field=args.field, split_lines=args.split_lines, dtype=args.dtype,
                    workers=args.workers or len(usable_cores()), skip_bad=args.skip_bad,
                    progress=sys.stderr.isatty() if args.progress is None else args.progress, eos_from=eos_from,
                )
                meta = write_dataset(items, out, options)
        except ValueError as exc:
            problem = str(exc)
        except OSError as exc:  # OUT cannot be written (no space, no permission)
            problem = f"cannot write {out}: {exc.strerror or exc}"
        except _Stopped as stop:
            print(f"portapipe: tokenize: stopped by {signal.Signals(stop.signum).name}; nothing was written to {out}", file=sys.stderr)
            return exit_code(stop.signum)
    if problem is not None:
        print(f"portapipe: tokenize: {problem}", file=sys.stderr)
        return 2
    print(json.dumps(meta))
    print(f"portapipe: tokenize: {summary(out, meta, time.perf_counter() - t0)}", file=sys.stderr)
    return 0


def summary(out: Path, meta: dict[str, Any], seconds: float) -> str:
    """The one line said at the end."""
    mb = meta["input_bytes"] / 1e6
    skipped = [f"{meta[k]} {what} skipped" for k, what in (("bad_skipped", "bad line(s)"), ("empty_skipped", "empty document(s)")) if meta[k]]
    return (f"wrote {out}: {meta['documents']:,} documents, {meta['tokens']:,} {meta['dtype']} tokens (EOS {meta['eos_id']}) from "
            f"{len(meta['sources'])} input(s), {mb:,.1f} MB in {seconds:.1f} s ({mb / max(seconds, 1e-9):,.1f} MB/s, "
            f"{meta['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)" + "".join(f"; {s}" for s in skipped))


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count of processes (1 or more)")
    return value


def _token_id(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a token id (0 or more)")
    return value


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tokenize",
        help="encode corpora (text, jsonl, parquet, saved Hugging Face datasets) into a token dataset (data.format: tokens)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="[INPUT ...] OUT",
                   help="files, folders or globs to read [the corpus shipped with portapipe], then the dataset folder to write")
    p.add_argument("--tokenizer", metavar="DIR", help="folder with tokenizer.json, or the file [without INPUT: the 1,024-token tokenizer shipped with portapipe]")
    p.add_argument("--eos", type=_token_id, metavar="ID", help="the id written after every document [the tokenizer's EOS]")
    p.add_argument("--field", default="text", metavar="NAME", help="jsonl: the key of each line's text; parquet and saved datasets: the column [text]")
    p.add_argument("--split-lines", action="store_true", help="text files: one document per line (empty lines skipped) [one per file]")
    p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto", help="width of one id [auto: uint16 when the vocabulary fits]")
    p.add_argument("--workers", type=_count, metavar="N", help="processes encoding in parallel [the usable cores]")
    p.add_argument("--skip-bad", action="store_true", help="skip (and count) jsonl lines that are not JSON or lack the field [refuse them]")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar [when stderr is a terminal]")
    p.set_defaults(func=run)
