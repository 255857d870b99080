"""Training data: a text corpus tokenised at byte level (one token per byte).

The default corpus is the plays of Shakespeare shipped in ``portapipe/data/`` (public domain,
see ``portapipe/data/SOURCE.txt``); ``data.path`` names another UTF-8 (or any byte) text file,
plain or gzipped. The last ``data.val_fraction`` of the bytes is the validation split.

Batches are random windows of ``seq_len + 1`` bytes (inputs and targets shifted by one),
drawn from a generator seeded by (seed, split, step, dp_rank, ep_rank): any rank can make any
step's batch on its own, without shared state, and a resumed run sees exactly the batches an
uninterrupted one would.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import zlib
from pathlib import Path
from typing import Literal

import torch

from .config import Config

DEFAULT_CORPUS = Path(__file__).with_name("data") / "shakespeare.txt.gz"

Split = Literal["train", "val"]
Batch = tuple[torch.Tensor, torch.Tensor]


class DataReadError(ValueError):
    """The data file cannot be read; the message is one line naming the file and why."""


@functools.lru_cache(maxsize=4)
def _read_bytes(path: str) -> torch.Tensor:
    """The file's bytes as a uint8 tensor; gzip files (by magic number) are decompressed."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DataReadError(f"data.path: cannot read {path!r}: {exc.strerror or exc}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataReadError(f"data.path: {path!r} looks gzipped but cannot be decompressed ({exc})") from None
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def corpus_path(config: Config) -> Path:
    return Path(config.data.path).expanduser() if config.data.path else DEFAULT_CORPUS


def data_problems(config: Config) -> list[str]:
    """What stops the data from serving this config, one line per problem (empty when fine).

    Checked before any rank starts: the file exists, its bytes fit the vocabulary, and each
    split holds at least one window of ``model.seq_len + 1`` bytes.
    """
    path = corpus_path(config)
    if not path.is_file():
        return [f"data.path: {str(path)!r} does not exist or is not a file"]
    try:
        tokens = _read_bytes(str(path))
    except DataReadError as exc:
        return [str(exc)]
    out = []
    if tokens.numel() == 0:
        return [f"data.path: {str(path)!r} is empty"]
    top = int(tokens.max())
    if top >= config.model.vocab_size:
        out.append(
            f"model.vocab_size: {config.model.vocab_size} is too small for byte-level tokens of {path.name}, "
            f"which holds byte values up to {top} (use vocab_size >= {top + 1}, e.g. 256)"
        )
    n_val = _n_val(tokens.numel(), config.data.val_fraction)
    need = config.model.seq_len + 1
    if tokens.numel() - n_val < need:
        out.append(f"data.path: the train split of {path.name} has {tokens.numel() - n_val} bytes, fewer than model.seq_len + 1 = {need}")
    if config.data.val_fraction > 0 and n_val < need:
        out.append(
            f"data.val_fraction: {config.data.val_fraction} leaves {n_val} validation bytes of {path.name}, "
            f"fewer than model.seq_len + 1 = {need}; raise it or set 0 to skip validation"
        )
    return out


def _n_val(n: int, fraction: float) -> int:
    return int(n * fraction)


def _seed(*parts: object) -> int:
    """A 63-bit generator seed from the parts; stable across processes and Python versions."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TextData:
    """Byte-level batches from a text corpus, deterministic in (seed, split, step, ranks)."""

    def __init__(self, config: Config) -> None:
        problems = data_problems(config)
        if problems:
            raise ValueError("; ".join(problems))
        self.path = corpus_path(config)
        self.seed = config.train.seed
        tokens = _read_bytes(str(self.path))
        n_val = _n_val(tokens.numel(), config.data.val_fraction)
        self.splits: dict[str, torch.Tensor] = {"train": tokens[: tokens.numel() - n_val], "val": tokens[tokens.numel() - n_val :]}

    def n_bytes(self, split: Split = "train") -> int:
        return int(self.splits[split].numel())

    def microbatches(
        self,
        step: int,
        dp_rank: int,
        ep_rank: int,
        n_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        split: Split = "train",
    ) -> list[Batch]:
        """``n_microbatches`` pairs (inputs, targets), each LongTensor[micro_batch_size, seq_len].

        targets are the inputs shifted by one byte. Every (dp_rank, ep_rank) gets its own data;
        all pipeline ranks of one pipeline asking with the same arguments get the same batches.
        """
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        tokens = self.splits[split]
        span = seq_len + 1
        if tokens.numel() < span:
            raise ValueError(f"the {split} split has {tokens.numel()} bytes, fewer than seq_len + 1 = {span}")
        gen = torch.Generator().manual_seed(_seed(self.seed, split, step, dp_rank, ep_rank))
        n = n_microbatches * micro_batch_size
        starts = torch.randint(0, tokens.numel() - span + 1, (n,), generator=gen)
        windows = tokens[starts[:, None] + torch.arange(span)].long()
        windows = windows.view(n_microbatches, micro_batch_size, span)
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]
