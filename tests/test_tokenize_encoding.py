"""How `portapipe tokenize` encodes: a long document in slices cut where the tokenizer splits
anyway (its ids the whole document's), and a jsonl line the tokenizer cannot take (a lone
surrogate escape) a bad line like any other."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from portapipe import cli
from portapipe.data import writer
from portapipe.data.folder import open_dataset

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tokenizer"
EOS = 187
TOK = ["--tokenizer", str(TOKENIZER), "--eos", str(EOS), "--workers", "1"]
TEXTS = [json.loads(line)["text"] for line in (ROOT / "examples" / "corpus" / "plays.jsonl").read_text().splitlines()]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = cli.main(["tokenize", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("portapipe:")]


@pytest.fixture
def shipped():
    from tokenizers import Tokenizer

    writer._init(str(TOKENIZER), EOS, "uint16", "text", False)
    os.environ.pop("TOKENIZERS_PARALLELISM")
    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))


def _awkward() -> str:
    """The plays as one text, with runs of spaces, tabs, blank lines, indents and CRLFs mixed in."""
    text = "\n\n".join(TEXTS)
    for old, new in (("the ", "the   "), (", ", ",\t "), (".\n", ".\r\n   "), ("!", "!  \n \n")):
        text = text.replace(old, new, 40)
    return text


def test_a_long_document_in_slices_has_the_whole_documents_ids(shipped, monkeypatch) -> None:
    """Cut before a space that a non-space follows, at slices of 70 (the text has such a space
    every 67 characters at most), 400 and 64 Ki characters, the ids are those of the document
    encoded whole, for the shipped tokenizer."""
    text = _awkward() * 3
    whole = shipped.encode(text, add_special_tokens=False).ids + [EOS]
    for size in (70, 400, writer.BATCH_CHARS):
        monkeypatch.setattr(writer, "BATCH_CHARS", size)
        bounds = writer.cuts(text, size)
        assert len(bounds) > 3 and max(b - a for a, b in zip(bounds, bounds[1:])) <= size
        assert all(text[at] == " " and not text[at + 1].isspace() for at in bounds[1:-1])
        out = writer.Encoded()
        assert writer._documents([text], out).tolist() == whole and out.lengths == [len(whole)], size


def test_a_stretch_without_a_space_is_cut_at_the_slice_size() -> None:
    """What the docs say of text without spaces: the cut falls at the slice's size."""
    assert writer.cuts("x" * 1000, 400) == [0, 400, 800, 1000]
    assert writer.cuts("ab" * 200 + " c" + "d" * 500, 400) == [0, 400, 800, 902]  # before the space, then at 400 characters
    assert writer.cuts("short", 400) == [0, 5] and writer.cuts("", 400) == [0, 0]


def test_a_long_document_written_is_the_whole_documents_ids(shipped, tmp_path: Path, capsys) -> None:
    """Through the command: a 1 MB text (16 slices of 64 Ki characters) is one document with the
    whole text's ids; a short one is the same bytes it always was."""
    text = _awkward() * 18
    assert len(text) > 16 * writer.BATCH_CHARS
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "short.txt").write_text(TEXTS[0])
    assert _run(capsys, str(tmp_path / "long.txt"), str(tmp_path / "short.txt"), str(tmp_path / "out"), *TOK)[0] == 0
    _, tokens, starts = open_dataset(tmp_path / "out")
    assert tokens[: starts[1]].tolist() == shipped.encode(text, add_special_tokens=False).ids + [EOS]
    assert tokens[starts[1] :].tolist() == shipped.encode(TEXTS[0], add_special_tokens=False).ids + [EOS]


def test_a_lone_surrogate_escape_is_a_bad_line(tmp_path: Path, capsys) -> None:
    """JSON may escape half of a UTF-16 pair, which is no text: refused naming its file and line,
    or skipped and counted with --skip-bad, with one worker and with two."""
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": t}) for t in TEXTS[:5]]
    lines[3] = '{"text": "half a pair \\ud800 here"}'
    bad.write_text("\n".join(lines) + "\n")
    for workers in ("1", "2"):
        tok = [*TOK[:-1], workers]
        assert _run(capsys, str(bad), str(tmp_path / f"no{workers}"), *tok) == (2, [
            f"portapipe: tokenize: {bad}:4: field 'text' holds a lone surrogate escape (\\ud800), not text; --skip-bad skips such lines"])
        code, lines_said = _run(capsys, str(bad), str(tmp_path / f"skip{workers}"), *tok, "--skip-bad")
        meta = json.loads((tmp_path / f"skip{workers}" / "dataset.json").read_text())
        assert code == 0 and meta["documents"] == 4 and meta["bad_skipped"] == 1, lines_said
