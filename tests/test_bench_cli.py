"""`portapipe bench` lists the benchmark scripts and runs one, passing its arguments."""

from __future__ import annotations

import json
import re
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


# ------------------------------------------------------------------ the benchmarks the package ships
def test_every_benchmark_ships_or_says_why_it_needs_a_checkout() -> None:
    """Each script of benchmarks/ is either shipped in the package (a link to it: one copy) or
    named in CHECKOUT_ONLY with its reason, never both."""
    from portapipe.commands.bench import CHECKOUT_ONLY, shipped_dir

    root = Path(__file__).resolve().parents[1]
    scripts = {p.stem for p in (root / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    shipped = {p.stem for p in shipped_dir().glob("*.py")}
    assert shipped | set(CHECKOUT_ONLY) == scripts and not shipped & set(CHECKOUT_ONLY)
    for name in shipped:
        link = shipped_dir() / f"{name}.py"
        assert link.is_symlink() and link.resolve() == (root / "benchmarks" / f"{name}.py").resolve(), name
    assert "benchmarks/*.py" in (root / "pyproject.toml").read_text()  # package data, so wheels carry them


def test_outside_a_checkout_the_shipped_benchmarks_list_and_run(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from portapipe.commands import bench

    monkeypatch.setattr(bench, "benchmark_dir", lambda explicit=None: bench.shipped_dir())
    assert main(["bench"]) == 0
    out = capfd.readouterr().out
    # names padded to the longest one's width, then the description or why it needs a checkout
    assert "schedule_speed" in out and re.search(r"^lplb +\(needs a source checkout: its peer is scipy's HiGHS", out, re.M)
    assert main(["bench", "run_all"]) == 2
    assert "benchmark 'run_all' needs a source checkout: it writes the checkout's benchmarks/results.json" in capfd.readouterr().err
    assert main(["bench", "schedule_speed", "--pp", "2", "--microbatches", "4", "--repeat", "1"]) == 0
    assert json.loads(capfd.readouterr().out)["benchmark"] == "schedule_speed"
