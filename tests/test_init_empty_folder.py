"""`portapipe init` and what it says next, from an empty folder outside a checkout: the
deepseek_v3 starter's token data is made by the command its comment gives (the corpus and the
tokenizer ship in the package); a folder given as --out is refused in one line."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest

import portapipe
from portapipe.cli import main
from portapipe.config import load_config
from portapipe.data.shipped import DEFAULT_CORPUS
from portapipe.train import check_before_launch

ROOT = Path(__file__).resolve().parents[1]


def _commands(config_text: str) -> list[list[str]]:
    """The portapipe commands a config's comment gives (lines `#   portapipe ...`)."""
    return [shlex.split(m) for m in re.findall(r"^#\s+(portapipe .+)$", config_text, flags=re.M)]


def test_the_corpus_and_the_tokenizer_ship_in_the_package() -> None:
    """Inside portapipe/ and matched by its package data, so a wheel carries them."""
    from portapipe.data.shipped import SHIPPED_TOKENIZER

    package = Path(portapipe.__file__).parent
    data = re.search(r"^\[tool\.setuptools\.package-data\]\n(?:#.*\n)*portapipe = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    patterns = re.findall(r'"([^"]+)"', data.group(1))
    for path in (DEFAULT_CORPUS, SHIPPED_TOKENIZER):
        assert path.is_file(), path
        inside = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(inside, p) for p in patterns), (inside, patterns)
    assert SHIPPED_TOKENIZER.read_bytes() == (ROOT / "examples" / "tokenizer" / "tokenizer.json").read_bytes()  # one copy


def test_deepseek_v3_from_an_empty_folder_its_comment_makes_the_data_and_it_is_ready_to_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tokenizers")
    monkeypatch.chdir(tmp_path)
    assert main(["init", "deepseek_v3"]) == 0
    hint = capsys.readouterr().out.splitlines()[1]
    assert hint == ("next: write its token data runs/shakespeare-1k (the comment at the top of deepseek_v3.yaml says how), "
                    "then: portapipe train deepseek_v3.yaml")
    commands = _commands((tmp_path / "deepseek_v3.yaml").read_text())
    assert commands == [["portapipe", "tokenize", "runs/shakespeare-1k"], ["portapipe", "train", "deepseek_v3.yaml"]]
    assert main(commands[0][1:]) == 0  # no path of a checkout in it
    config = load_config("deepseek_v3.yaml", [f"log.dir={tmp_path / 'run'}"])
    check_before_launch(config)  # the dataset exists and fits the model: `portapipe train deepseek_v3.yaml` would start
    assert (tmp_path / "runs" / "shakespeare-1k" / "dataset.json").is_file()


def test_tokenize_without_text_takes_the_shipped_pair_and_own_text_needs_its_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "mine.txt"
    text.write_text("some text of my own\n")
    assert main(["tokenize", str(text), str(tmp_path / "o.bin")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"portapipe: tokenize: --tokenizer is needed for {text}: name the tokenizer its token data is for "
        "(leave INPUT out for the shipped corpus and its tokenizer)"
    ]
    assert not (tmp_path / "o.bin").exists()


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_init_into_a_folder_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], force: list[str]) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    assert main(["init", "cpu", "--out", str(folder), *force]) == 2
    assert capsys.readouterr().err.splitlines() == [f"portapipe: init: --out {folder} is a folder; name a file, e.g. {folder / 'cpu.yaml'}"]
    assert list(folder.iterdir()) == []
