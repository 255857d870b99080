"""The configured data: its sources, their train and validation parts, and what stops it serving a model.

``data.format: bytes`` reads one text (``data.path``, by default the corpus shipped with
portapipe); ``tokens`` reads ``data.sources`` (a blend) or ``data.path`` (a blend of one). The
validation data is ``data.val_sources``, or else the last ``data.val_fraction`` of each source,
cut at that token (a document may straddle the cut).

:func:`data_problems` runs before any rank starts and says, one line each, what stops the data
from serving the config: a source that does not open, a vocabulary or an id the model does not
hold, a part too small for one sample of ``model.seq_len + 1`` tokens, a source without document
boundaries where ``data.document_mask`` / ``data.mask_eos_loss`` needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import flat
from .shipped import DEFAULT_CORPUS
from .sources import Source, open_bytes, open_source


@dataclass
class Part:
    """Tokens ``lo .. hi`` of a source, with its weight in the blend."""

    source: Source
    lo: int
    hi: int
    weight: float = 1.0

    @property
    def tokens(self) -> int:
        return self.hi - self.lo


@dataclass
class Corpus:
    """The train parts (the blend) and the validation parts of the configured data."""

    train: list[Part]
    val: list[Part]
    sampling: str  # epochs | random


def corpus_path(config: Any) -> Path:
    """``data.path``, or for bytes the shipped corpus when it is not set."""
    return Path(config.data.path).expanduser() if config.data.path else DEFAULT_CORPUS


def sampling_of(config: Any) -> str:
    d = config.data
    return d.sampling if d.sampling != "auto" else ("epochs" if d.format == "tokens" else "random")


@dataclass(frozen=True)
class Listed:
    """A source as the config names it."""

    key: str  # the config key of its path
    path: str
    weight: float
    token_dtype: str  # a flat file's width
    dtype_key: str  # the key that says it (or, for auto, the one to set)
    own: bool  # the source's own key (a folder's or an index's width must agree), not the blend's fallback


def _listed(config: Any, key: str) -> list[Listed]:
    """Each source in ``data.<key>``: its own ``token_dtype``, else ``data.token_dtype`` for a flat file."""
    d, out = config.data, []
    for i, s in enumerate(getattr(d, key) or []):
        here = f"data.{key}[{i}].token_dtype"
        if s.token_dtype is not None:
            out.append(Listed(f"data.{key}[{i}].path", s.path, s.weight, s.token_dtype, here, True))
        else:
            out.append(Listed(f"data.{key}[{i}].path", s.path, s.weight, d.token_dtype,
                              here if d.token_dtype == "auto" else "data.token_dtype", False))
    return out


def open_corpus(config: Any) -> Corpus:
    """The configured sources, opened (memory-mapped), and their parts; ValueError with every
    problem (one line each, joined) when one does not open."""
    corpus, problems = _open(config)
    if problems:
        raise ValueError("; ".join(problems))
    assert corpus is not None
    return corpus


def _open(config: Any) -> tuple[Corpus | None, list[str]]:
    d = config.data
    sampling = sampling_of(config)
    if d.format == "bytes":
        try:
            source = open_bytes(corpus_path(config))
        except ValueError as exc:
            return None, [str(exc)]
        return Corpus(*_split([(source, 1.0)], d.val_fraction), sampling), []
    if d.path is None and not d.sources:
        return None, ["data.path: not set; data.format tokens reads a dataset folder (portapipe tokenize IN... OUT), a Megatron "
                      "prefix or a token file, or set data.sources"]
    listed = _listed(config, "sources") or [Listed("data.path", d.path, 1.0, d.token_dtype, "data.token_dtype", True)]
    problems: list[str] = []
    train = _opened(listed, d, problems)
    val_listed = _listed(config, "val_sources")
    val = _opened(val_listed, d, problems)
    if problems:
        return None, problems
    if val_listed:
        parts = [Part(s, 0, len(s.tokens), w) for s, w in train]
        return Corpus(parts, [Part(s, 0, len(s.tokens), w) for s, w in val], sampling), []
    return Corpus(*_split(train, d.val_fraction), sampling), []


def _opened(listed: list[Listed], d: Any, problems: list[str]) -> list[tuple[Source, float]]:
    out = []
    for s in listed:
        try:
            out.append((open_source(Path(s.path).expanduser(), s.key, s.token_dtype, d.vocab_size, s.dtype_key, s.own), s.weight))
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
    return out


def _split(sources: list[tuple[Source, float]], fraction: float) -> tuple[list[Part], list[Part]]:
    train, val = [], []
    for source, weight in sources:
        n = len(source.tokens)
        cut = n - int(n * fraction)
        train.append(Part(source, 0, cut, weight))
        if fraction > 0:
            val.append(Part(source, cut, n, weight))
    return train, val


# ---------------------------------------------------------------------------- before launch
def data_problems(config: Any, check_ids: bool = True) -> list[str]:
    """What stops the data from serving this config, one line per problem (empty when fine).

    ``check_ids``: scan a flat token file for its largest id (a dataset folder records it; a
    Megatron dataset's ids are checked in each batch as it is made)."""
    return checked_corpus(config, check_ids)[1]


def checked_corpus(config: Any, check_ids: bool = False) -> tuple[Corpus | None, list[str]]:
    """The configured data opened, and :func:`data_problems`'s lines (the corpus is None when it does not open)."""
    d, m = config.data, config.model
    if d.format == "bytes" and d.vocab_size is not None:
        return None, [f"data.vocab_size: {d.vocab_size} applies to data.format tokens only (bytes are 256 ids)"]
    corpus, problems = _open(config)
    if corpus is None:
        return None, problems
    out: list[str] = []
    for part in corpus.train + ([] if d.val_sources is None else corpus.val):
        out += _vocab_problems(part.source, m.vocab_size, d, check_ids)
        if d.document_mask or d.mask_eos_loss:
            if not part.source.has_documents:
                which = "data.document_mask" if d.document_mask else "data.mask_eos_loss"
                out.append(f"{part.source.key}: {part.source.name} is a {part.source.kind} source without document boundaries; "
                           f"{which} needs a dataset folder (portapipe tokenize) or a Megatron dataset")
    unit = "bytes" if d.format == "bytes" else "tokens"
    need = m.seq_len + 1
    for part in corpus.train:
        if part.tokens < need:
            out.append(f"{part.source.key}: the train split of {part.source.name} has {part.tokens} {unit}, fewer than model.seq_len + 1 = {need}")
    for part in corpus.val:
        if part.tokens < need:
            if d.val_sources is None:
                out.append(f"data.val_fraction: {d.val_fraction} leaves {part.tokens} validation {unit} of {part.source.name}, "
                           f"fewer than model.seq_len + 1 = {need}; raise it or set 0 to skip validation")
            else:
                out.append(f"{part.source.key}: {part.source.name} has {part.tokens} {unit}, fewer than model.seq_len + 1 = {need}")
    return corpus, out


def _vocab_problems(source: Source, vocab_size: int, d: Any, check_ids: bool) -> list[str]:
    if source.kind == "bytes":
        top = source.max_id or 0
        if top >= vocab_size:
            return [f"model.vocab_size: {vocab_size} is too small for byte-level tokens of {source.name}, "
                    f"which holds byte values up to {top} (use vocab_size >= {top + 1}, e.g. 256)"]
        return []
    if source.kind == "flat":
        return flat.file_problems(source.path, source.tokens.dtype.name, vocab_size, check_ids, d.vocab_size, source.key, source.dtype_key)[1]
    out = []
    if source.vocab_size is not None and source.vocab_size > vocab_size:
        where = "data.vocab_size" if d.vocab_size is not None else "its description"
        out.append(f"model.vocab_size: {vocab_size} is smaller than the vocabulary of the tokenizer that wrote {source.name} "
                   f"({source.vocab_size} tokens, {where})")
    if source.max_id is not None and source.max_id >= vocab_size:
        out.append(f"model.vocab_size: {vocab_size} is too small for {source.name}, which holds token ids up to {source.max_id} "
                   f"(use vocab_size >= {source.max_id + 1})")
    return out
