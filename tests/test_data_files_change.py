"""A data file deleted, truncated, replaced or rewritten while a run reads it: the next batch stops
with one line naming the file, never a crash (a memory-mapped file cut short raises SIGBUS at the
read) and never a batch of other tokens."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from portapipe.config import load_config
from portapipe.data.batches import Batches
from portapipe.data.sources import DataReadError

TOKENS = 100_000  # 50 pages of uint16: a cut file leaves most windows past its end


def write_flat(path: Path, seed: int = 0) -> Path:
    np.random.default_rng(seed).integers(0, 500, TOKENS).astype("<u2").tofile(path)
    return path


def write_megatron(prefix: Path, seed: int = 0) -> Path:
    """A Megatron-Core indexed dataset (uint16), one sequence per document, as its builder lays it out."""
    lengths = np.random.default_rng(seed).integers(50, 150, TOKENS // 100).astype("<i4")
    np.random.default_rng(seed).integers(0, 500, int(lengths.sum())).astype("<u2").tofile(f"{prefix}.bin")
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64)) * 2)).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(lengths) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype="<i8").tobytes())
    return prefix


def write_folder(folder: Path) -> Path:
    folder.mkdir()
    tokens = np.random.default_rng(0).integers(1, 500, TOKENS).astype("<u2")
    tokens.tofile(folder / "tokens.bin")
    np.arange(0, TOKENS + 1, 100, dtype="<i8").tofile(folder / "documents.bin")
    (folder / "dataset.json").write_text(json.dumps({"format": "portapipe.dataset", "version": 1, "dtype": "uint16", "vocab_size": 512,
                                                    "eos_id": 0, "documents": TOKENS // 100, "tokens": TOKENS, "max_id": int(tokens.max())}))
    return folder


def config(path: Path, **data: object):  # type: ignore[no-untyped-def]
    return load_config({"model": {"vocab_size": 512, "seq_len": 64}, "train": {"micro_batch_size": 8},
                        "data": {"format": "tokens", "path": str(path), "val_fraction": 0.0, **data}})


# The cases in a process of their own, the next batches read after each change: a SIGBUS ends
# that process, not the test run, and shows as its exit status after the cases it got through.
_CASES = r"""
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.test_data_files_change import config, write_flat, write_folder, write_megatron
from portapipe.data.batches import Batches

root = Path(sys.argv[2])
for kind in ("flat", "megatron", "folder"):
    for change in ("truncated", "deleted", "replaced", "rewritten"):
        tmp = root / kind / change
        tmp.mkdir(parents=True)
        if kind == "flat":
            path = write_flat(tmp / "train.bin"); file = path; cfg = config(path, token_dtype="uint16")
        elif kind == "megatron":
            path = write_megatron(tmp / "web_text_document"); file = Path(f"{path}.bin"); cfg = config(path)
        else:
            path = write_folder(tmp / "set"); file = path / "tokens.bin"; cfg = config(path, document_mask=True)
        data = Batches(cfg)
        data.microbatches(0, 0, 1, 1, 8, 64)
        if change == "truncated":
            os.truncate(file, 100)
        elif change == "deleted":
            os.remove(file)
        elif change == "replaced":
            other = tmp / "other"
            other.write_bytes(file.read_bytes()[::-1])
            os.replace(other, file)
        else:  # rewritten in place, the same size (the clock moved on: a coarse one may not have)
            size = file.stat().st_size
            with open(file, "r+b") as f:
                f.write(b"\x07" * size)
            os.utime(file, ns=(0, file.stat().st_mtime_ns + 1_000_000))
        try:
            for step in range(1, 20):
                data.microbatches(step, 0, 1, 1, 8, 64)
                data.kept_per_microbatch(step, 1, 1, 8, 64)
            print(kind, change, "READ", flush=True)
        except ValueError as exc:
            print(kind, change, type(exc).__name__, exc, flush=True)
"""

ROOT = Path(__file__).resolve().parents[1]


def test_a_file_changed_under_a_run_stops_the_next_batch_in_one_line(tmp_path: Path) -> None:
    """A flat file, a Megatron .bin and a dataset folder's tokens, each truncated, deleted,
    replaced and rewritten in place: one line naming the file, the change and its sizes."""
    done = subprocess.run([sys.executable, "-c", _CASES, str(ROOT), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])  # -7: SIGBUS
    said = {tuple(line.split()[:2]): line.split(maxsplit=2)[2] for line in done.stdout.splitlines()}
    stops = ("after the run opened it; the run stops rather than read other data than it started with (put the file back as it "
             "was, or start a new run)")
    size = TOKENS * 2
    for kind, file in (("flat", "train.bin"), ("megatron", "web_text_document.bin"), ("folder", "set/tokens.bin")):
        for change in ("truncated", "deleted", "replaced", "rewritten"):
            line = said[kind, change]
            assert line.startswith(f"DataReadError data.path: {tmp_path / kind / change / file} was {change} ") and line.endswith(stops), line
        if kind != "megatron":
            assert f"was truncated ({size:,} -> 100 bytes)" in said[kind, "truncated"]
            assert f"was rewritten ({size:,} -> {size:,} bytes, modified since)" in said[kind, "rewritten"]


def test_a_file_rewritten_while_a_batch_is_read_stops_that_batch(tmp_path: Path) -> None:
    """The check after the read: a rewrite during it would have given other tokens."""
    path = write_flat(tmp_path / "train.bin")
    data = Batches(config(path, token_dtype="uint16"))
    source = data.corpus.train[0].source
    real = source.tokens

    class Rewritten:
        def __array__(self, dtype=None, copy=None):  # type: ignore[no-untyped-def]
            with open(path, "r+b") as f:
                f.write(b"\x07\x00" * 10)
            os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
            return np.asarray(real)

    source.tokens = Rewritten()  # type: ignore[assignment]
    with pytest.raises(DataReadError, match=rf"^data.path: {path} was rewritten \(200,000 -> 200,000 bytes, modified since\) after"):
        data.microbatches(0, 0, 1, 1, 8, 64)
    source.tokens = real


def test_a_touched_file_stops_the_run_and_a_new_run_reads_it(tmp_path: Path) -> None:
    path = write_flat(tmp_path / "train.bin")
    data = Batches(config(path, token_dtype="uint16"))
    os.utime(path)  # touched, not changed in size: its modification time alone says it was rewritten
    with pytest.raises(DataReadError, match="was rewritten"):
        data.microbatches(0, 0, 1, 1, 8, 64)
    again = Batches(config(path, token_dtype="uint16"))  # a run that opens it now reads it
    assert again.microbatches(0, 0, 1, 1, 8, 64)[0][0].shape == (8, 64)
