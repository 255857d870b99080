"""``portapipe tokenize [TEXT] OUT [--tokenizer DIR]``: a text as a token file for ``data.format: tokens``.

Encodes TEXT (UTF-8, plain or gzipped) with the Hugging Face tokenizer in DIR (its
``tokenizer.json``, or that file itself) through the ``tokenizers`` library (extra ``data``),
and writes OUT. Without TEXT: the corpus shipped with portapipe, by default with the 1,024-token
tokenizer shipped beside it, which was trained on it (``examples/make_tokenizer.py``): so
``portapipe tokenize runs/shakespeare-1k.bin`` works from any folder. A TEXT of one's own needs
its ``--tokenizer`` (the shipped one, made for that corpus, is never taken for it unasked).
OUT holds the ids back to back, uint16 when the vocabulary has at most 65,536 tokens,
uint32 otherwise, plus OUT.json naming the width and the vocabulary size (what
``data.token_dtype: auto`` reads). Prints that description as one JSON line. Exit 0 on
success, 2 for bad input (nothing is written then).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace) -> int:
    from ..data import DEFAULT_CORPUS
    from ..tokens import SHIPPED_TOKENIZER, tokenize

    text, out = Path(args.text or DEFAULT_CORPUS), Path(args.out)
    tokenizer = args.tokenizer or (SHIPPED_TOKENIZER if args.text is None else None)
    problem = None
    if tokenizer is None:
        problem = f"--tokenizer is needed for {text}: name the tokenizer its token data is for (leave TEXT out for the shipped corpus and its tokenizer)"
    elif not text.is_file():
        problem = f"{text} does not exist or is not a file"
    elif out.resolve() == text.resolve():
        problem = f"OUT {out} is the text itself; choose another file"
    elif out.is_dir():
        problem = f"OUT {out} is a folder; name a file, e.g. {out / 'tokens.bin'}"
    if problem is None:
        try:
            meta = tokenize(text, out, Path(tokenizer))
        except ValueError as exc:
            problem = str(exc)
        except OSError as exc:  # OUT cannot be written (its folder is a file, no space, no permission)
            problem = f"cannot write {out}: {exc.strerror or exc}"
    if problem is not None:
        print(f"portapipe: tokenize: {problem}", file=sys.stderr)
        return 2
    print(json.dumps(meta))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tokenize",
        help="encode a text with a Hugging Face tokenizer into a token file (data.format: tokens)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("text", nargs="?", help="UTF-8 text file, plain or gzipped [the corpus shipped with portapipe]")
    p.add_argument("out", help="token file to write (and OUT.json beside it)")
    p.add_argument("--tokenizer", metavar="DIR", help="folder with tokenizer.json, or the file [without TEXT: the 1,024-token tokenizer shipped with portapipe]")
    p.set_defaults(func=run)
