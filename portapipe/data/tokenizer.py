"""A Hugging Face fast tokenizer (``tokenizer.json``) for ``portapipe tokenize``: loading it, its
end-of-document token and its identity.

The end-of-document (EOS) id goes after every document. It is taken from, in order: ``--eos ID``;
the ``eos_token`` of a ``tokenizer_config.json`` beside the tokenizer (what transformers reads);
an added special token with one of the usual names (:data:`EOS_NAMES`). A tokenizer with none of
these (the 1,024-token one shipped with portapipe) needs ``--eos``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def tokenizer_file(where: Path) -> Path:
    """``tokenizer.json`` in folder ``where``, or ``where`` itself; ValueError when there is none."""
    file = where / "tokenizer.json" if where.is_dir() else where
    if not file.is_file():
        raise ValueError(f"{where} holds no tokenizer.json (a Hugging Face fast tokenizer file)")
    return file


def load_tokenizer(where: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a folder holding one."""
    file = tokenizer_file(where)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("portapipe tokenize needs the tokenizers library: pip install 'portapipe[data]'") from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises its own exception type
        raise ValueError(f"{file} is not a tokenizer the tokenizers library reads: {exc}") from None


def sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def vocab_size(tokenizer: Any) -> int:
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def find_eos(tokenizer: Any, where: Path) -> tuple[int, str] | None:
    """(EOS id, where it was found) from the tokenizer's own files, None when they name none."""
    config = (where if where.is_dir() else where.parent) / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return int(tokenizer.token_to_id(eos)), f"{config.name} eos_token {eos!r}"
    for name in EOS_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None and _special(tokenizer, name):
            return int(token_id), f"special token {name!r}"
    return None


def _special(tokenizer: Any, name: str) -> bool:
    decoder = getattr(tokenizer, "get_added_tokens_decoder", None)
    if decoder is None:
        return True
    return any(t.content == name and t.special for t in decoder().values())
