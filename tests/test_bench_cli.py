"""`portapipe bench` lists the benchmark scripts and runs one, passing its arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portapipe.cli import main


@pytest.fixture()
def bench_dir(tmp_path: Path) -> Path:
    (tmp_path / "echo_args.py").write_text(
        '"""Echo the arguments as JSON."""\nimport json, sys\nprint(json.dumps({"args": sys.argv[1:]}))\n'
    )
    (tmp_path / "_helper.py").write_text("")
    return tmp_path


def test_lists_benchmarks_with_their_summary(bench_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--dir", str(bench_dir)]) == 0
    out = capsys.readouterr().out
    assert "echo_args  Echo the arguments as JSON." in out
    assert "_helper" not in out


def test_runs_one_and_passes_arguments(bench_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--dir", str(bench_dir), "echo_args", "--size", "3"]) == 0
    assert json.loads(capfd.readouterr().out) == {"args": ["--size", "3"]}


def test_unknown_benchmark_exits_2(bench_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--dir", str(bench_dir), "nope"]) == 2
    assert "echo_args" in capsys.readouterr().err
