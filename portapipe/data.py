"""Training data: a text corpus tokenised at byte level (one token per byte), or a token file.

``data.format: bytes`` [default]: the default corpus is the plays of Shakespeare shipped in
``portapipe/data/`` (public domain, see ``portapipe/data/SOURCE.txt``); ``data.path`` names
another UTF-8 (or any byte) text file, plain or gzipped. ``data.format: tokens``: ``data.path``
is a flat file of uint16 / uint32 token ids, memory-mapped (see :mod:`portapipe.tokens`). The
last ``data.val_fraction`` of the tokens is the validation split.

Batches are random windows of ``seq_len + 1`` bytes (inputs and targets shifted by one). A
step's *global batch* is a fixed set of windows: their starts are drawn from a generator seeded
by (seed, split, step) only, and the ``dp x ep`` replicas share them out in order (replica r,
micro-batch m takes the next ``micro_batch_size`` windows). So the data of a step depends on the
global batch size (replicas x micro-batches x micro-batch size) but not on how it is split:
any rank can make any step's batch on its own, a resumed run sees exactly the batches of an
uninterrupted one, and a run resumed on another layout with the same global batch too.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import zlib
from pathlib import Path
from typing import Literal

import torch

from . import tokens as token_files
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


def token_array(config: Config) -> torch.Tensor:
    """All tokens of the configured data, one dimension: the bytes of a text, or a token file's ids."""
    if config.data.format == "tokens":
        dtype, problems = token_files.file_problems(corpus_path(config), config.data.token_dtype, config.model.vocab_size, check_ids=False)
        if dtype is None:
            raise ValueError("; ".join(problems))
        return token_files.open_tokens(corpus_path(config), dtype)
    return _read_bytes(str(corpus_path(config)))


def data_problems(config: Config, check_ids: bool = True) -> list[str]:
    """What stops the data from serving this config, one line per problem (empty when fine).

    Checked before any rank starts: the file exists, its bytes fit the vocabulary, and each
    split holds at least one window of ``model.seq_len + 1`` bytes. For a token file: its
    width, and (``check_ids``: a scan of the file) its largest id below ``model.vocab_size``.
    """
    if config.data.format == "tokens":
        return _token_problems(config, check_ids)
    if config.data.vocab_size is not None:
        return [f"data.vocab_size: {config.data.vocab_size} applies to data.format tokens only (bytes are 256 ids)"]
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
    return out + _split_problems(config, tokens.numel(), "bytes", path.name)


def _token_problems(config: Config, check_ids: bool) -> list[str]:
    if config.data.path is None:
        return ["data.path: not set; data.format tokens reads a token file (write one with portapipe tokenize TEXT OUT --tokenizer DIR)"]
    path = corpus_path(config)
    dtype, out = token_files.file_problems(path, config.data.token_dtype, config.model.vocab_size, check_ids, config.data.vocab_size)
    if dtype is None:
        return out
    return out + _split_problems(config, token_files.open_tokens(path, dtype).numel(), "tokens", path.name)


def _split_problems(config: Config, n: int, unit: str, name: str) -> list[str]:
    """Each split of ``n`` tokens must hold one window of ``model.seq_len + 1``."""
    n_val = _n_val(n, config.data.val_fraction)
    need = config.model.seq_len + 1
    out = []
    if n - n_val < need:
        out.append(f"data.path: the train split of {name} has {n - n_val} {unit}, fewer than model.seq_len + 1 = {need}")
    if config.data.val_fraction > 0 and n_val < need:
        out.append(
            f"data.val_fraction: {config.data.val_fraction} leaves {n_val} validation {unit} of {name}, "
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
        problems = data_problems(config, check_ids=False)  # the launch checked the ids (a scan of the file)
        if problems:
            raise ValueError("; ".join(problems))
        self.path = corpus_path(config)
        self.seed = config.train.seed
        tokens = token_array(config)
        n_val = _n_val(tokens.numel(), config.data.val_fraction)
        self.splits: dict[str, torch.Tensor] = {"train": tokens[: tokens.numel() - n_val], "val": tokens[tokens.numel() - n_val :]}

    def n_bytes(self, split: Split = "train") -> int:
        return int(self.splits[split].numel())

    def microbatches(
        self,
        step: int,
        replica: int,
        replicas: int,
        n_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        split: Split = "train",
    ) -> list[Batch]:
        """Replica ``replica`` of ``replicas``'s share of step ``step``'s global batch.

        ``n_microbatches`` pairs (inputs, targets), each LongTensor[micro_batch_size, seq_len];
        targets are the inputs shifted by one byte. The global batch holds ``replicas x
        n_microbatches x micro_batch_size`` windows; replica r gets the r-th contiguous share.
        All pipeline ranks of one replica asking with the same arguments get the same batches.
        """
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} is outside 0..{replicas - 1}")
        tokens = self.splits[split]
        span = seq_len + 1
        if tokens.numel() < span:
            raise ValueError(f"the {split} split has {tokens.numel()} bytes, fewer than seq_len + 1 = {span}")
        gen = torch.Generator().manual_seed(_seed(self.seed, split, step))
        n = n_microbatches * micro_batch_size
        starts = torch.randint(0, tokens.numel() - span + 1, (replicas * n,), generator=gen)[replica * n : (replica + 1) * n]
        windows = tokens[starts[:, None] + torch.arange(span)].long()
        windows = windows.view(n_microbatches, micro_batch_size, span)
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]


def global_batch_size(config: Config) -> int:
    """Sequences per step over all replicas: what a step's data depends on (besides seed and step)."""
    p = config.parallel
    return p.dp * p.ep * config.schedule.microbatches * config.train.micro_batch_size


def replica_of(groups: object) -> tuple[int, int]:
    """(replica index, replica count) of a rank: its place among the dp x ep data replicas."""
    return groups.dp_rank * groups.ep + groups.ep_rank, groups.dp * groups.ep  # type: ignore[attr-defined]
