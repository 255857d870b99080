"""``portapipe tokenize TEXT OUT --tokenizer DIR``: a text as a token file for ``data.format: tokens``.

Encodes TEXT (UTF-8, plain or gzipped) with the Hugging Face tokenizer in DIR (its
``tokenizer.json``, or that file itself) through the ``tokenizers`` library (extra ``data``),
and writes OUT: the ids back to back, uint16 when the vocabulary has at most 65,536 tokens,
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
    from ..tokens import tokenize

    text, out = Path(args.text), Path(args.out)
    problem = None
    if not text.is_file():
        problem = f"{text} does not exist or is not a file"
    elif out.resolve() == text.resolve():
        problem = f"OUT {out} is the text itself; choose another file"
    elif out.is_dir():
        problem = f"OUT {out} is a folder; name a file, e.g. {out / 'tokens.bin'}"
    if problem is None:
        try:
            meta = tokenize(text, out, Path(args.tokenizer))
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
    p.add_argument("text", help="UTF-8 text file, plain or gzipped")
    p.add_argument("out", help="token file to write (and OUT.json beside it)")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="folder with tokenizer.json, or the file")
    p.set_defaults(func=run)
