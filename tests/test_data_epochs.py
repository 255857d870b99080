"""Blends, epochs without replacement, and a step's batch as a pure function of the step, on
dataset folders written here (the format read by an implementation of its own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from portapipe.config import load_config
from portapipe.data.batches import Batches
from portapipe.data.blend import PERIOD, Blend
from portapipe.data.corpus import data_problems
from portapipe.data.epochs import permute, samples_in
from portapipe.data.samples import IGNORE

EOS = 3


def write_dataset(folder: Path, docs: list[list[int]], vocab: int = 100) -> Path:
    """A dataset folder as portapipe tokenize lays it out (each document already ending in its EOS)."""
    folder.mkdir(parents=True)
    flat = np.array([t for d in docs for t in d], dtype="<u2")
    flat.tofile(folder / "tokens.bin")
    np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype("<i8").tofile(folder / "documents.bin")
    (folder / "dataset.json").write_text(json.dumps({"format": "portapipe.dataset", "version": 1, "dtype": "uint16", "vocab_size": vocab,
                                                    "eos_id": EOS, "documents": len(docs), "tokens": len(flat), "max_id": int(flat.max())}))
    return folder


def random_docs(seed: int, n: int, vocab: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, vocab, rng.integers(1, 30))] + [EOS] for _ in range(n)]


def config(**data: Any) -> Any:
    raw = {"parallel": {"pp": 1, "ep": 1, "dp": 2}, "schedule": {"name": "1f1b", "microbatches": 2}, "train": {"micro_batch_size": 2, "seed": 5},
           "model": {"vocab_size": 100, "seq_len": 8}, "data": {"format": "tokens", **data}}
    return load_config(raw)


def global_batch(data: Batches, step: int, replicas: int, mbs: int, size: int, at: int = 0) -> torch.Tensor:
    return torch.cat([mb[at] for r in range(replicas) for mb in data.microbatches(step, r, replicas, mbs, size, 8)])


# -------------------------------------------------------------------------------- epochs
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_each_epoch_order_is_a_permutation_of_its_own(n: int) -> None:
    a, b = permute(np.arange(n), n, 1), permute(np.arange(n), n, 2)
    assert sorted(a.tolist()) == list(range(n)) and sorted(b.tolist()) == list(range(n))
    assert np.array_equal(permute(np.arange(n), n, 1), a)  # a function of the key alone
    if n > 3:
        assert not np.array_equal(a, b)
    assert np.array_equal(permute(np.arange(n)[::-1].copy(), n, 1), a[::-1])  # element by element


def test_every_window_once_per_epoch_then_a_new_order(tmp_path: Path) -> None:
    docs = random_docs(0, 40)
    path = write_dataset(tmp_path / "d", docs)
    data = Batches(config(path=str(path), val_fraction=0))
    flat = np.concatenate([np.array(d) for d in docs])
    n = samples_in(len(flat), 8)
    assert n == (len(flat) - 1) // 8 and data.n_samples() == [n]
    seen = []
    for step in range(3 * n // 8 + 1):
        seen += [row.tolist() for row in global_batch(data, step, 2, 2, 2)]
        # windows of seq_len + 1 laid end to end: the window at 8 i holds tokens 8 i .. 8 i + 8
    inputs = [tuple(r) for r in seen]
    windows = {tuple(flat[8 * i : 8 * i + 8].tolist()): i for i in range(n)}
    order = [windows[w] for w in inputs]
    for e in range(3):
        assert sorted(order[e * n : (e + 1) * n]) == list(range(n)), e
    assert order[:n] != order[n : 2 * n]
    assert data.consumed(5)["epochs"] == {"d": 5 * 8 / n} and data.consumed(5)["tokens"] == 5 * 8 * 8


# --------------------------------------------------------------------------------- blends
def test_blend_shares_stay_within_one_percent_over_any_thousand_steps() -> None:
    blend = Blend([0.5, 0.3, 0.2])
    gb = 8
    for first in (0, 37, 9_999, 123_457, 10**7):
        source, _ = blend.assign(np.arange(first * gb, (first + 1000) * gb))
        shares = np.bincount(source, minlength=3) / (1000 * gb)
        assert np.abs(shares - [0.5, 0.3, 0.2]).max() <= 0.01, (first, shares)
    # a source's samples are numbered 0, 1, 2, ... in the order the run takes them
    source, k = blend.assign(np.arange(3 * PERIOD + 17))
    for d in range(3):
        assert k[source == d].tolist() == list(range(int((source == d).sum())))
    assert blend.taken(3 * PERIOD + 17).tolist() == np.bincount(source, minlength=3).tolist()
    assert Blend([2, 2]).weights.tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="positive"):
        Blend([1, 0])


def test_a_blend_draws_each_source_by_its_weight_and_counts_its_epochs(tmp_path: Path) -> None:
    a = write_dataset(tmp_path / "a", random_docs(1, 60, vocab=80))
    b = write_dataset(tmp_path / "b", [[90 + (i % 5)] * 12 + [EOS] for i in range(40)])  # ids 90..94: tell b's samples apart
    data = Batches(config(sources=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}], val_fraction=0))
    rows = torch.cat([global_batch(data, s, 2, 2, 2) for s in range(100)])
    from_b = (rows >= 90).any(1)
    assert abs(float(from_b.float().mean()) - 0.25) < 0.01
    epochs = data.consumed(100)["epochs"]
    assert epochs == {"a": 600 / data.n_samples()[0], "b": 200 / data.n_samples()[1]}


# ------------------------------------------------------------------------ pure function of the step
def test_a_steps_samples_are_the_same_whatever_the_layout(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "d", random_docs(2, 80))
    data = Batches(config(path=str(path), document_mask=True, mask_eos_loss=True))
    for at in (0, 1, 2):
        ref = global_batch(data, 7, 2, 2, 2, at)
        for replicas, mbs, size in ((1, 8, 1), (4, 1, 2), (1, 2, 4)):
            assert torch.equal(global_batch(data, 7, replicas, mbs, size, at), ref)
        assert not torch.equal(global_batch(data, 8, 2, 2, 2, at), ref)
    again = Batches(config(path=str(path), document_mask=True, mask_eos_loss=True))
    assert torch.equal(global_batch(again, 7, 2, 2, 2), global_batch(data, 7, 2, 2, 2))


def test_the_documents_of_each_sample_as_megatrons_eod_rules_find_them(tmp_path: Path) -> None:
    """Every document ends in its EOS, so Megatron's rules, read from the tokens, give the same:
    a position restarts after each EOS, and the loss leaves out the targets after an EOS."""
    path = write_dataset(tmp_path / "d", random_docs(3, 80))
    data = Batches(config(path=str(path), document_mask=True, mask_eos_loss=True, val_fraction=0))
    for step in range(6):
        for inputs, targets, pos in data.microbatches(step, 0, 1, 2, 4, 8):
            for x, y, p in zip(inputs.tolist(), targets.tolist(), pos.tolist()):
                want_p, at = [], 0
                for i, t in enumerate(x):
                    want_p.append(at)
                    at = 0 if t == EOS else at + 1
                assert p == want_p
                assert [t == IGNORE for t in y] == [t == EOS for t in x]


def test_the_kept_targets_are_counted_over_the_whole_global_batch_from_the_index(tmp_path: Path) -> None:
    """data.mask_eos_loss divides each micro-batch's loss by the step's kept targets per
    micro-batch: every replica's targets that are not IGNORE, over all micro-batches, the same
    whatever the layout; a blend, the random sampling and a validation source alike."""
    a, b = write_dataset(tmp_path / "a", random_docs(6, 80)), write_dataset(tmp_path / "b", random_docs(7, 50))
    blend = Batches(config(sources=[{"path": str(a), "weight": 2}, {"path": str(b), "weight": 1}], mask_eos_loss=True))
    random = Batches(config(path=str(a), sampling="random", mask_eos_loss=True))
    for data, split in ((blend, "train"), (blend, "val"), (random, "train")):
        for step in range(4):
            for replicas, mbs, size in ((2, 2, 2), (1, 8, 1), (4, 1, 2)):
                targets = torch.cat([mb[1] for r in range(replicas) for mb in data.microbatches(step, r, replicas, mbs, size, 8, split=split, source=1)])
                kept = data.kept_per_microbatch(step, replicas, mbs, size, 8, split=split, source=1)
                assert kept == int((targets != IGNORE).sum()) / (replicas * mbs) and int((targets == IGNORE).sum()) > 0, (split, step)
    assert Batches(config(path=str(a))).kept_per_microbatch(0, 2, 2, 2, 8) is None  # every target counts: each micro-batch's mean


def test_validation_sources_are_read_one_at_a_time(tmp_path: Path) -> None:
    a = write_dataset(tmp_path / "a", random_docs(4, 30))
    v1 = write_dataset(tmp_path / "v1", [[50] * 20 + [EOS]] * 5)
    v2 = write_dataset(tmp_path / "v2", [[60] * 20 + [EOS]] * 5)
    data = Batches(config(path=str(a), val_sources=[{"path": str(v1)}, {"path": str(v2), "weight": 3}]))
    assert data.names["val"] == ["v1", "v2"] and data.n_tokens("train") == len(data.corpus.train[0].source.tokens)  # no part held out
    for source, token in ((0, 50), (1, 60)):
        x, _ = data.microbatches(0, 0, 1, 1, 2, 8, split="val", source=source)[0]
        assert set(x.flatten().tolist()) <= {token, EOS}


def test_sources_that_cannot_serve_are_refused_one_line_each(tmp_path: Path) -> None:
    good = write_dataset(tmp_path / "good", random_docs(5, 20))
    flat = tmp_path / "flat.bin"
    np.arange(500, dtype="<u2").__mod__(90).tofile(flat)
    assert data_problems(config(sources=[{"path": str(good)}, {"path": str(tmp_path / "none")}])) == [
        f"data.sources[1].path: '{tmp_path / 'none'}' does not exist; name a dataset folder (portapipe tokenize), a Megatron prefix "
        "(PREFIX.bin + PREFIX.idx) or a token file"]
    assert data_problems(config(sources=[{"path": str(good)}, {"path": str(flat)}], token_dtype="uint16", document_mask=True)) == [
        "data.sources[1].path: flat.bin is a flat source without document boundaries; data.document_mask needs a dataset folder "
        "(portapipe tokenize) or a Megatron dataset"]
    (tmp_path / "empty").mkdir()
    assert data_problems(config(path=str(tmp_path / "empty"))) == [
        f"data.path: {tmp_path / 'empty'} is a folder without dataset.json: not a dataset portapipe tokenize wrote"]
    (good / "tokens.bin").write_bytes((good / "tokens.bin").read_bytes()[:-2])  # cut short: another write's files
    (line,) = data_problems(config(path=str(good)))
    assert line.startswith(f"data.path: {good / 'tokens.bin'} has ") and "files are from different writes" in line
