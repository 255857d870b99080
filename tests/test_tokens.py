"""Token files: `portapipe tokenize` with a tokenizer trained here, and data.format: tokens."""

from __future__ import annotations

import gzip
import json
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from portapipe import cli
from portapipe.config import load_config
from portapipe.data import DEFAULT_CORPUS, TextData, data_problems
from portapipe.tokens import tokenize

TEXT = gzip.decompress(DEFAULT_CORPUS.read_bytes()).decode()[:60_000]


def _train(vocab: int, extra: int = 0) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    if extra:  # past 65,536 ids: uint32
        tok.add_tokens([f"<extra{i}>" for i in range(extra)])
    return tok


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    folder = tmp_path_factory.mktemp("tok")
    tok = _train(300)
    tok.save(str(folder / "tokenizer.json"))
    return tok, folder


def _cfg(path: Path, **data: Any) -> Any:
    return load_config(
        {"model": {"vocab_size": 512, "seq_len": 16}, "data": {"format": "tokens", "path": str(path), "val_fraction": 0.1, **data}}
    )


def _ids(path: Path, code: str) -> list[int]:
    a = array(code)
    a.frombytes(path.read_bytes())
    return a.tolist()


def test_tokenize_writes_the_tokenizers_ids_as_uint16_with_a_sidecar(small: tuple[Tokenizer, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok, folder = small
    text = tmp_path / "text.txt.gz"
    text.write_bytes(gzip.compress(TEXT.encode()))
    out = tmp_path / "data" / "train.bin"
    assert cli.main(["tokenize", str(text), str(out), "--tokenizer", str(folder)]) == 0
    meta = json.loads(capsys.readouterr().out)
    want = tok.encode(TEXT, add_special_tokens=False).ids
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size() and meta["tokens"] == len(want)
    assert out.stat().st_size == 2 * len(want) and _ids(out, "H") == want
    assert json.loads((tmp_path / "data" / "train.bin.json").read_text()) == meta
    # encoding in pieces cut at blank lines gives the ids of the whole text
    tokenize(text, tmp_path / "pieces.bin", folder / "tokenizer.json", piece_chars=500)
    assert _ids(tmp_path / "pieces.bin", "H") == want


def test_a_vocabulary_past_65536_ids_is_written_as_uint32(small: tuple[Tokenizer, Path], tmp_path: Path) -> None:
    tok = _train(300, extra=66_000)
    tok.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "t.txt"
    text.write_text(TEXT[:2000] + " <extra65900> " + TEXT[2000:4000])
    assert tokenize(text, tmp_path / "big.bin", small[1])["dtype"] == "uint16"  # then written again, wider
    meta = tokenize(text, tmp_path / "big.bin", tmp_path)
    assert json.loads((tmp_path / "big.bin.json").read_text()) == meta
    ids = tok.encode(text.read_text(), add_special_tokens=False).ids
    assert meta["dtype"] == "uint32" and max(ids) >= 65_536
    assert _ids(tmp_path / "big.bin", "I") == ids
    small_model = data_problems(_cfg(tmp_path / "big.bin"))
    assert any(p.startswith("model.vocab_size: 512 is smaller than the vocabulary") for p in small_model)
    assert any(p.startswith("model.vocab_size: 512 is too small") and f"up to {max(ids)}" in p for p in small_model)
    cfg = load_config({"model": {"vocab_size": 66_400, "seq_len": 16}, "data": {"format": "tokens", "path": str(tmp_path / "big.bin")}})
    assert data_problems(cfg) == []
    x, y = TextData(cfg).microbatches(0, 0, 1, 2, 3, 16)[0]
    assert x.dtype == torch.int64 and x.shape == (3, 16)


def test_batches_are_windows_of_the_token_file(small: tuple[Tokenizer, Path], tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    tokenize(text, tmp_path / "t.bin", small[1])
    ids = _ids(tmp_path / "t.bin", "H")
    data = TextData(_cfg(tmp_path / "t.bin"))
    assert data.n_bytes("train") + data.n_bytes("val") == len(ids)
    n_train = data.n_bytes("train")
    flat = torch.tensor(ids[:n_train])
    for x, y in data.microbatches(3, 0, 1, 2, 4, 16):
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):
            window = torch.cat([row_x, row_y[-1:]])
            starts = (flat.unfold(0, 17, 1) == window).all(1).nonzero()
            assert len(starts) >= 1  # a contiguous run of the train split
    again = TextData(_cfg(tmp_path / "t.bin")).microbatches(3, 0, 1, 2, 4, 16)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, data.microbatches(3, 0, 1, 2, 4, 16)))


