"""Each step's batch, a pure function of (seed, sources, global batch size, step).

A step's *global batch* is ``B`` samples (windows of ``seq_len + 1`` tokens); the ``dp x ep``
replicas share them out in order (replica r, micro-batch m takes the next ``micro_batch_size``).
So the data of a step depends on the global batch size but not on how it is split: any rank
makes any step's batch on its own, from the memory-mapped sources, with nothing to send, save or
restore; a run resumed on another layout with the same global batch sees exactly the samples of
an uninterrupted one.

Two ways to choose the samples (``data.sampling``):

- ``epochs`` (the default for token data): sample s of the run (step t holds ``t x B ..
  t x B + B - 1``) comes from the source :class:`~.blend.Blend` assigns it, as that source's k-th
  sample, which is window ``k mod n`` of its epoch ``k // n`` in that epoch's seeded order
  (:mod:`.epochs`). Within an epoch no window repeats; how far each source is through its data
  after a step is ``k / n`` (:meth:`Batches.consumed`).
- ``random`` (the default for a text read as bytes): window starts drawn uniformly from a
  generator seeded by (seed, split, step), with replacement, from one source.

Validation data (``split="val"``) is drawn the same way from one validation part at a time, so
its loss can be reported per source.

Each source's files are checked against what they were when opened before and after each read
(:meth:`~.sources.Source.check`): a file deleted, truncated, replaced or rewritten during the run
stops it with one line naming the file, never a batch of other tokens.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import numpy as np
import torch

from .blend import Blend
from .corpus import Corpus, Part, checked_corpus
from .epochs import samples_in, window_starts
from .samples import MicroBatch, kept_targets, make_microbatches
from .sources import Source

Split = Literal["train", "val"]


def _seed(*parts: object) -> int:
    """A 63-bit torch generator seed from the parts; stable across processes and Python versions."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def global_batch_size(config: Any) -> int:
    """Sequences per step over all replicas: what a step's data depends on (besides seed and step)."""
    p = config.parallel
    return p.dp * p.ep * config.schedule.microbatches * config.train.micro_batch_size


def replica_of(groups: Any) -> tuple[int, int]:
    """(replica index, replica count) of a rank: its place among the dp x ep data replicas."""
    return groups.dp_rank * groups.ep + groups.ep_rank, groups.dp * groups.ep


def source_names(parts: list[Part]) -> list[str]:
    """The names the metrics give the parts' sources: their file or folder names, made unique."""
    names: list[str] = []
    for part in parts:
        name = part.source.name
        names.append(name if name not in names else f"{name}#{len(names)}")
    return names


