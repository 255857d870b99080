"""How `portapipe tokenize` reads its inputs: cut into chunks of any size, an input reads as the
whole file does; a compressed file cut short is refused as truncated; links inside a folder are
followed with each real file read once, loops passed over with a line said."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from portapipe import cli
from portapipe.data import writer
from portapipe.data.readers import Input, chunks, expand

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tokenizer"
EOS = "187"
TOK = ["--tokenizer", str(TOKENIZER), "--eos", EOS, "--workers", "1"]
DOCS = (ROOT / "examples" / "corpus" / "plays.jsonl").read_text().splitlines()


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = cli.main(["tokenize", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("portapipe:")]


# --------------------------------------------------------------------------- chunks
def _encoded(pieces: list) -> tuple[list[int], list[int], int]:
    """(every token, each document's length, empty documents) of the chunks, encoded in order."""
    ids, lengths, empty = [], [], 0
    for chunk in pieces:
        got = writer.encode_chunk(chunk)
        assert got.error is None, got.error
        ids += got.ids.tolist()
        lengths += got.lengths
        empty += got.empty
    return ids, lengths, empty


def test_lines_cut_into_chunks_of_any_size_read_as_the_whole_file(tmp_path: Path) -> None:
    """--split-lines input cut at every chunk size from 1 to 40 bytes, read a block of 1, 7 or
    the default bytes at a time: the pieces are whole lines (each ends with its newline) with
    their first line's number, and they encode to the whole file's documents, empty lines
    counted alike. Among the sizes, a newline falls on the last byte of a chunk and on the first
    byte past it."""
    writer._init(str(TOKENIZER), int(EOS), "uint16", "text", False)
    os.environ.pop("TOKENIZERS_PARALLELISM")
    lines = ["To be, or not to be", "", "that is the question:", "x", "", "", "Whether 'tis nobler in the mind to suffer the slings",
             "and arrows", "of outrageous fortune", "y" * 55, "z"]
    data = ("\n".join(lines) + "\n").encode()
    text = tmp_path / "lines.txt"
    text.write_bytes(data)
    inputs = [Input(text, "text")]
    (whole,) = chunks(inputs, "text", split_lines=True, chunk_bytes=1 << 30)
    want = _encoded([whole])
    assert want[2] == 3 and len(want[1]) == 8  # three empty lines counted, eight documents
    ends = {i + 1 for i, b in enumerate(data) if b == ord("\n")}  # offsets just past each newline
    edge_last = edge_next = False
    for limit in range(1, 41):
        for block in (1, 7, None):
            pieces = list(chunks(inputs, "text", split_lines=True, chunk_bytes=limit, block_bytes=block))
            assert b"".join(p.data for p in pieces) == data, (limit, block)
            assert all(p.data.endswith(b"\n") for p in pieces if p.data), (limit, block)
            offsets = [0]
            for p in pieces[:-1]:
                offsets.append(offsets[-1] + len(p.data))
            assert set(offsets[1:]) <= ends
            assert [p.first_line for p in pieces] == [1 + data.count(b"\n", 0, at) for at in offsets], (limit, block)
            assert _encoded(pieces) == want, (limit, block)
        edge_last |= any(data[at + limit - 1] == ord("\n") for at in offsets if at + limit <= len(data))
        edge_next |= any(data[at + limit] == ord("\n") for at in offsets if at + limit < len(data))
    assert edge_last and edge_next


def test_jsonl_cut_into_small_chunks_names_the_same_bad_line(tmp_path: Path) -> None:
    """A bad jsonl line deep in a file is named by the same line number whatever the chunk size."""
    writer._init(str(TOKENIZER), int(EOS), "uint16", "text", False)
    os.environ.pop("TOKENIZERS_PARALLELISM")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(DOCS[:30]) + "\n\n{not json\n" + "\n".join(DOCS[30:40]) + "\n")
    for limit in (64, 1000, 4097, 1 << 20):
        errors = [writer.encode_chunk(c).error for c in chunks([Input(bad, "jsonl")], "text", False, chunk_bytes=limit)]
        assert [e for e in errors if e] == [f"{bad}:32: not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                                            "(char 1)); --skip-bad skips such lines"], limit


# -------------------------------------------------------------------- truncated files
@pytest.fixture
def frames(tmp_path: Path) -> tuple[Path, bytes, bytes]:
    """A jsonl.zst of two frames (40 documents each): the file, its first and its second frame."""
    zstandard = pytest.importorskip("zstandard")
    c = zstandard.ZstdCompressor()
    one, two = (c.compress(("\n".join(DOCS[i : i + 40]) + "\n").encode()) for i in (0, 40))
    path = tmp_path / "two.jsonl.zst"
    path.write_bytes(one + two)
    return path, one, two


