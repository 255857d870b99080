"""benchmarks/run_all.py: every entry runs in turn, and one JSON file records machine, loads and outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def run_all(monkeypatch, bench_module):
    module = bench_module("run_all")
    # A small schedule_speed run stands for the benchmarks; a bad argument for a failing entry.
    monkeypatch.setattr(module, "BENCHMARKS", {"schedule_speed": ["--pp", "4", "--microbatches", "8", "--repeat", "1"]})
    monkeypatch.setattr(module, "training_entries", lambda tmp: {"broken": [[sys.executable, "-c", "import sys; sys.exit('no such thing')"]]})
    return module


def test_last_json_takes_the_final_value_after_progress_lines(run_all) -> None:
    text = 'step 1\n{"partial": \nstep 2\n{"a": 1,\n "b": [1, 2]}\n'
    assert run_all.last_json(text) == {"a": 1, "b": [1, 2]}
    with pytest.raises(ValueError):
        run_all.last_json("no json here\n")


def test_entries_run_in_turn_and_the_file_records_each(run_all, tmp_path, capsys) -> None:
    out = tmp_path / "results.json"
    assert run_all.main(["--out", str(out)]) == 1  # one entry failed
    report = json.loads(out.read_text())
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"]
    good, bad = report["entries"]["schedule_speed"], report["entries"]["broken"]
    assert good["ok"] and good["result"]["pp"] == 4 and good["result"]["microbatches"] == 8
    assert len(good["steps"][0]["load_before"]) == 3 and good["steps"][0]["wall_s"] >= 0
    assert not bad["ok"] and bad["result"] is None and bad["steps"][0]["error"] == "no such thing"
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "entries": 2, "failed": 1}


def test_every_benchmark_script_is_an_entry(bench_module) -> None:
    """A benchmark that run_all does not run has no figure in results.json to quote."""
    module = bench_module("run_all")
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")} - {"run_all"} - set(module.ELSEWHERE)
    assert set(module.ELSEWHERE) <= {p.stem for p in (ROOT / "benchmarks").glob("*.py")}, "ELSEWHERE names a script that is not there"
    assert scripts - set(module.BENCHMARKS) == set(), "benchmarks that run_all.py does not run"
    assert set(module.BENCHMARKS) - scripts == set(), "run_all.py entries without a script"


def test_unknown_entries_are_refused(run_all, tmp_path, capsys) -> None:
    assert run_all.main(["--only", "nope", "--out", str(tmp_path / "r.json")]) == 2
    assert "unknown entries ['nope']" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
