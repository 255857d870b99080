"""benchmarks/gpu_check.py: every part's code path runs here in the dry mode, so a GPU run is never
spent on a typo; parts run in their own processes under caps, and the JSON and the table are
written after each one. The driver is benchmarks/gpu_check.py; its parts are the modules of
benchmarks/gpu_check_parts/ (imported here by ``bench_module("gpu_check_parts.NAME")``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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
    assert list(report["parts"]) == list("abcdefghijkl") and report["dry"] is True
    bad = {k: (r["status"], r.get("error") or r.get("summary")) for k, r in report["parts"].items() if r["status"] not in ("ok", "dry", "skipped")}
    assert not bad, bad
    # the table is the last thing printed, and the file holds the same
    table = (out / "gpu_check.md").read_text()
    assert proc.stdout.strip().endswith(table.strip().splitlines()[-1])
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and not line.startswith("| part")] == list("abcdefghijkl")
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
    # j: the FP8 GEMM and its agreement with the emulation ran (on the CPU: the emulation itself)
    j = parts["j"]["results"]
    assert j["path"] == "emulated" and j["gemm"][0]["fp8_s"] > 0 and j["within_kit_bounds"] is True
    # j: the FP8 step against the bfloat16 step, every Linear in FP8, both times and their ratio
    step = j["step"]
    assert step["kept_linears"] == [] and step["fp8_linears"] > 0 and step["model"]["dtype"] == "bfloat16"
    assert step["fp8"]["median_step_s"] > 0 and step["bfloat16"]["median_step_s"] > 0
    assert step["fp8_over_bfloat16_step_time"] == step["fp8"]["median_step_s"] / step["bfloat16"]["median_step_s"]
    assert "x); " in parts["j"]["summary"] and parts["j"]["summary"].startswith("step FP8 ")
    # k: a DualPipeV step's timeline recorded on the CPU stand-in (the host clock), every check of the record passed
    k = parts["k"]["results"]
    assert k["train"]["rc"] == 0 and k["record"]["clock"] == "wall" and k["record"]["timeline_rc"] == 0
    assert k["record"]["checks"] == {"causality": [], "actions": [], "trace": [], "time_adds_up": []}
    assert [r["rank"] for r in k["ranks"]] == [0, 1, 2, 3] and "every check passed" in parts["k"]["summary"]
    # l: the host link timed through the backend's copies, the overlap measured, the offloaded step exact
    l_ = parts["l"]["results"]
    assert l_["host_link"]["h2d_gb_s"] > 0 and l_["host_link"]["d2h_gb_s"] > 0 and l_["host_link"]["published_each_way_gb_s"] == 64
    assert set(l_["overlap"]) == {"compute_s", "copies_s", "together_s", "hidden_frac"}
    assert l_["step"]["exact"] is True and l_["step"]["sent_bytes"] > 0
    assert l_["step"]["optimizer_bytes"]["offload"]["master"] == 0 and l_["step"]["optimizer_bytes"]["offload"]["master_host"] > 0
    assert l_["step"]["model_peak"]["offload"] < l_["step"]["model_peak"]["off"]
    # i: the GPU run's benchmarks ran small, ranks pinned where each can have a core, and their JSON
    # held everything the claims are read from
    i = parts["i"]["results"]
    assert i["step_vs_torch"]["result"]["benchmark"] == "step_vs_torch" and i["balance_e2e_ep2"]["result"]["benchmark"] == "balance_e2e"
    assert "json_lacks" not in i and len(i["claims"]) == 7 and all("--pin-cores auto" in i[run]["command"] for run in i["placement_by_run"])
    from portapipe.ranks import pinning

    for run, placed in i["placement_by_run"].items():
        want = pinning.plan("auto", len(placed["cores_by_rank"]))
        assert placed["pinned"] is (want is not None) and (want is None or placed["threads_by_rank"] == [len(c) for c in want]), run


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
    # the suite, open-ended and counted even when cut off, runs last in its call and takes what the others leave
    assert gc.parse_parts("call1") == list("afhjklb") and gc.parse_parts("call2") == list("cedgi")
    assert sorted(gc.parse_parts("call1") + gc.parse_parts("call2")) == gc.parse_parts("all") == list("abcdefghijkl")
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


_FLAKY_TESTS = """
import pathlib


def test_fails_the_first_time():
    seen = pathlib.Path(__file__).with_name("seen")
    first = not seen.exists()
    seen.write_text("1")
    assert not first


def test_always_fails():
    assert False


def test_passes():
    pass