def test_a_nanogpt_style_file_reads_with_an_explicit_width(tmp_path: Path) -> None:
    ids = [i % 500 for i in range(1000)]
    path = tmp_path / "train.bin"
    with path.open("wb") as f:
        array("H", ids).tofile(f)
    assert data_problems(_cfg(path)) == [
        "data.token_dtype: auto needs train.bin.json beside the token file (portapipe tokenize writes it) to know the token width; "
        "set data.token_dtype: uint16 or uint32 (nanoGPT's .bin files are uint16)"
    ]
    assert data_problems(_cfg(path, token_dtype="uint16")) == []
    data = TextData(_cfg(path, token_dtype="uint16"))
    assert data.splits["train"].tolist() == ids[:900]
    # data.vocab_size: the tokenizer's vocabulary, which a model may pad (GPT-2's 50,257 in a 50,304 model)
    assert data_problems(_cfg(path, token_dtype="uint16", vocab_size=500)) == []
    assert data_problems(_cfg(path, token_dtype="uint16", vocab_size=400)) == [
        "data.path: train.bin holds token ids up to 499, past its vocabulary of 400 tokens (data.vocab_size); is data.token_dtype right?"
    ]
    assert data_problems(_cfg(path, token_dtype="uint16", vocab_size=600)) == [
        "model.vocab_size: 512 is smaller than the vocabulary of the tokenizer that wrote train.bin (600 tokens, data.vocab_size)"
    ]
    assert data_problems(load_config({"data": {"vocab_size": 256}})) == ["data.vocab_size: 256 applies to data.format tokens only (bytes are 256 ids)"]


def test_token_file_problems_name_the_key(small: tuple[Tokenizer, Path], tmp_path: Path) -> None:
    assert data_problems(load_config({"data": {"format": "tokens"}}))[0].startswith("data.path: not set; data.format tokens")
    assert "does not exist" in data_problems(_cfg(tmp_path / "none.bin"))[0]
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    assert "not a whole number of uint16 tokens" in data_problems(_cfg(odd, token_dtype="uint16"))[0]
    text = tmp_path / "t.txt"
    text.write_text(TEXT[:3000])
    tokenize(text, tmp_path / "t.bin", small[1])
    assert data_problems(_cfg(tmp_path / "t.bin", token_dtype="uint32")) == [
        "data.token_dtype: uint32, but t.bin.json says the file holds uint16 ids"
    ]
    assert data_problems(_cfg(tmp_path / "t.bin", vocab_size=301)) == [
        f"data.vocab_size: 301, but t.bin.json says the tokenizer that wrote t.bin has {small[0].get_vocab_size()} tokens"
    ]
    assert data_problems(_cfg(tmp_path / "t.bin", vocab_size=small[0].get_vocab_size())) == []
    short = data_problems(_cfg(tmp_path / "t.bin", val_fraction=0.999))
    assert any(p.startswith("data.path: the train split of t.bin has") for p in short)
    low = data_problems(load_config({"model": {"vocab_size": 100}, "data": {"format": "tokens", "path": str(tmp_path / "t.bin")}}))
    assert any(p.startswith("model.vocab_size: 100 is too small for t.bin") for p in low)


def test_tokenize_command_refuses_bad_input_with_exit_2(small: tuple[Tokenizer, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert cli.main(["tokenize", str(tmp_path / "none.txt"), str(tmp_path / "o.bin"), "--tokenizer", str(small[1])]) == 2
    assert cli.main(["tokenize", str(text), str(tmp_path / "o.bin"), "--tokenizer", str(tmp_path)]) == 2
    assert cli.main(["tokenize", str(text), str(text), "--tokenizer", str(small[1])]) == 2
    err = capsys.readouterr().err
    assert "none.txt does not exist" in err and "holds no tokenizer.json" in err and "is the text itself" in err
    assert not (tmp_path / "o.bin").exists()
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(TEXT.encode())[:3000])  # a download cut short
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert cli.main(["tokenize", str(tmp_path / "cut.txt.gz"), str(tmp_path / "o.bin"), "--tokenizer", str(small[1])]) == 2
    assert cli.main(["tokenize", str(tmp_path / "latin1.txt"), str(tmp_path / "o.bin"), "--tokenizer", str(small[1])]) == 2
    assert cli.main(["tokenize", str(text), str(text / "o.bin"), "--tokenizer", str(small[1])]) == 2  # OUT's folder is a file
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"portapipe: tokenize: cannot read {tmp_path / 'cut.txt.gz'}: Compressed file ended"), lines
    assert lines[1] == f"portapipe: tokenize: {tmp_path / 'latin1.txt'} is not UTF-8 text (unexpected end of data at byte 3)"
    assert lines[2].startswith(f"portapipe: tokenize: cannot write {text / 'o.bin'}: ") and len(lines) == 3
    assert not (tmp_path / "o.bin").exists()


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_deepseek_example_is_ready_to_launch_with_the_shipped_tokenizer(tmp_path: Path) -> None:
    """examples/deepseek_v3.yaml: its tokenizer ships (and make_tokenizer.py rebuilds it byte for
    byte), the vocabulary matches the model, and token data made with it passes the launch checks."""
    import runpy

    from portapipe.train import check_before_launch

    shipped = EXAMPLES / "tokenizer" / "tokenizer.json"
    runpy.run_path(str(EXAMPLES / "make_tokenizer.py"), run_name="make")["main"](tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == shipped.read_bytes()
    text = tmp_path / "part.txt"
    text.write_text(TEXT)
    meta = tokenize(text, tmp_path / "part.bin", EXAMPLES / "tokenizer")
    overrides = [f"data.path={tmp_path / 'part.bin'}", f"log.dir={tmp_path / 'run'}"]
    cfg = load_config(EXAMPLES / "deepseek_v3.yaml", overrides)
    assert cfg.model.arch == "deepseek_v3" and meta["vocab_size"] == cfg.model.vocab_size == 1024 and meta["dtype"] == "uint16"
    check_before_launch(cfg)  # raises ConfigError listing any problem
