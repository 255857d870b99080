"""Byte-level text data: the shipped corpus, deterministic batches, splits, clear errors."""

from __future__ import annotations

import gzip

import pytest
import torch

from portapipe.config import load_config
from portapipe.data.batches import Batches
from portapipe.data.corpus import data_problems
from portapipe.data.shipped import DEFAULT_CORPUS


def _cfg(**sections):
    raw = {"model": {"seq_len": 32}, "data": {"val_fraction": 0.05}, "train": {"seed": 7}}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return load_config(raw)


def test_shipped_corpus_is_a_few_mb_of_english_text():
    raw = gzip.decompress(DEFAULT_CORPUS.read_bytes())
    assert DEFAULT_CORPUS.stat().st_size < 5 * 2**20
    assert len(raw) > 3 * 2**20
    text = raw.decode("ascii")
    assert "To be, or not to be" in text
    assert max(raw) < 128


def test_batches_are_shifted_windows_of_the_corpus():
    data = Batches(_cfg())
    mbs = data.microbatches(3, 0, 1, n_microbatches=3, micro_batch_size=2, seq_len=32)
    assert len(mbs) == 3
    train = bytes(data.tokens("train").tolist())
    for inputs, targets in mbs:
        assert inputs.shape == targets.shape == (2, 32)
        assert inputs.dtype == targets.dtype == torch.long
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for row_in, row_t in zip(inputs, targets):
            window = bytes(row_in.tolist()) + bytes([int(row_t[-1])])
            assert window in train


def test_batches_are_deterministic_and_differ_by_step_and_replica():
    a, b = Batches(_cfg()), Batches(_cfg())
    args = dict(n_microbatches=2, micro_batch_size=4, seq_len=32)
    first = a.microbatches(5, 1, 2, **args)
    again = b.microbatches(5, 1, 2, **args)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(first, again))
    for other in (a.microbatches(6, 1, 2, **args), a.microbatches(5, 0, 2, **args)):
        assert not torch.equal(first[0][0], other[0][0])
    reseeded = Batches(_cfg(train={"seed": 8})).microbatches(5, 1, 2, **args)
    assert not torch.equal(first[0][0], reseeded[0][0])
    with pytest.raises(ValueError, match="replica 2 is outside 0..1"):
        a.microbatches(5, 2, 2, **args)


def _global_batch(data: Batches, step: int, replicas: int, n_microbatches: int, micro_batch_size: int) -> torch.Tensor:
    rows = [x for r in range(replicas) for x, _ in data.microbatches(step, r, replicas, n_microbatches, micro_batch_size, 32)]
    return torch.cat(rows)


def test_a_steps_global_batch_is_the_same_sequences_whatever_the_split():
    """The same 16 windows whether 2 replicas x 4 micro-batches x 2, 4 x 2 x 2, 1 x 8 x 2 or 1 x 16 x 1:
    a run resumed on another layout with the same global batch sees the same data."""
    data = Batches(_cfg())
    ref = _global_batch(data, 3, 2, 4, 2)
    assert ref.shape == (16, 32)
    for split in ((4, 2, 2), (1, 8, 2), (1, 16, 1), (4, 4, 1)):
        assert torch.equal(_global_batch(data, 3, *split), ref), split
    assert not torch.equal(_global_batch(data, 4, 2, 4, 2), ref)


def test_global_batch_size_counts_every_replica():
    cfg = load_config({"parallel": {"pp": 2, "ep": 2, "dp": 3}, "schedule": {"microbatches": 4}, "train": {"micro_batch_size": 5},
                       "model": {"seq_len": 32}})
    from portapipe.data.batches import global_batch_size

    assert global_batch_size(cfg) == 2 * 3 * 4 * 5


def test_validation_split_is_the_disjoint_tail():
    data = Batches(_cfg(data={"val_fraction": 0.1}))
    n_train, n_val = data.n_tokens("train"), data.n_tokens("val")
    whole = gzip.decompress(DEFAULT_CORPUS.read_bytes())
    assert n_train + n_val == len(whole)
    assert n_val == int(len(whole) * 0.1)
    val = bytes(data.tokens("val").tolist())
    assert val == whole[n_train:]
    inputs, _ = data.microbatches(0, 0, 1, 1, 4, 32, split="val")[0]
    for row in inputs:
        assert bytes(row.tolist()) in val
    with pytest.raises(ValueError, match="split must be"):
        data.microbatches(0, 0, 1, 1, 1, 8, split="test")


@pytest.mark.parametrize("compress", [False, True])
def test_custom_corpus_plain_or_gzipped(tmp_path, compress):
    text = ("The quick brown fox jumps over the lazy dog. " * 40).encode()
    path = tmp_path / ("c.txt.gz" if compress else "c.txt")
    path.write_bytes(gzip.compress(text) if compress else text)
    data = Batches(_cfg(data={"path": str(path), "val_fraction": 0.5}))
    assert data.n_tokens("train") + data.n_tokens("val") == len(text)
    inputs, _ = data.microbatches(0, 0, 1, 1, 1, 32)[0]
    assert bytes(inputs[0].tolist()) in text


def test_problems_name_the_key_and_the_fix(tmp_path):
    missing = data_problems(_cfg(data={"path": str(tmp_path / "none.txt")}))
    assert len(missing) == 1 and missing[0].startswith("data.path:") and "does not exist" in missing[0]

    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 50)
    short = data_problems(_cfg(data={"path": str(small), "val_fraction": 0.5}))
    assert any(p.startswith("data.path:") and "train split" in p for p in short)
    assert any(p.startswith("data.val_fraction:") for p in short)

    high = tmp_path / "high.txt"
    high.write_bytes(bytes(range(256)) * 4)
    vocab = data_problems(_cfg(data={"path": str(high), "val_fraction": 0.0}, model={"vocab_size": 128}))
    assert vocab == [
        "model.vocab_size: 128 is too small for byte-level tokens of high.txt, which holds byte values up to 255 (use vocab_size >= 256, e.g. 256)"
    ]
    with pytest.raises(ValueError, match="model.vocab_size"):
        Batches(_cfg(data={"path": str(high), "val_fraction": 0.0}, model={"vocab_size": 128}))
    assert data_problems(_cfg()) == []
