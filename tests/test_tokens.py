"""`portapipe tokenize` writes a dataset folder (ids, EOS after every document, a document index,
a description), with a tokenizer trained here; flat token files (nanoGPT's) stay readable."""

from __future__ import annotations

import gzip
import json
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from portapipe import cli
from portapipe.config import load_config
from portapipe.data.batches import Batches
from portapipe.data.corpus import data_problems
from portapipe.data.readers import expand
from portapipe.data.shipped import DEFAULT_CORPUS
from portapipe.data.writer import Options, write_dataset

TEXT = gzip.decompress(DEFAULT_CORPUS.read_bytes()).decode()[:60_000]
DOCS = [p for p in TEXT.split("\n\n") if p.strip()][:120]


def _train(vocab: int, extra: int = 0, eos: str | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    if extra:  # past 65,536 ids: uint32
        tok.add_tokens([f"<extra{i}>" for i in range(extra)])
    if eos is not None:
        tok.add_special_tokens([AddedToken(eos, special=True)])
    return tok


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    """A 300-token tokenizer with <|endoftext|> as a special token (its EOS)."""
    folder = tmp_path_factory.mktemp("tok")
    tok = _train(300, eos="<|endoftext|>")
    tok.save(str(folder / "tokenizer.json"))
    return tok, folder


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _read(out: Path) -> tuple[dict[str, Any], list[int], list[int]]:
    meta = json.loads((out / "dataset.json").read_text())
    code = "H" if meta["dtype"] == "uint16" else "I"
    ids = array(code)
    ids.frombytes((out / "tokens.bin").read_bytes())
    index = np.frombuffer((out / "documents.bin").read_bytes(), dtype="<i8").tolist()
    return meta, ids.tolist(), index


def test_tokenize_writes_each_document_then_the_eos_and_indexes_them(small, tmp_path, capsys) -> None:
    tok, folder = small
    corpus = _jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "data"
    assert cli.main(["tokenize", str(corpus), str(out), "--tokenizer", str(folder), "--workers", "1"]) == 0
    printed = capsys.readouterr()
    meta, ids, index = _read(out)
    eos = tok.token_to_id("<|endoftext|>")
    want = [doc for d in DOCS for doc in (tok.encode(d, add_special_tokens=False).ids + [eos],)]
    assert ids == [t for doc in want for t in doc]
    assert index == np.concatenate(([0], np.cumsum([len(d) for d in want]))).tolist()
    assert meta["eos_id"] == eos and meta["eos_from"] == "special token '<|endoftext|>'"
    assert (meta["dtype"], meta["vocab_size"], meta["documents"], meta["tokens"]) == ("uint16", tok.get_vocab_size(), len(DOCS), len(ids))
    assert meta["max_id"] == max(ids) and meta["sources"] == [
        {"path": str(corpus), "kind": "jsonl", "documents": len(DOCS), "tokens": len(ids), "bad": 0, "empty": 0}]
    assert json.loads(printed.out) == meta
    (line,) = printed.err.splitlines()
    assert line.startswith(f"portapipe: tokenize: wrote {out}: {len(DOCS)} documents, {len(ids):,} uint16 tokens (EOS {eos}) from 1 input(s)")
    # training reads it: the documents as written, memory-mapped
    data = Batches(load_config({"model": {"vocab_size": 512, "seq_len": 16}, "data": {"format": "tokens", "path": str(out)}}))
    source = data.corpus.train[0].source
    assert source.kind == "dataset" and source.documents == len(DOCS)
    assert [source.document(i).tolist() for i in range(len(DOCS))] == want


def test_the_eos_comes_from_the_tokenizer_config_else_it_must_be_given(small, tmp_path, capsys) -> None:
    plain = _train(300)  # no special token
    folder = tmp_path / "tok"
    folder.mkdir()
    plain.save(str(folder / "tokenizer.json"))
    corpus = _jsonl(tmp_path / "d.jsonl", DOCS[:5])
    assert cli.main(["tokenize", str(corpus), str(tmp_path / "o"), "--tokenizer", str(folder)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"portapipe: tokenize: the tokenizer {folder / 'tokenizer.json'} names no end-of-document token (no eos_token in a "
        "tokenizer_config.json beside it, no special token such as <|endoftext|>); give its id with --eos ID"
    ]
    assert not (tmp_path / "o").exists()
    assert cli.main(["tokenize", str(corpus), str(tmp_path / "o"), "--tokenizer", str(folder), "--eos", "300"]) == 2
    assert capsys.readouterr().err.splitlines() == ["portapipe: tokenize: --eos 300 is not an id of the tokenizer (0..299)"]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": plain.id_to_token(7)}}))
    assert cli.main(["tokenize", str(corpus), str(tmp_path / "o"), "--tokenizer", str(folder)]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["eos_id"] == 7 and meta["eos_from"] == f"tokenizer_config.json eos_token {plain.id_to_token(7)!r}"
    assert cli.main(["tokenize", str(corpus), str(tmp_path / "o"), "--tokenizer", str(small[1]), "--eos", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["eos_id"] == 5  # --eos before the tokenizer's own


def test_a_vocabulary_past_65536_ids_is_written_as_uint32_and_uint16_is_refused(small, tmp_path, capsys) -> None:
    tok = _train(300, extra=66_000, eos="<|endoftext|>")
    tok.save(str(tmp_path / "tokenizer.json"))
    corpus = _jsonl(tmp_path / "d.jsonl", [DOCS[0] + " <extra65900> " + DOCS[1], DOCS[2]])
    assert cli.main(["tokenize", str(corpus), str(tmp_path / "o"), "--tokenizer", str(tmp_path), "--dtype", "uint16"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"portapipe: tokenize: --dtype uint16 holds ids below 65536, but the tokenizer has {tok.get_vocab_size()} tokens; use uint32 (or auto)"]
    assert cli.main(["tokenize", str(corpus), str(tmp_path / "o"), "--tokenizer", str(tmp_path)]) == 0
    capsys.readouterr()
    meta, ids, _ = _read(tmp_path / "o")
    assert meta["dtype"] == "uint32" and max(ids) >= 65_536 and meta["max_id"] == max(ids)
    assert ids[: ids.index(meta["eos_id"])] == tok.encode(DOCS[0] + " <extra65900> " + DOCS[1], add_special_tokens=False).ids
    problems = data_problems(load_config({"model": {"vocab_size": 512, "seq_len": 4}, "data": {"format": "tokens", "path": str(tmp_path / "o"), "val_fraction": 0}}))
    assert problems == [f"model.vocab_size: 512 is smaller than the vocabulary of the tokenizer that wrote o ({tok.get_vocab_size()} tokens, its description)",
                        f"model.vocab_size: 512 is too small for o, which holds token ids up to {meta['max_id']} (use vocab_size >= {meta['max_id'] + 1})"]


# ---------------------------------------------------------------------------- flat token files
def _flat(tmp_path: Path, ids: list[int], code: str = "H", side: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "train.bin"
    with path.open("wb") as f:
        array(code, ids).tofile(f)
    if side is not None:
        (tmp_path / "train.bin.json").write_text(json.dumps({"format": "portapipe.tokens", **side}))
    return path


def _cfg(path: Path, **data: Any) -> Any:
    return load_config(
        {"model": {"vocab_size": 512, "seq_len": 16}, "data": {"format": "tokens", "path": str(path), "val_fraction": 0.1, **data}}
    )


def test_a_nanogpt_style_file_reads_with_an_explicit_width(tmp_path: Path) -> None:
    ids = [i % 500 for i in range(1000)]
    path = _flat(tmp_path, ids)
    assert data_problems(_cfg(path)) == [
        "data.token_dtype: auto needs train.bin.json beside the token file (portapipe tokenize writes it) to know the token width; "
        "set data.token_dtype: uint16 or uint32 (nanoGPT's .bin files are uint16)"
    ]
    assert data_problems(_cfg(path, token_dtype="uint16")) == []
    data = Batches(_cfg(path, token_dtype="uint16"))
    assert data.tokens("train").tolist() == ids[:900] and data.corpus.train[0].source.kind == "flat"
    # data.vocab_size: the tokenizer's vocabulary, which a model may pad (GPT-2's 50,257 in a 50,304 model)
    assert data_problems(_cfg(path, token_dtype="uint16", vocab_size=500)) == []
    assert data_problems(_cfg(path, token_dtype="uint16", vocab_size=400)) == [
        "data.path: train.bin holds token ids up to 499, past its vocabulary of 400 tokens (data.vocab_size); is data.token_dtype right?"
    ]
    assert data_problems(_cfg(path, token_dtype="uint16", vocab_size=600)) == [
        "model.vocab_size: 512 is smaller than the vocabulary of the tokenizer that wrote train.bin (600 tokens, data.vocab_size)"
    ]
    assert data_problems(load_config({"data": {"vocab_size": 256}})) == ["data.vocab_size: 256 applies to data.format tokens only (bytes are 256 ids)"]


def test_token_file_problems_name_the_key(tmp_path: Path) -> None:
    assert data_problems(load_config({"data": {"format": "tokens"}}))[0].startswith("data.path: not set; data.format tokens")
    assert "does not exist" in data_problems(_cfg(tmp_path / "none.bin"))[0]
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    assert "not a whole number of uint16 tokens" in data_problems(_cfg(odd, token_dtype="uint16"))[0]
    ids = [i % 290 for i in range(3000)]
    path = _flat(tmp_path, ids, side={"dtype": "uint16", "vocab_size": 300, "tokens": len(ids)})
    assert data_problems(_cfg(path, token_dtype="uint32")) == ["data.token_dtype: uint32, but train.bin.json says the file holds uint16 ids"]
    assert data_problems(_cfg(path, vocab_size=301)) == ["data.vocab_size: 301, but train.bin.json says the tokenizer that wrote train.bin has 300 tokens"]
    assert data_problems(_cfg(path, vocab_size=300)) == []
    short = data_problems(_cfg(path, val_fraction=0.999))
    assert any(p.startswith("data.path: the train split of train.bin has") for p in short)
    low = data_problems(load_config({"model": {"vocab_size": 100}, "data": {"format": "tokens", "path": str(path)}}))
    assert any(p.startswith("model.vocab_size: 100 is too small for train.bin") for p in low)
    # a uint32 file under a sidecar that says uint16 reads as valid-looking ids: refused by its size
    wide = _flat(tmp_path, ids, "I", side={"dtype": "uint16", "vocab_size": 300, "tokens": len(ids)})
    assert data_problems(_cfg(wide))[0].startswith("data.path: train.bin has 12000 bytes, but train.bin.json says it holds 3000 uint16 tokens")


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_deepseek_example_is_ready_to_launch_with_the_shipped_tokenizer(tmp_path: Path) -> None:
    """examples/deepseek_v3.yaml: its tokenizer ships (and make_tokenizer.py rebuilds it byte for
    byte), the vocabulary matches the model, and token data made with it passes the launch checks."""
    import runpy

    from portapipe.data.shipped import SHIPPED_TOKENIZER, shipped_eos
    from portapipe.data.tokenizer import load_tokenizer
    from portapipe.train import check_before_launch

    shipped = EXAMPLES / "tokenizer" / "tokenizer.json"
    runpy.run_path(str(EXAMPLES / "make_tokenizer.py"), run_name="make")["main"](tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == shipped.read_bytes()
    text = tmp_path / "part.txt"
    text.write_text(TEXT)
    eos = shipped_eos(load_tokenizer(SHIPPED_TOKENIZER))
    assert eos not in load_tokenizer(SHIPPED_TOKENIZER).encode(gzip.decompress(DEFAULT_CORPUS.read_bytes()).decode()[:200_000]).ids
    meta = write_dataset(expand([str(text)]), tmp_path / "part", Options(EXAMPLES / "tokenizer", eos=eos))
    overrides = [f"data.path={tmp_path / 'part'}", f"log.dir={tmp_path / 'run'}"]
    cfg = load_config(EXAMPLES / "deepseek_v3.yaml", overrides)
    assert cfg.model.arch == "deepseek_v3" and meta["vocab_size"] == cfg.model.vocab_size == 1024 and meta["dtype"] == "uint16"
    check_before_launch(cfg)  # raises ConfigError listing any problem