"""


def test_the_suites_failures_run_once_more_and_only_those_that_fail_again_stay_failures(bench_module, tmp_path: Path) -> None:
    gc = bench_module("gpu_check_parts.suite")
    (tmp_path / "test_some.py").write_text(_FLAKY_TESTS)
    py = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    first = subprocess.run([*py, "test_some.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    failed = gc.pytest_counts(first.stdout)["failures"]
    assert failed == ["test_some.py::test_fails_the_first_time", "test_some.py::test_always_fails"], first.stdout
    again = gc.rerun_failures(py, failed, 120, dict(os.environ), tmp_path)
    assert again["flaky"] == ["test_some.py::test_fails_the_first_time"] and again["still_failing"] == ["test_some.py::test_always_fails"]
    assert again["rc"] == 1 and not again["timed_out"]


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


def test_the_last_part_takes_what_the_budget_leaves_and_its_tools_cache_under_out(bench_module, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts before the last keep their caps; the last (the suite, the step claims: both keep what
    they finish) gets the rest of --budget-s, its kill included; Triton and Hypothesis write under --out."""
    gc = bench_module("gpu_check")
    seen: dict[str, tuple[float, float, dict[str, str]]] = {}

    def fake_run(cmd: list[str], timeout_s: float, env: Any = None, cwd: Any = None) -> dict[str, Any]:
        key = cmd[cmd.index("--child") + 1]
        seen[key] = (float(cmd[cmd.index("--cap-s") + 1]), timeout_s, env)
        (tmp_path / "parts" / f"{key}.json").write_text(json.dumps({"part": key, "title": "t", "status": "ok", "results": {}}))
        return {"rc": 0, "timed_out": False, "s": 1.0, "stdout": "", "stderr": ""}

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    # the caller chose no place (a GPU check's part b runs this test with both set to its own)
    for chosen in ("TRITON_CACHE_DIR", "HYPOTHESIS_STORAGE_DIRECTORY"):
        monkeypatch.delenv(chosen, raising=False)
    monkeypatch.setattr(gc, "T0", __import__("time").time())
    gc.drive(["f", "h"], tmp_path, False, 300.0)
    assert seen["f"][0] == gc.BY_KEY["f"].cap_s
    cap, timeout, env = seen["h"]
    assert 250 < cap and cap + gc.CHILD_GRACE_S <= 300 - 5 and timeout == cap + gc.CHILD_GRACE_S
    assert env["TRITON_CACHE_DIR"].startswith(str(tmp_path)) and env["HYPOTHESIS_STORAGE_DIRECTORY"].startswith(str(tmp_path))
    gc.drive(["f", "h"], tmp_path, False, 0.0)  # no budget: every part its own cap
    assert seen["h"][0] == gc.BY_KEY["h"].cap_s
    monkeypatch.setenv("HYPOTHESIS_STORAGE_DIRECTORY", str(tmp_path / "mine"))  # a caller's choice stays
    assert set(gc.caches(tmp_path)) == {"TRITON_CACHE_DIR"}


def _gone(pid: int) -> bool:
    """Ended: no longer in /proc, or a zombie waiting for its parent to reap it."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def busy() -> Any:
    """Two processes burning a core each for the test's length (two cores here: a load of 3 or more)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for b in burners:
        b.kill()
        b.wait()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="processes are tracked through /proc")
def test_a_command_past_its_time_is_killed_with_the_processes_it_detached(bench_module, tmp_path: Path, busy: Any) -> None:
    """A child starts a grandchild in a session of its own, which starts a great-grandchild in
    another with an empty environment: at its time the command goes with all of them, the machine
    busy beside it."""
    common = bench_module("gpu_check_parts.common")
    pids = tmp_path / "pids"
    sleeper = "import time; time.sleep(120)"
    grandchild = ("import subprocess, sys, time; "
                  f"p = subprocess.Popen([sys.executable, '-c', {sleeper!r}], start_new_session=True, env={{}}); "
                  f"open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n'); time.sleep(120)")
    script = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], start_new_session=True); "
              f"open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n'); time.sleep(120)")
    # 10 s: the three have long started when the kill comes, even at a load of 3 on two cores
    res = common.run_cmd([sys.executable, "-c", script], 10.0)
    assert res["timed_out"] and res["s"] < 60 and res["left_running"] == []
    assert res["rc"] == -signal.SIGKILL  # its status collected by the record, not swallowed by the kill
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2 and [pid for pid in started if not _gone(pid)] == []


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="processes are tracked through /proc")
def test_a_command_that_keeps_starting_detached_processes_is_ended_with_every_one(bench_module, tmp_path: Path, busy: Any) -> None:
    """Detached processes started while the kill is under way are found and ended too: none is left
    to start another, and none that was started runs on."""
    common = bench_module("gpu_check_parts.common")
    pids = tmp_path / "pids"
    script = ("import subprocess, sys\n"
              "while True:\n"
              "    p = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
              f"    open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n')\n")
    res = common.run_cmd([sys.executable, "-c", script], 4.0)
    # a survivor would also hold the command's output open, and the record would wait for it
    assert res["timed_out"] and res["s"] < 60 and res["left_running"] == []
    started = [int(line) for line in pids.read_text().split()]
    time.sleep(1.0)  # a spawner that outlived the kill would have added more by now
    assert len(pids.read_text().split()) == len(started) > 0
    assert [pid for pid in started if not _gone(pid)] == []


