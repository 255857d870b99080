"""benchmarks/gpu_check.py: every part's code path runs here in the dry mode, so a GPU run is never
spent on a typo; parts run in their own processes under caps, and the JSON and the table are
written after each one. The driver is benchmarks/gpu_check.py; its parts are the modules of
benchmarks/gpu_check_parts/ (imported here by ``bench_module("gpu_check_parts.NAME")``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(args: list[str], timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    proc = _run(["--dry", "--out", str(out)])
    return proc, json.loads((out / "gpu_check.json").read_text()), out


@pytest.mark.multiproc
@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_prints_the_table_last(dry, bench_module) -> None:
    proc, report, out = dry
    suite, memory, speed = (bench_module(f"gpu_check_parts.{name}") for name in ("suite", "memory", "speed"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(report["parts"]) == list("abcdefghi") and report["dry"] is True
    bad = {k: (r["status"], r.get("error") or r.get("summary")) for k, r in report["parts"].items() if r["status"] not in ("ok", "dry", "skipped")}
    assert not bad, bad
    # the table is the last thing printed, and the file holds the same
    table = (out / "gpu_check.md").read_text()
    assert proc.stdout.strip().endswith(table.strip().splitlines()[-1])
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and not line.startswith("| part")] == list("abcdefghi")
    # progress lines carry the time and the seconds since the start
    assert "[" in proc.stderr and "s] a: environment" in proc.stderr
    parts = report["parts"]
    # a: the environment is read whatever the machine; b: the commands ran (collect only) and were parsed
    assert parts["a"]["results"]["environment"]["torch"] and "portapipe_info" in parts["a"]["results"]
    b = parts["b"]["results"]
    assert b["cuda_marked"]["collected"] >= 1 and b["conformance_kit"]["collected"] >= 10 and b["suite"]["rc"] == 0
    assert suite.CONFORMANCE_KIT in b["conformance_kit"]["command"]
    # c: the verification ran on the CPU stand-in, and a schedule the rules refuse at one rank is named so
    rows = parts["c"]["results"]["one_rank"]
    assert [r["ok"] for r in rows if "ok" in r] == [True, True]
    assert any("dualpipe" in r["config"] and "even" in r["not_applicable"] for r in rows if "not_applicable" in r)
    # the GPU run's configs pass the rules: every schedule at 4 ranks and the five options; at one rank all but DualPipe
    planned = parts["c"]["results"]["gpu_configs"]
    assert [k for k, v in planned.items() if v != "accepted"] == ["dualpipe x1"] and len(planned) == 15, planned
    assert set(parts["g"]["results"]["gpu_model"]) == set(memory.MEMORY_OPTIONS)
    # d: a resumed run on the same device is the straight run bit for bit
    d = parts["d"]["results"]
    assert d["cpu_then_cpu"]["max_rel_loss_diff"] == 0.0 and d["cpu_then_cpu"]["steps_compared"] == 4
    assert d["bf16_val_loss_rel_gap"] is not None
    # e: the sizing arithmetic ran for every candidate, largest first, and the FLOPs convention is stated
    e = parts["e"]["results"]
    planned = [c["planned_bytes"] for c in e["sizing"]["candidates"]]
    assert planned == sorted(planned, reverse=True) and len(planned) == len(speed.SPEED_MODELS)
    assert "6 x active parameters" in e["flops"]["convention"] and e["result"]["peak_tflops"] == speed.PEAK_BF16_TFLOPS
    assert e["portapipe"]["tokens_per_s"] > 0 and e["transformers"]["tokens_per_s"] > 0
    # f, g, h: measured on the CPU stand-in; h's answer equals the CPU path's
    assert all(r["grouped_s"] > 0 and r["dense_s"] > 0 for r in parts["f"]["results"]["rows"])
    assert set(parts["g"]["results"]["rows"]) == set(memory.MEMORY_OPTIONS)
    assert parts["h"]["results"]["result"]["equal_to_cpu_path"] is True
    # i: the benchmarks' own --help lists every flag the GPU run passes
    assert parts["i"]["results"]["step_vs_torch"]["flags_missing"] == [] and parts["i"]["results"]["balance_e2e"]["flags_missing"] == []


def test_the_planned_model_of_part_e_fits_an_80_gb_gpu_and_the_deepest_does_not(bench_module) -> None:
    """The arithmetic that sizes part e's model: bf16 weights with float32 master and AdamW."""
    memory, speed = bench_module("gpu_check_parts.memory"), bench_module("gpu_check_parts.speed")
    need = [memory.memory_need(speed.speed_raw(m, "cuda", False))["total"] for m in speed.SPEED_MODELS]
    budget = 0.85 * 80 * 2**30
    assert need[0] > budget and any(n <= budget for n in need)
    fits = next(n for n in need if n <= budget)
    assert fits >= 0.6 * budget  # fills the GPU, not a corner of it


