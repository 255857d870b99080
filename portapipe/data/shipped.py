"""What ships with portapipe in ``portapipe/assets/``: the default corpus and the tokenizer made for it.

- ``shakespeare.txt.gz``: the plays of Shakespeare, public domain, pure ASCII (``SOURCE.txt``
  says where they come from); ``data.format: bytes`` trains on it by default.
- ``tokenizer-1k.json``: the 1,024-token byte-level BPE tokenizer trained on that corpus
  (``examples/make_tokenizer.py``; in a checkout a link to ``examples/tokenizer/tokenizer.json``,
  in a wheel the file). It has no end-of-document token: ``portapipe tokenize`` without a text
  separates documents with the token of byte 0xff (:func:`shipped_eos`), which the ASCII corpus
  never holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_CORPUS = ASSETS / "shakespeare.txt.gz"
SHIPPED_TOKENIZER = ASSETS / "tokenizer-1k.json"


def byte_token(value: int) -> str:
    """The character a byte-level BPE (GPT-2's mapping) writes byte ``value`` as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if value in printable:
        return chr(value)
    return chr(256 + [b for b in range(256) if b not in printable].index(value))


def shipped_eos(tokenizer: Any) -> int:
    """The id the shipped corpus's documents end with: the token of byte 0xff in ``tokenizer``."""
    token_id = tokenizer.token_to_id(byte_token(0xFF))
    if token_id is None:
        raise ValueError("the tokenizer has no token for byte 0xff; name the end-of-document id with --eos ID")
    return int(token_id)
