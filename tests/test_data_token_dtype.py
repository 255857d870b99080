"""The width of one token id is a source's own: a dataset folder's dataset.json says its width,
a flat file takes its source's token_dtype, else data.token_dtype; so a uint32 flat file blends
with a uint16 folder, and a source's key that contradicts its folder is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from portapipe.data.batches import Batches
from portapipe.data.corpus import data_problems

from .test_data_epochs import config, random_docs, write_dataset


def _wide(tmp_path: Path) -> tuple[Path, list[int]]:
    """A flat file of uint32 ids (no sidecar), each id above 65,535 read as uint16 would be two."""
    ids = [70_000 + i % 50 for i in range(400)]
    path = tmp_path / "wide.bin"
    np.asarray(ids, dtype="<u4").tofile(path)
    return path, ids


def _cfg(sources: list[dict], **data: object):  # type: ignore[no-untyped-def]
    c = config(sources=sources, val_fraction=0.0, **data)
    c.model.vocab_size = 70_100
    return c


def test_a_uint32_flat_file_blends_with_a_uint16_folder(tmp_path: Path) -> None:
    folder = write_dataset(tmp_path / "folder", random_docs(1, 40))
    wide, ids = _wide(tmp_path)
    for sources, data in (
        ([{"path": str(folder)}, {"path": str(wide), "token_dtype": "uint32"}], {}),  # the flat file's own key
        ([{"path": str(folder)}, {"path": str(wide)}], {"token_dtype": "uint32"}),  # data.token_dtype, for flat files alone
        ([{"path": str(folder), "token_dtype": "uint16"}, {"path": str(wide), "token_dtype": "uint32"}], {"token_dtype": "uint16"}),
    ):
        cfg = _cfg(sources, **data)
        assert data_problems(cfg) == [], (sources, data)
        batches = Batches(cfg)
        folder_part, wide_part = (p.source for p in batches.corpus.train)
        assert folder_part.tokens.dtype == np.dtype("<u2") and wide_part.tokens.dtype == np.dtype("<u4")
        assert wide_part.tokens.tolist() == ids
        seen = np.concatenate([mb[0].numpy().reshape(-1) for step in range(4) for mb in batches.microbatches(step, 0, 1, 2, 2, 8)])
        assert (seen >= 70_000).any() and (seen < 100).any()  # samples from both, the wide ids whole


def test_a_sources_key_that_contradicts_its_folder_or_file_is_one_line(tmp_path: Path) -> None:
    folder = write_dataset(tmp_path / "folder", random_docs(2, 40))
    wide, _ = _wide(tmp_path)
    assert data_problems(_cfg([{"path": str(folder), "token_dtype": "uint32"}, {"path": str(wide), "token_dtype": "uint32"}])) == [
        f"data.sources[0].token_dtype: uint32, but {folder / 'dataset.json'} says the dataset holds uint16 ids"]
    # data.path is a blend of one: data.token_dtype is its own key
    assert data_problems(config(path=str(folder), token_dtype="uint32")) == [
        f"data.token_dtype: uint32, but {folder / 'dataset.json'} says the dataset holds uint16 ids"]
    # a flat file without a width anywhere: the key to set is its own
    assert data_problems(_cfg([{"path": str(folder)}, {"path": str(wide)}])) == [
        "data.sources[1].token_dtype: auto needs wide.bin.json beside the token file (portapipe tokenize writes it) to know the "
        "token width; set data.sources[1].token_dtype: uint16 or uint32 (nanoGPT's .bin files are uint16)"]
    # read at the wrong width, its ids past the vocabulary say which key to look at
    top = int(np.fromfile(wide, dtype="<u2").max())
    assert data_problems(_cfg([{"path": str(folder)}, {"path": str(wide), "token_dtype": "uint16"}], vocab_size=100)) == [
        f"data.sources[1].path: wide.bin holds token ids up to {top}, past its vocabulary of 100 tokens (data.vocab_size); "
        "is data.sources[1].token_dtype right?"]