def test_parts_are_chosen_by_letters_ranges_and_calls(bench_module) -> None:
    gc = bench_module("gpu_check")
    assert gc.parse_parts("a,b") == ["a", "b"]
    assert gc.parse_parts("c-i") == list("cdefghi")
    assert gc.parse_parts("call1") == list("abfh") and gc.parse_parts("call2") == list("cedgi")
    assert sorted(gc.parse_parts("call1") + gc.parse_parts("call2")) == gc.parse_parts("all") == list("abcdefghi")
    # each call's caps fit about 6 minutes
    for call in ("call1", "call2"):
        assert sum(gc.BY_KEY[k].cap_s for k in gc.parse_parts(call)) <= 380, call
    with pytest.raises(ValueError, match="parts are a, b, c"):
        gc.parse_parts("z")


def test_pytest_output_is_counted(bench_module) -> None:
    gc = bench_module("gpu_check_parts.suite")
    out = "FAILED tests/test_x.py::test_a - AssertionError: no\nERROR tests/test_y.py::test_b\n3 failed, 10 passed, 2 skipped, 1 error in 4.0s\n"
    counts = gc.pytest_counts(out)
    assert (counts["failed"], counts["passed"], counts["skipped"], counts["error"]) == (3, 10, 2, 1)
    assert counts["failures"] == ["tests/test_x.py::test_a", "tests/test_y.py::test_b"]
    assert gc.pytest_counts("14/44 tests collected (30 deselected) in 2.2s")["collected"] == 14
    cut = gc.pytest_counts("..F.s. [ 10%]\n..E\n")  # killed before its summary line
    assert (cut["passed"], cut["failed"], cut["skipped"], cut["error"], cut["cut_off"]) == (6, 1, 1, 1, True)


def test_a_bad_part_or_budget_exits_2_and_a_spent_budget_runs_nothing(tmp_path: Path) -> None:
    proc = _run(["--parts", "x", "--out", str(tmp_path / "o")], timeout=120)
    assert proc.returncode == 2 and "--parts: 'x'" in proc.stderr and not (tmp_path / "o").exists()
    proc = _run(["--budget-s", "-1", "--out", str(tmp_path / "o")], timeout=120)
    assert proc.returncode == 2 and "--budget-s" in proc.stderr
    proc = _run(["--dry", "--parts", "a,f", "--budget-s", "1", "--out", str(tmp_path / "spent")], timeout=120)
    report = json.loads((tmp_path / "spent" / "gpu_check.json").read_text())
    assert [r["status"] for r in report["parts"].values()] == ["not run", "not run"] and proc.returncode == 0
    assert "budget" in report["parts"]["a"]["reason"]


def test_a_part_that_fails_or_dies_is_recorded_and_the_next_part_runs(bench_module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gc = bench_module("gpu_check")
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], timeout_s: float, env: Any = None, cwd: Any = None) -> dict[str, Any]:
        key = cmd[cmd.index("--child") + 1]
        calls.append(cmd)
        path = tmp_path / "parts" / f"{key}.json"
        if key == "a":  # died after writing its first result
            path.write_text(json.dumps({"part": "a", "title": "environment", "status": "running", "results": {"environment": {}}}))
            return {"rc": -11, "timed_out": False, "s": 1.0, "stdout": "", "stderr": "Segmentation fault"}
        if key == "f":  # ran past its cap
            path.write_text(json.dumps({"part": "f", "title": "t", "status": "running", "results": {"rows": [1]}}))
            return {"rc": -9, "timed_out": True, "s": 30.0, "stdout": "", "stderr": ""}
        path.write_text(json.dumps({"part": key, "title": "t", "status": "failed", "error": "Traceback ...", "results": {}}))
        return {"rc": 0, "timed_out": False, "s": 2.0, "stdout": "", "stderr": ""}

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    report = gc.drive(["a", "f", "h"], tmp_path, True, 0.0)
    parts = report["parts"]
    assert [parts[k]["status"] for k in "afh"] == ["crashed", "timeout", "failed"]
    assert "Segmentation fault" in parts["a"]["error"] and parts["a"]["results"] == {"environment": {}}
    assert parts["f"]["results"] == {"rows": [1]}  # what it finished is kept
    assert len(calls) == 3 and all("--dry" in c for c in calls)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["parts"]["h"]["status"] == "failed" and "| h |" in (tmp_path / "gpu_check.md").read_text()
