"""`portapipe tokenize` reads every kind of corpus (jsonl plain / gz / zst, text, parquet, a saved
Hugging Face dataset; files, folders, globs), writes the same bytes with 1 and 3 workers, and
refuses bad input in one line, exit 2, leaving nothing that loads."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from portapipe import cli
from portapipe.data.folder import open_dataset

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tokenizer"
EOS = "187"
DOCS = [p for p in (ROOT / "examples" / "corpus" / "plays.jsonl").read_text().splitlines()]
TEXTS = [json.loads(line)["text"] for line in DOCS]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus in every format: 40 documents each, texts in a known order."""
    zstandard = pytest.importorskip("zstandard")
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("corpus")
    (root / "a").mkdir()
    (root / "a" / "1.jsonl").write_text("\n".join(DOCS[:40]) + "\n")
    (root / "a" / "2.jsonl.gz").write_bytes(gzip.compress(("\n".join(DOCS[40:80]) + "\n").encode()))
    (root / "a" / "3.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(("\n".join(DOCS[80:120])).encode()))  # no final newline
    (root / "b.txt").write_text("\n".join(TEXTS[120:160]) .replace("\n", " ") + "\n")
    pq.write_table(pa.table({"text": TEXTS[160:200], "n": list(range(40))}), root / "c.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": TEXTS[200:240]}).save_to_disk(str(root / "d_saved"), num_proc=1)
    (root / "lines.txt").write_text("\n".join(TEXTS[240:280]).replace("\n\n", "\n"))
    return root


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = cli.main(["tokenize", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("portapipe:")]


def _docs(out: Path) -> list[list[int]]:
    _, tokens, starts = open_dataset(out)
    return [tokens[starts[i] : starts[i + 1]].tolist() for i in range(len(starts) - 1)]


def test_every_format_reads_as_its_documents_in_input_order(corpus: Path, tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    out = tmp_path / "all"
    code, lines = _run(capsys, str(corpus / "a"), str(corpus / "b.txt"), str(corpus / "c.parquet"), str(corpus / "d_saved"),
                       str(out), "--tokenizer", str(TOKENIZER), "--eos", EOS, "--workers", "1")
    assert code == 0, lines
    texts = TEXTS[:120] + [("\n".join(TEXTS[120:160]).replace("\n", " ") + "\n")] + TEXTS[160:240]
    want = [tok.encode(t, add_special_tokens=False).ids + [int(EOS)] for t in texts]
    assert _docs(out) == want
    meta = json.loads((out / "dataset.json").read_text())
    assert [(Path(s["path"]).name, s["kind"], s["documents"]) for s in meta["sources"]] == [
        ("1.jsonl", "jsonl", 40), ("2.jsonl.gz", "jsonl", 40), ("3.jsonl.zst", "jsonl", 40), ("b.txt", "text", 1),
        ("c.parquet", "parquet", 40), ("d_saved", "hf", 40)]
    # --split-lines: one document per line; a glob names files
    code, _ = _run(capsys, str(corpus / "lines*.txt"), str(tmp_path / "lines"), "--tokenizer", str(TOKENIZER), "--eos", EOS, "--split-lines")
    lines_in = [t for t in (corpus / "lines.txt").read_text().splitlines() if t]
    assert code == 0 and _docs(tmp_path / "lines") == [tok.encode(t, add_special_tokens=False).ids + [int(EOS)] for t in lines_in]


def test_one_worker_and_three_write_the_same_bytes(corpus: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import portapipe.data.readers as readers

    monkeypatch.setattr(readers, "CHUNK_BYTES", 4096)  # many chunks in flight, out of order
    for n in ("1", "3"):
        code, lines = _run(capsys, str(corpus), str(tmp_path / n), "--tokenizer", str(TOKENIZER), "--eos", EOS, "--workers", n)
        assert code == 0, lines
    for name in ("tokens.bin", "documents.bin"):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "3" / name).read_bytes()
    one, three = (json.loads((tmp_path / n / "dataset.json").read_text()) for n in ("1", "3"))
    assert one["tokens_blake2b"] == three["tokens_blake2b"] and one["documents"] == three["documents"] == 202


def test_a_chunk_is_encoded_in_calls_of_bounded_size_with_the_same_ids(tmp_path: Path, monkeypatch) -> None:
    """The tokenizer gets a chunk's texts a few at a time (its time per character grows with the
    call), each call about BATCH_CHARS characters, a longer text in slices of at most BATCH_CHARS;
    the ids are each text's own, its EOS after it."""
    from tokenizers import Tokenizer

    from portapipe.data import writer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    writer._init(str(TOKENIZER), int(EOS), "uint16", "text", False)
    os.environ.pop("TOKENIZERS_PARALLELISM")
    calls: list[list[str]] = []
    real = writer._STATE["tokenizer"]

    class Recording:
        def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list:
            calls.append(list(texts))
            return real.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

        encode_batch = encode_batch_fast  # the older library's name

    writer._STATE["tokenizer"] = Recording()
    monkeypatch.setattr(writer, "BATCH_CHARS", 400)
    long = " ".join(TEXTS[63:80])
    assert len(long) > 1000
    texts = TEXTS[:60] + [long] + TEXTS[60:63]
    out = writer.Encoded()
    ids = writer._documents(texts, out)
    want = [tok.encode(t, add_special_tokens=False).ids + [int(EOS)] for t in texts]
    assert ids.tolist() == [i for doc in want for i in doc] and out.lengths == [len(doc) for doc in want]
    assert "".join(t for call in calls for t in call) == "".join(texts) and len(calls) > 10
    for call in calls:  # under the bound but for the piece that crosses it; no piece over it
        assert sum(map(len, call[:-1])) < 400 and max(map(len, call)) <= 400
    slices = [t for call in calls for t in call if t not in texts and t in long]  # other texts over 400 are cut too
    assert "".join(slices) == long and len(slices) >= 3 and all(t.startswith(" ") for t in slices[1:])
    assert writer._documents([], writer.Encoded()).tolist() == []


def test_bad_input_is_one_line_exit_2_and_nothing_written(corpus: Path, tmp_path: Path, capsys) -> None:
    tok = ["--tokenizer", str(TOKENIZER), "--eos", EOS, "--workers", "1"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(DOCS[0] + "\n" + DOCS[1] + "\n{not json\n" + '{"body": "x"}\n' + DOCS[2] + "\n")
    out = tmp_path / "out"
    assert _run(capsys, str(bad), str(out), *tok)[1] == [
        f"portapipe: tokenize: {bad}:3: not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "--skip-bad skips such lines"]
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    code, _ = _run(capsys, str(bad), str(out), *tok, "--skip-bad")
    meta = json.loads((out / "dataset.json").read_text())
    assert code == 0 and meta["documents"] == 3 and meta["bad_skipped"] == 2
    field = tmp_path / "field.jsonl"
    field.write_text('{"body": "x"}\n')
    assert _run(capsys, str(field), str(tmp_path / "o2"), *tok)[1] == [
        f"portapipe: tokenize: {field}:1: no field 'text'; --field names the text's field, --skip-bad skips such lines"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n\n')
    assert _run(capsys, str(empty), str(tmp_path / "o3"), *tok)[1] == [
        "portapipe: tokenize: the corpus is empty: no document in 1 input(s) (0 bad line(s), 1 empty document(s) skipped)"]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(("\n".join(DOCS) + "\n").encode())[:2000])
    (line,) = _run(capsys, str(cut), str(tmp_path / "o4"), *tok)[1]
    assert line.startswith(f"portapipe: tokenize: cannot read {cut}: ")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    assert _run(capsys, str(latin), str(tmp_path / "o5"), *tok)[1] == [
        f"portapipe: tokenize: {latin}:2: not UTF-8 text (invalid continuation byte)"]
    assert _run(capsys, str(tmp_path / "none*.jsonl"), str(tmp_path / "o6"), *tok)[1] == [
        f"portapipe: tokenize: {tmp_path / 'none*.jsonl'} matches no file"]
    assert _run(capsys, str(corpus / "c.parquet"), str(tmp_path / "o7"), *tok, "--field", "body")[1] == [
        f"portapipe: tokenize: {corpus / 'c.parquet'} has no column 'body' (it has text, n); name the text column with --field"]
    assert _run(capsys, str(bad), str(bad), *tok)[1] == [f"portapipe: tokenize: OUT {bad} is a file; name a folder to write the dataset into"]
    assert not any((tmp_path / f"o{i}").exists() for i in range(2, 8))


def test_a_killed_write_leaves_no_dataset_and_a_second_run_replaces_the_first(corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert _run(capsys, str(corpus / "a"), str(out), "--tokenizer", str(TOKENIZER), "--eos", EOS)[0] == 0
    first = (out / "tokens.bin").read_bytes()
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(DOCS * 60) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "portapipe.cli", "tokenize", str(big), str(tmp_path / "killed"), "--tokenizer",
                             str(TOKENIZER), "--eos", EOS, "--workers", "1"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".killed.*.tmp")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed").exists()  # nothing under the name a config would read
    # the next write cleans up what the killed one left, and replaces an earlier dataset whole
    assert _run(capsys, str(corpus / "b.txt"), str(tmp_path / "killed"), "--tokenizer", str(TOKENIZER), "--eos", EOS)[0] == 0
    assert not list(tmp_path.glob(".killed.*"))
    assert _run(capsys, str(corpus / "b.txt"), str(out), "--tokenizer", str(TOKENIZER), "--eos", EOS)[0] == 0
    assert (out / "tokens.bin").read_bytes() != first and len(_docs(out)) == 1 and not list(tmp_path.glob(".out*"))
    stray = tmp_path / "mine"
    stray.mkdir()
    (stray / "notes.txt").write_text("keep me")
    assert _run(capsys, str(corpus / "b.txt"), str(stray), "--tokenizer", str(TOKENIZER), "--eos", EOS)[1] == [
        f"portapipe: tokenize: OUT {stray} is a folder holding other files; name a new folder (or an earlier dataset, which is replaced)"]
    assert np.array_equal(np.fromfile(out / "documents.bin", dtype="<i8")[:1], [0])


def _reader_state(skip_bad: bool = False) -> None:
    from portapipe.data import writer

    writer._init(str(TOKENIZER), int(EOS), "uint16", "text", skip_bad)


def test_without_pyarrow_jsonl_is_read_line_by_line_the_same_and_one_line_says_so(corpus: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """pyarrow is the data extra's: without it the line reader reads every chunk, the dataset is
    the same bytes, and one line names the extra that brings the faster reader."""
    jsonl = corpus / "a" / "1.jsonl"
    code, lines = _run(capsys, str(jsonl), str(tmp_path / "arrow"), "--tokenizer", str(TOKENIZER), "--eos", EOS, "--workers", "1")
    assert code == 0 and not any("pyarrow is not installed" in line for line in lines), lines
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.json", None)
    code, lines = _run(capsys, str(jsonl), str(tmp_path / "lines"), "--tokenizer", str(TOKENIZER), "--eos", EOS, "--workers", "1")
    assert code == 0, lines
    assert [line for line in lines if "pyarrow is not installed" in line] == [
        "portapipe: tokenize: pyarrow is not installed, so jsonl is read line by line, several times slower (pip install 'portapipe[data]' for its JSON reader)"
    ]
    for name in ("tokens.bin", "documents.bin"):
        assert (tmp_path / "arrow" / name).read_bytes() == (tmp_path / "lines" / name).read_bytes()


def test_pyarrow_reads_good_jsonl_and_hands_anything_else_to_the_line_reader(tmp_path: Path) -> None:
    """The fast reader gives json.loads' texts for good lines (escapes, blank lines, CRLF, other
    fields of any kind, no final newline) and declines every chunk the line reader must judge:
    its verdict (the error with the line, or the skipped count) is then the one given."""
    pytest.importorskip("pyarrow")
    from portapipe.data import writer
    from portapipe.data.readers import Chunk

    _reader_state()
    good = (DOCS[0] + "\r\n\n   \n" + json.dumps({"meta": {"a": [1, {"b": None}], "n": 1e300}, "text": "caf\u00e9 \"q\"\n\\"}) + "\n"
            + '{"text": "\\ud83d\\ude00", "x": NaN}\n' + DOCS[1]).encode()
    texts = [json.loads(line)["text"] for line in good.split(b"\n") if line.strip()]
    assert writer._jsonl_arrow(good) == texts  # read by pyarrow, not declined
    assert writer._jsonl(Chunk(0, "jsonl", "g.jsonl", good, 1), writer.Encoded()) == texts
    declined = {
        "two objects on a line": b'{"text": "a"}{"text": "b"}\n',
        "not UTF-8 in another field": b'{"text": "a", "s": "\xff"}\n',
        "a number": b'{"text": 5}\n', "null": b'{"text": null}\n', "no field": b'{"body": "a"}\n', "not an object": b'"a"\n',
        "a lone surrogate": b'{"text": "\\ud800"}\n', "not JSON": b'{not json\n', "the field twice": b'{"text": "a", "text": "b"}\n',
    }
    for what, line in declined.items():
        data = (DOCS[0] + "\n").encode() + line + (DOCS[1] + "\n").encode()
        assert writer._jsonl_arrow(data) is None, what
    # the line reader's verdict stands: the line named, or the line skipped and counted
    with pytest.raises(ValueError, match=r"^t\.jsonl:12: not JSON"):
        writer._jsonl(Chunk(0, "jsonl", "t.jsonl", (DOCS[0] + '\n{"text": "a"}{"text": "b"}\n').encode(), 11), writer.Encoded())
    _reader_state(skip_bad=True)
    skipped = writer.Encoded()
    both = (DOCS[0] + "\n" + '{"text": 5}\n' + DOCS[1] + "\n").encode()
    assert writer._jsonl(Chunk(0, "jsonl", "t.jsonl", both, 1), skipped) == [TEXTS[0], TEXTS[1]] and skipped.bad == 1
    duplicate = writer.Encoded()
    assert writer._jsonl(Chunk(0, "jsonl", "t.jsonl", b'{"text": "a", "text": "b"}\n', 1), duplicate) == ["b"]  # json.loads: the last


def test_every_worker_encodes_on_one_thread_and_the_callers_setting_is_kept(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    """--workers N keeps N cores busy: the tokenizers library's own thread pool is off while
    encoding, in the main process with one worker too, and the caller's setting is back after."""
    from portapipe.data import writer
    from portapipe.data.readers import expand

    seen = []
    encode = writer._encode

    def recording(texts: list[str]) -> list[list[int]]:
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return encode(texts)

    monkeypatch.setattr(writer, "_encode", recording)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    writer.write_dataset(expand([str(corpus / "a" / "1.jsonl")]), tmp_path / "one", writer.Options(TOKENIZER, eos=int(EOS), workers=1))
    assert seen and set(seen) == {"false"} and os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    writer.write_dataset(expand([str(corpus / "a" / "1.jsonl")]), tmp_path / "two", writer.Options(TOKENIZER, eos=int(EOS), workers=1))
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    writer._init(str(TOKENIZER), int(EOS), "uint16", "text", False)  # what a worker process runs first
    assert os.environ.pop("TOKENIZERS_PARALLELISM") == "false"
