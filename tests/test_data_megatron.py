"""Megatron-Core's indexed datasets, written by megatron-core itself, read as they are: the same
documents token for token, for each token dtype its builder writes."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from portapipe.config import load_config
from portapipe.data.batches import Batches
from portapipe.data.corpus import data_problems
from portapipe.data.megatron import MegatronDataset


def _indexed_dataset():  # type: ignore[no-untyped-def]
    """megatron-core's module, its complaints about Transformer Engine / Apex silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return pytest.importorskip("megatron.core.datasets.indexed_dataset")
        finally:
            logging.disable(logging.NOTSET)


def _build(prefix: Path, dtype: type, docs: list[list[list[int]]]) -> None:
    """Each document given as its sequences (several make one document, as --split-sentences writes)."""
    mod = _indexed_dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its numpy 2 __array__ notice
        builder = mod.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
        for doc in docs:
            builder.add_document(torch.tensor([t for seq in doc for t in seq]), [len(seq) for seq in doc])
        builder.finalize(f"{prefix}.idx")


def _docs(seed: int, n: int, top: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, top, rng.integers(1, 20)).tolist() for _ in range(rng.integers(1, 4))] for _ in range(n)]


@pytest.mark.parametrize("dtype, top", [(np.uint16, 60_000), (np.int32, 100_000), (np.int64, 1 << 40), (np.uint8, 250)])
def test_the_documents_are_megatrons_token_for_token(tmp_path: Path, dtype: type, top: int) -> None:
    docs = _docs(7, 50, top)
    prefix = tmp_path / "corpus_text_document"
    _build(prefix, dtype, docs)
    ours = MegatronDataset(prefix)
    theirs = _indexed_dataset().IndexedDataset(str(prefix))
    assert ours.documents == len(theirs.document_indices) - 1 == len(docs)
    for i in range(len(docs)):
        first, end = theirs.document_indices[i], theirs.document_indices[i + 1]
        want = np.concatenate([theirs[j] for j in range(first, end)])
        assert ours.document(i).tolist() == want.tolist() == [t for seq in docs[i] for t in seq]
    starts = np.concatenate(([0], np.cumsum([sum(map(len, d)) for d in docs])[:-1]))
    every = np.arange(int(starts[-1]) + 1)
    assert ours.document_start(every).tolist() == starts[np.searchsorted(starts, every, side="right") - 1].tolist()


def test_training_reads_the_prefix_its_files_and_checks_the_ids_batch_by_batch(tmp_path: Path) -> None:
    docs = _docs(8, 80, 500)
    prefix = tmp_path / "web_text_document"
    _build(prefix, np.uint16, docs)
    raw = {"model": {"vocab_size": 512, "seq_len": 8}, "train": {"micro_batch_size": 2},
           "data": {"format": "tokens", "path": str(prefix), "document_mask": True}}
    for path in (prefix, Path(f"{prefix}.bin"), Path(f"{prefix}.idx")):
        cfg = load_config({**raw, "data": {**raw["data"], "path": str(path)}})
        assert data_problems(cfg) == []
        source = Batches(cfg).corpus.train[0].source
        assert source.kind == "megatron" and source.path == prefix and source.documents == len(docs)
    inputs, targets, pos = Batches(load_config(raw)).microbatches(0, 0, 1, 1, 2, 8)[0]
    assert inputs.shape == targets.shape == pos.shape == (2, 8)
    small = load_config({**raw, "model": {"vocab_size": 100, "seq_len": 8}})
    with pytest.raises(ValueError, match=r"data.path: web_text_document holds token id \d+ at token \d+, past model.vocab_size 100"):
        for step in range(20):
            Batches(small).microbatches(step, 0, 1, 1, 2, 8)
    assert data_problems(load_config({**raw, "data": {**raw["data"], "token_dtype": "uint32"}})) == [
        f"data.token_dtype: uint32 has no effect on the Megatron dataset {prefix} (its index says uint16); remove it"]
    Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:-2])
    assert data_problems(load_config(raw))[0].startswith(f"data.path: {prefix}.bin has ")


def test_a_damaged_index_header_is_said_so_whichever_name_is_given(tmp_path: Path) -> None:
    """A prefix whose .idx header is damaged says what was read and what a Megatron index holds,
    named by its prefix, its .bin (never read as a flat token file) or its .idx; a header cut short
    says how short."""
    prefix = tmp_path / "web_text_document"
    _build(prefix, np.uint16, _docs(9, 10, 500))
    idx = Path(f"{prefix}.idx")
    whole = idx.read_bytes()
    idx.write_bytes(b"MMIDIDY\x00\x00" + whole[9:])
    raw = {"model": {"vocab_size": 512, "seq_len": 8}, "data": {"format": "tokens"}}
    want = (f"data.path: {idx}: its header is damaged or it is no Megatron index: it starts with b'MMIDIDY\\x00\\x00', "
            "a Megatron index with b'MMIDIDX\\x00\\x00'")
    for path, extra in ((prefix, {}), (Path(f"{prefix}.bin"), {"token_dtype": "uint16"}), (idx, {})):
        assert data_problems(load_config({**raw, "data": {**raw["data"], "path": str(path), **extra}})) == [want], path
    idx.write_bytes(whole[:20])
    assert data_problems(load_config({**raw, "data": {**raw["data"], "path": str(prefix)}})) == [
        f"data.path: {idx}: its header is cut short: 20 bytes, a Megatron index's header has 34"]