def test_a_command_carries_a_mark_of_its_own_and_inherits_its_runners(bench_module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable that finds a command's processes: one per command, the runner's own kept."""
    common = bench_module("gpu_check_parts.common")
    monkeypatch.setenv(common.MARK_PREFIX + "outer", "1")
    show = [sys.executable, "-c", f"import os; print(sorted(k for k in os.environ if k.startswith({common.MARK_PREFIX!r})))"]
    first, second = (json.loads(common.run_cmd(show, 60)["stdout"].replace("'", '"')) for _ in range(2))
    assert len(first) == len(second) == 2 and common.MARK_PREFIX + "outer" in first and set(first) & set(second) == {common.MARK_PREFIX + "outer"}


def test_a_part_whose_processes_outlived_its_kill_says_which(bench_module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gc = bench_module("gpu_check")

    def fake_run(cmd: list[str], timeout_s: float, env: Any = None, cwd: Any = None) -> dict[str, Any]:
        return {"rc": -9, "timed_out": True, "s": timeout_s, "stdout": "", "stderr": "", "left_running": [4242],
                "tracking": "process group only (no /proc here): processes that left it were not looked for"}

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    rec = gc.drive(["f"], tmp_path, True, 0.0)["parts"]["f"]
    assert rec["status"] == "timeout" and rec["left_running_after_kill"] == [4242] and rec["tracking"].startswith("process group only")


def test_what_a_part_leaves_running_is_ended_before_the_next_part(tmp_path: Path) -> None:
    """A part that dies leaving a detached process behind (a pytest, a launch): the driver, reaper of
    its orphans, finds and ends it, and the part's record says so."""
    pid_file = tmp_path / "orphan"
    script = f"""
import json, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import gpu_check as gc

out = Path({str(tmp_path)!r})

def fake_run(cmd, timeout_s, env=None, cwd=None):
    key = cmd[cmd.index("--child") + 1]
    if key == "a":  # the part starts a detached process and dies
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        Path({str(pid_file)!r}).write_text(str(p.pid))
    (out / "parts" / f"{{key}}.json").write_text(json.dumps({{"part": key, "title": "t", "status": "ok", "results": {{}}}}))
    return {{"rc": 0, "timed_out": False, "s": 1.0, "stdout": "", "stderr": ""}}

gc.run_cmd = fake_run
gc.adopt_orphans()
report = gc.drive(["a", "f"], out, True, 0.0)
print(json.dumps({{k: r.get("leftover_processes_killed") for k, r in report["parts"].items()}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"a": 1, "f": None}
    orphan = int(pid_file.read_text())
    assert not Path(f"/proc/{orphan}").exists() or Path(f"/proc/{orphan}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_the_step_claims_run_pinned_one_process_each_and_are_judged_against_the_issues_targets(
        bench_module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Part i on a 16-core machine, its benchmarks replaced by their JSON: each run pinned
    (--pin-cores true), 1F1B among the schedules, a run that fails leaves the others recorded,
    DualPipeV's peer missing on an old torch is said, and each claim is met or not."""
    claims, common = bench_module("gpu_check_parts.step_claims"), bench_module("gpu_check_parts.common")
    monkeypatch.setattr(claims, "cores_record", lambda: {"usable": 16, "sets_4_ranks": ["0-3", "4-7", "8-11", "12-15"],
                                                         "threads_per_rank_4": [4] * 4, "sets_8_ranks": ["0-1"] * 8,
                                                         "threads_per_rank_8": [2] * 8})
    placed = {"pin_cores": True, "pinned": True, "cores_by_rank": ["0-3", "4-7", "8-11", "12-15"], "threads_by_rank": [4] * 4}
    step = {"torch_unsupported": {"dualpipev": "torch 2.11's ScheduleDualPipeV fails"}, "placement": placed,
            "interleaved": {"ours_over_torch": 0.8, "a2a_hidden_step_pct": 65.0}, "1f1b": {"ours_over_torch": 0.95, "a2a_hidden_step_pct": 45.0}}
    ep4 = {"layouts": {"ep4": {"placement": placed, "gap_won_back": {"loads:eplb": {"step_time": 0.9}, "loads:lplb": {"step_time": 0.7}}}}}
    calls: list[tuple[list[str], float]] = []

    def fake_run(cmd: list[str], timeout_s: float, env: Any = None, cwd: Any = None) -> dict[str, Any]:
        calls.append((cmd, timeout_s))
        if "pp2ep4" in cmd:  # cut off at its share
            return {"rc": -9, "timed_out": True, "s": timeout_s, "stdout": "", "stderr": "killed"}
        return {"rc": 0, "timed_out": False, "s": 5.0, "stdout": "progress\n" + json.dumps(step if "step_vs_torch.py" in cmd[1] else ep4), "stderr": ""}

    monkeypatch.setattr(claims, "run_cmd", fake_run)
    rec = common.Record(tmp_path / "i.json", "i", "step claims", False)
    claims.part_step_claims(rec, common.Ctx(False, tmp_path, __import__("time").time() + 100))
    assert all(cmd[cmd.index("--pin-cores") + 1] == "true" for cmd, _ in calls) and len(calls) == 3
    assert calls[0][0][calls[0][0].index("--schedules") + 1] == "dualpipev,interleaved,1f1b"
    assert [cmd[cmd.index("--layouts") + 1] for cmd, _ in calls[1:]] == ["ep4", "pp2ep4"]
    assert all(str(tmp_path) in cmd[cmd.index("--out-dir") + 1] for cmd, _ in calls[1:])  # nothing written outside --out
    assert calls[0][1] < 0.45 * 100 and calls[2][1] > calls[1][1] * 0.9  # shares of what is left: the last takes the rest
    r = rec["results"]
    assert r["step_vs_torch"]["result"] == step and r["balance_e2e_pp2ep4"]["timed_out"] and rec["status"] == "failed"
    met = {c["claim"]: c["met"] for c in r["claims"]}
    assert met["interleaved: ours' step over torch's"] is True and met["1f1b: all-to-all hidden over the step, %"] is False
    assert met["dualpipev: ours' step over torch's"] is None and "2.11" in next(c for c in r["claims"] if c["claim"].startswith("dualpipev"))["why_not_measured"]
    assert met["balance_e2e ep4: step-time gap won back by eplb"] is True and met["balance_e2e ep4: step-time gap won back by lplb"] is False
    assert met["balance_e2e pp2ep4: step-time gap won back by eplb"] is None  # listed, with why: the run did not finish
    assert "did not finish" in next(c for c in r["claims"] if c["claim"].startswith("balance_e2e pp2ep4"))["why_not_measured"]
    assert r["placement_by_run"] == {"step_vs_torch": placed, "balance_e2e_ep4": placed} and "json_lacks" not in r
    assert rec["summary"].startswith("step_vs_torch: 4 ranks x 4 cores pinned; balance_e2e_ep4: 4 ranks x 4 cores pinned; claims met 3/5")
    # a key the reading needs that a benchmark's JSON no longer has fails the part (the dry mode shows it)
    found, lacking = claims.claims({"step_vs_torch": {"result": {**step, "interleaved": {"ours_over_torch": 0.8}}}}, ["step_vs_torch"])
    assert lacking == ["step_vs_torch's interleaved has no 'a2a_hidden_step_pct'"]


def test_with_too_few_cores_for_the_step_claims_their_commands_are_still_checked(bench_module, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without a core for each of 8 ranks, part i runs nothing but checks every flag of
    the GPU run's commands against the benchmarks' --help."""
    claims, common = bench_module("gpu_check_parts.step_claims"), bench_module("gpu_check_parts.common")
    monkeypatch.setattr(claims, "cores_record", lambda: {"usable": 4, "sets_8_ranks": None})
    rec = common.Record(tmp_path / "i.json", "i", "step claims", False)
    claims.part_step_claims(rec, common.Ctx(False, tmp_path, __import__("time").time() + 200))
    r = rec["results"]
    assert rec["status"] == "skipped" and "4 usable cores" in rec["reason"], rec
    assert r["step_vs_torch"]["flags_missing"] == r["balance_e2e"]["flags_missing"] == [] and r["step_vs_torch"]["help_rc"] == 0
    assert "--pin-cores true" in r["step_vs_torch"]["command"] and "--layouts ep4" in r["balance_e2e"]["command"]


def test_the_fp8_steps_model_runs_every_linear_in_fp8_where_part_es_would_not(bench_module) -> None:
    """Part j times the FP8 step on part e's architecture with every width a multiple of 128: at the
    GPU run's sizes no Linear stays in bfloat16, where part e's own model keeps its dense FFN
    (10944) and MLA's compressed keys and values (576) out of FP8."""
    from portapipe.config import config_from_dict
    from portapipe.models.fp8_layers import plan

    fp8, speed = bench_module("gpu_check_parts.fp8"), bench_module("gpu_check_parts.speed")
    eligible, kept = plan(config_from_dict(fp8.step_raw(True, "cuda", False)).model)
    assert eligible and not kept, [lin.name for lin in kept]
    _, kept_e = plan(config_from_dict(speed.speed_raw(speed.SPEED_MODELS[-1], "cuda", False)).model)
    assert kept_e