def test_a_zstd_file_cut_short_is_refused_as_truncated(frames: tuple[Path, bytes, bytes], tmp_path: Path, capsys) -> None:
    path, one, two = frames
    code, lines = _run(capsys, str(path), str(tmp_path / "whole"), *TOK)
    assert code == 0 and json.loads((tmp_path / "whole" / "dataset.json").read_text())["documents"] == 80, lines
    # the second frame cut: refused, with or without --skip-bad (a cut file is no bad line)
    path.write_bytes(one + two[: len(two) // 2])
    size = len(one) + len(two) // 2
    want = [f"portapipe: tokenize: cannot read {path}: truncated: the zstd frame at byte {len(one)} runs past the file's end ({size:,} bytes)"]
    assert _run(capsys, str(path), str(tmp_path / "o1"), *TOK) == (2, want)
    assert _run(capsys, str(path), str(tmp_path / "o2"), *TOK, "--skip-bad") == (2, want)
    # the first frame cut where nothing decompresses yet: truncated, not an empty corpus
    path.write_bytes(one[:20])
    assert _run(capsys, str(path), str(tmp_path / "o3"), *TOK) == (2, [
        f"portapipe: tokenize: cannot read {path}: truncated: the zstd frame at byte 0 runs past the file's end (20 bytes)"])
    # one document per file: a text cut in half is refused too
    zstandard = pytest.importorskip("zstandard")
    text = tmp_path / "play.txt.zst"
    packed = zstandard.ZstdCompressor().compress(("\n".join(DOCS) * 4).encode())
    text.write_bytes(packed[: len(packed) // 2])
    assert _run(capsys, str(text), str(tmp_path / "o4"), *TOK)[0] == 2
    # gzip cut the same way says the same word
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(("\n".join(DOCS) + "\n").encode())[:2000])
    assert _run(capsys, str(gz), str(tmp_path / "o5"), *TOK) == (2, [
        f"portapipe: tokenize: cannot read {gz}: truncated: the gzip stream ends before its end-of-stream marker"])
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_zstd_frames_of_every_shape_read_whole(frames: tuple[Path, bytes, bytes], tmp_path: Path, capsys) -> None:
    """Skippable frames, checksums and frames without a content size read whole; bytes past the
    last frame that are no frame are refused; a cut exactly between frames is a valid file."""
    zstandard = pytest.importorskip("zstandard")
    path, one, two = frames
    skip = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"abcde"
    checked = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(("\n".join(DOCS[80:90]) + "\n").encode())
    path.write_bytes(skip + one + skip + checked + two + skip)
    code, lines = _run(capsys, str(path), str(tmp_path / "all"), *TOK)
    assert code == 0 and json.loads((tmp_path / "all" / "dataset.json").read_text())["documents"] == 90, lines
    path.write_bytes(one + two + b"\0" * 8)
    assert _run(capsys, str(path), str(tmp_path / "tail"), *TOK)[1] == [
        f"portapipe: tokenize: cannot read {path}: no zstd frame at byte {len(one) + len(two)} (it reads 00000000)"]
    path.write_bytes(one)
    code, _ = _run(capsys, str(path), str(tmp_path / "first"), *TOK)
    assert code == 0 and json.loads((tmp_path / "first" / "dataset.json").read_text())["documents"] == 40


def test_the_frame_walk_reads_the_same_fed_in_any_pieces(frames: tuple[Path, bytes, bytes]) -> None:
    from portapipe.data.zstd_frames import FrameWalk

    _, one, two = frames
    for cut in (len(one) + len(two), len(one), len(one) - 1, 3, len(one) + 5):
        blob = (one + two)[:cut]
        verdicts = set()
        for step in (1, 2, 3, 100, len(blob)):
            walk = FrameWalk()
            for i in range(0, len(blob), step):
                walk.feed(blob[i : i + step])
            verdicts.add(walk.problem())
        assert len(verdicts) == 1 and (verdicts.pop() is None) == (cut in (len(one), len(one) + len(two))), cut


# --------------------------------------------------------------------------- links
def test_links_in_a_folder_read_each_real_file_once_and_loops_are_passed_over(tmp_path: Path, capsys) -> None:
    """Four real files, a link back to the folder (a loop) twice over, a second link to a file and
    one to a sibling folder: four inputs (each under the name met first, in path order), one line
    for each link passed over; a glob over it ends."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "twin").mkdir()
    for i, name in enumerate(("a.jsonl", "b.jsonl", "sub/c.jsonl", "twin/d.jsonl")):
        (root / name).write_text(DOCS[i] + "\n")
    (root / "sub" / "loop").symlink_to("..")
    (root / "sub" / "loop2").symlink_to("..")
    (root / "sub" / "z.jsonl").symlink_to("../a.jsonl")
    (root / "sub" / "y").symlink_to("../twin")
    said: list[str] = []
    found = expand([str(root)], said.append)
    assert [p.path.relative_to(root).as_posix() for p in found] == ["a.jsonl", "b.jsonl", "sub/c.jsonl", "sub/y/d.jsonl"]
    real = root.resolve()
    assert said == [
        f"{root / 'sub' / 'loop'} leads back to {root} (a link loop); not followed",
        f"{root / 'sub' / 'loop2'} leads back to {root} (a link loop); not followed",
        f"{root / 'twin'} is {root / 'sub' / 'y'} again ({real / 'twin'}); it is read once",
        f"{root / 'sub' / 'z.jsonl'} is {root / 'a.jsonl'} again ({real / 'a.jsonl'}); it is read once",
    ]
    assert len(expand([str(root / "**" / "*.jsonl")], said.append)) == 4  # two loops: ** does not follow them
    code, lines = _run(capsys, str(root), str(tmp_path / "out"), *TOK)
    meta = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert code == 0 and meta["documents"] == 4 and len(meta["sources"]) == 4
    assert sum("a link loop" in line for line in lines) == 2 and sum("it is read once" in line for line in lines) == 2


def test_a_saved_split_without_rows_is_an_input_without_documents(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    datasets.Dataset.from_dict({"text": ["All the world's a stage"]}).save_to_disk(str(tmp_path / "full"))
    assert _run(capsys, str(tmp_path / "empty"), str(tmp_path / "o1"), *TOK) == (2, [
        "portapipe: tokenize: the corpus is empty: no document in 1 input(s)"])
    code, lines = _run(capsys, str(tmp_path / "empty"), str(tmp_path / "full"), str(tmp_path / "o2"), *TOK)
    meta = json.loads((tmp_path / "o2" / "dataset.json").read_text())
    assert code == 0 and [s["documents"] for s in meta["sources"]] == [0, 1], lines
