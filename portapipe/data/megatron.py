"""Megatron-Core's indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``), read as they are.

The index that ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` writes
("MMIDIDX"): the 9-byte header ``MMIDIDX\\0\\0``, version 1 (uint64), the token dtype's code
(uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence
count S and the document-index length D (uint64 each), then S sequence lengths (int32), S
sequence pointers (int64, byte offsets into the ``.bin``) and D document indices (int64: the
first sequence of each document, then S), optionally S sequence modes (int8, multimodal). A
document is one or more consecutive sequences; ``PREFIX.bin`` holds the tokens.

Everything stays memory-mapped: the start of the document holding a token is found by two
binary searches (pointers, then document indices), so no per-document array is built and the
memory used does not grow with the corpus. Only sequences laid back to back in the ``.bin`` (as
every builder writes them, merged datasets included) are read: anything else is refused.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from .flat import mapped

HEADER = b"MMIDIDX\x00\x00"
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence count, document count
DTYPE_CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
_CHUNK = 1 << 20  # index entries per step when checking the pointers (a few MB at a time)


def prefix_of(path: Path) -> Path | None:
    """The prefix of the Megatron dataset ``path`` names (the prefix itself, or its ``.bin`` /
    ``.idx``): where both files are, whatever the index holds (a damaged one is then said so,
    never read as something else); None when ``path`` names none."""
    for prefix in (path, path.with_suffix("") if path.suffix in (".bin", ".idx") else None):
        if prefix is not None and Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file():
            return prefix
    return None


class MegatronDataset:
    """One Megatron indexed dataset: its tokens and its documents, memory-mapped."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.idx_path, self.bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        with open(self.idx_path, "rb") as f:
            head = f.read(_FIXED)
        if head[: len(HEADER)] != HEADER:
            raise ValueError(f"{self.idx_path}: its header is damaged or it is no Megatron index: it starts with {head[: len(HEADER)]!r}, "
                             f"a Megatron index with {HEADER!r}")
        if len(head) < _FIXED:
            raise ValueError(f"{self.idx_path}: its header is cut short: {len(head)} bytes, a Megatron index's header has {_FIXED}")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(HEADER) :])
        if version != 1:
            raise ValueError(f"{self.idx_path} has index version {version}; only version 1 is known")
        if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).kind == "f":
            raise ValueError(f"{self.idx_path}: token dtype code {code} is not an integer type Megatron writes")
        self.dtype = np.dtype(DTYPE_CODES[code])
        size = self.idx_path.stat().st_size
        plain = _FIXED + 12 * n_seq + 8 * n_doc
        if size not in (plain, plain + n_seq):
            raise ValueError(f"{self.idx_path} has {size} bytes, not the {plain} its counts ({n_seq} sequences, {n_doc - 1} documents) need")
        self.lengths = mapped(self.idx_path, "<i4", _FIXED)[:n_seq]
        self.pointers = mapped(self.idx_path, "<i8", _FIXED + 4 * n_seq)[:n_seq]
        self.doc_index = mapped(self.idx_path, "<i8", _FIXED + 12 * n_seq)[:n_doc]
        if n_doc < 2 or int(self.doc_index[0]) != 0 or int(self.doc_index[-1]) != n_seq:
            raise ValueError(f"{self.idx_path}: its document index does not run over the {n_seq} sequences")
        width = self.dtype.itemsize
        total = 0 if n_seq == 0 else int(self.pointers[-1]) + int(self.lengths[-1]) * width
        if self.bin_path.stat().st_size != total:
            raise ValueError(f"{self.bin_path} has {self.bin_path.stat().st_size} bytes, but {self.idx_path.name} indexes {total}")
        self._check_back_to_back(width)
        self.tokens = mapped(self.bin_path, self.dtype)
        self.documents = n_doc - 1

    def _check_back_to_back(self, width: int) -> None:
        expected = 0
        for i in range(0, len(self.lengths), _CHUNK):
            lengths = np.asarray(self.lengths[i : i + _CHUNK], dtype=np.int64)
            pointers = np.asarray(self.pointers[i : i + _CHUNK])
            want = expected + np.concatenate(([0], np.cumsum(lengths[:-1]) * width))
            if not np.array_equal(pointers, want):
                raise ValueError(f"{self.idx_path}: its sequences are not laid back to back in {self.bin_path.name}; only such datasets are read")
            expected = int(want[-1]) + int(lengths[-1]) * width

    def document_start(self, token: np.ndarray) -> np.ndarray:
        """The offset (in tokens) where the document holding each of ``token`` starts."""
        width = self.dtype.itemsize
        seq = np.searchsorted(self.pointers, token.astype(np.int64) * width, side="right") - 1
        doc = np.searchsorted(self.doc_index, seq, side="right") - 1
        return self.pointers[self.doc_index[doc]] // width

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens (its sequences one after the other)."""
        width = self.dtype.itemsize
        first, end = int(self.doc_index[i]), int(self.doc_index[i + 1])
        lo = int(self.pointers[first]) // width
        hi = int(self.pointers[end - 1]) // width + int(self.lengths[end - 1])
        return self.tokens[lo:hi]