def _offsets(part: Part, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """``[n, seq_len + 1]``: the source offsets of the tokens of windows starting at ``starts`` in ``part``."""
    return (part.lo + starts)[:, None] + np.arange(seq_len + 1, dtype=np.int64)


class Batches:
    """The configured data as batches (see the module docstring)."""

    def __init__(self, config: Any, corpus: Corpus | None = None) -> None:
        """``corpus``: the configured data already opened; else it is opened and checked
        (:func:`~.corpus.data_problems`, without a scan of flat files' ids: the launch did that)."""
        if corpus is None:
            corpus, problems = checked_corpus(config, check_ids=False)
            if problems:
                raise ValueError("; ".join(problems))
        assert corpus is not None
        self.corpus = corpus
        d = config.data
        self.seed, self.seq_len = config.train.seed, config.model.seq_len
        self.vocab_size = config.model.vocab_size
        self.global_batch = global_batch_size(config)
        self.document_mask, self.mask_eos_loss = d.document_mask, d.mask_eos_loss
        self.sampling = self.corpus.sampling
        self.blend = Blend([p.weight for p in self.corpus.train])
        self.names = {"train": source_names(self.corpus.train), "val": source_names(self.corpus.val)}

    # ----------------------------------------------------------------------- sizes
    def parts(self, split: Split) -> list[Part]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.corpus.train if split == "train" else self.corpus.val

    def tokens(self, split: Split = "train", source: int = 0) -> np.ndarray:
        """The tokens of one part of ``split`` (memory-mapped)."""
        part = self.parts(split)[source]
        return part.source.tokens[part.lo : part.hi]

    def n_tokens(self, split: Split = "train") -> int:
        return sum(p.tokens for p in self.parts(split))

    def n_samples(self, split: Split = "train", seq_len: int | None = None) -> list[int]:
        """Samples in each part of ``split`` (one epoch of each)."""
        return [samples_in(p.tokens, seq_len or self.seq_len) for p in self.parts(split)]

    def consumed(self, steps: int) -> dict[str, Any]:
        """After ``steps`` steps: ``tokens`` trained on (inputs) and each source's ``epochs``, the
        samples it gave over one epoch's (2.5 = half-way through its third epoch)."""
        samples = steps * self.global_batch
        if self.sampling == "random":
            taken = np.array([samples])
        else:
            taken = self.blend.taken(samples)
        epochs = {name: float(t) / n for name, t, n in zip(self.names["train"], taken, self.n_samples("train"))}
        return {"tokens": samples * self.seq_len, "epochs": epochs}

    # --------------------------------------------------------------------- batches
    def microbatches(
        self,
        step: int,
        replica: int,
        replicas: int,
        n_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        split: Split = "train",
        source: int = 0,
    ) -> list[MicroBatch]:
        """Replica ``replica`` of ``replicas``'s share of step ``step``'s global batch.

        ``n_microbatches`` micro-batches ``(inputs, targets)`` (LongTensor[micro_batch_size,
        seq_len]; the targets are the inputs shifted by one), with each input token's position in
        its document third under ``data.document_mask`` (:mod:`.samples`). The global batch holds
        ``replicas x n_microbatches x micro_batch_size`` samples; replica r gets the r-th
        contiguous share. ``split="val"`` draws from validation part ``source`` alone.
        """
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} is outside 0..{replicas - 1}")
        n = n_microbatches * micro_batch_size
        parts = self.parts(split)
        which, starts = self._chosen(step, np.arange(replica * n, (replica + 1) * n, dtype=np.int64), replicas * n, seq_len, split, source)
        windows, flags = self._windows(parts, which, starts, seq_len)
        return make_microbatches(windows, flags, n_microbatches, self.document_mask, self.mask_eos_loss)

    def kept_per_microbatch(
        self, step: int, replicas: int, n_microbatches: int, micro_batch_size: int, seq_len: int, split: Split = "train", source: int = 0
    ) -> float | None:
        """Under ``data.mask_eos_loss``: the targets the loss keeps in step ``step``'s global batch
        (every replica's share), over its ``replicas x n_microbatches`` micro-batches, which each
        micro-batch's summed loss is divided by (:mod:`.samples`); None without the option. Read
        from the document index alone, the tokens untouched."""
        if not self.mask_eos_loss:
            return None
        total = replicas * n_microbatches * micro_batch_size
        parts = self.parts(split)
        which, starts = self._chosen(step, np.arange(total, dtype=np.int64), total, seq_len, split, source)
        kept = 0
        for d in np.unique(which):
            at = which == d
            offsets = _offsets(parts[d], starts[at], seq_len)
            parts[d].source.check()  # a mapped file cut short would end the process at the read (SIGBUS)
            kept += kept_targets(parts[d].source.document_start(offsets) == offsets)
        return kept / (replicas * n_microbatches)

    def _chosen(self, step: int, mine: np.ndarray, total: int, seq_len: int, split: Split, source: int) -> tuple[np.ndarray, np.ndarray]:
        """(the part, the window start) of samples ``mine`` of step ``step``'s ``total``."""
        parts = self.parts(split)
        n = len(mine)
        if split == "val":
            if not 0 <= source < len(parts):
                raise ValueError(f"validation source {source} is outside 0..{len(parts) - 1}")
            which = np.full(n, source, dtype=np.int64)
            starts = self._starts(parts[source], step * total + mine, step, total, seq_len, ("val", source), mine)
        elif self.sampling == "random":
            which = np.zeros(n, dtype=np.int64)
            starts = self._starts(parts[0], None, step, total, seq_len, ("train", 0), mine)
        else:
            which, k = self.blend.assign(step * total + mine)
            starts = np.empty(n, dtype=np.int64)
            for d in np.unique(which):
                at = which == d
                starts[at] = self._starts(parts[d], k[at], step, total, seq_len, ("train", int(d)), mine)
        return which, starts

    def _starts(self, part: Part, k: np.ndarray | None, step: int, total: int, seq_len: int, tag: tuple[str, int],
                mine: np.ndarray) -> np.ndarray:
        """Window starts (within ``part``) of a source's samples ``k`` (epochs), or of this
        replica's samples ``mine`` of the step's ``total`` (random)."""
        span = seq_len + 1
        if part.tokens < span:
            raise ValueError(f"the {tag[0]} part of {part.source.name} has {part.tokens} tokens, fewer than seq_len + 1 = {span}")
        if self.sampling == "random":
            split = "train" if tag[0] == "train" else "val"
            gen = torch.Generator().manual_seed(_seed(self.seed, split, step) if tag[1] == 0 else _seed(self.seed, split, step, tag[1]))
            drawn = torch.randint(0, part.tokens - span + 1, (total,), generator=gen).numpy()
            return drawn[mine]
        assert k is not None
        label = tag[1] if tag[0] == "train" else f"val{tag[1]}"
        return window_starts(k, samples_in(part.tokens, seq_len), seq_len, self.seed, label)

    def _windows(self, parts: list[Part], which: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Each sample's tokens (int64) and, where documents matter, which of them start a document."""
        span = seq_len + 1
        windows = np.empty((len(starts), span), dtype=np.int64)
        flags = np.zeros((len(starts), span), dtype=bool) if (self.document_mask or self.mask_eos_loss) else None
        for d in np.unique(which):
            at = which == d
            part = parts[d]
            offsets = _offsets(part, starts[at], seq_len)
            part.source.check()  # before: a mapped file cut short would end the process at the read (SIGBUS)
            windows[at] = np.asarray(part.source.tokens)[offsets]  # a plain view: memmap's indexing costs more
            if flags is not None:
                flags[at] = part.source.document_start(offsets) == offsets
            part.source.check()  # after: a file rewritten while it was read gave other tokens
            self._check_ids(part.source, windows[at], offsets)
        return windows, flags

    def _check_ids(self, source: Source, windows: np.ndarray, offsets: np.ndarray) -> None:
        """Ids a model cannot embed stop the run with their place (a Megatron dataset records no
        vocabulary, so its ids are checked here, a batch at a time)."""
        bad = (windows >= self.vocab_size) | (windows < 0)
        if bad.any():
            i = np.flatnonzero(bad.reshape(-1))[0]
            raise ValueError(f"{source.key}: {source.name} holds token id {int(windows.reshape(-1)[i])} at token "
                             f"{int(offsets.reshape(-1)[i])}, past model.vocab_size {self.vocab_size}")
