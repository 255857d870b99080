"""Second round of attacks on launching a run: the oneDNN line only where it changes something,
a symbolic link loop as log.dir named as one, a stop signal before the ranks' handlers are in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import portapipe.ranks.launch
from portapipe.ranks import cpu_isa
from portapipe.checkpoint.folders import writable_problems
from portapipe.cli import main
from portapipe.config import config_from_dict

from .test_cpu_isa import machine  # noqa: F401  (a CPU listing AMX, a verdict cache of its own)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu.yaml"
AMX_LINE = "this CPU advertises AMX but a process that uses it dies (SIGILL)"


class _NoRanks:
    """The local launcher with the ranks' training replaced by a summary (the cap comes before it)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def run(self) -> list[dict[str, float]]:
        return [{"final_loss": 2.5}]


@pytest.mark.parametrize("dtype, said", [("float32", False), ("float64", False), ("bfloat16", True)])
def test_the_onednn_cap_is_said_only_for_a_run_that_computes_in_bfloat16(
    machine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dtype: str, said: bool  # noqa: F811
) -> None:
    (machine / "verdict").write_text("traps\n")
    monkeypatch.setenv(cpu_isa.ENV, "")
    monkeypatch.delenv(cpu_isa.ENV)  # recorded, so the cap set below is undone after the test
    monkeypatch.setattr(portapipe.ranks.launch, "LocalJob", _NoRanks)
    assert main(["train", str(EXAMPLE), "--set", f"log.dir={machine / 'run'}", "--set", f"model.dtype={dtype}"]) == 0
    err = capsys.readouterr().err
    assert (AMX_LINE in err) is said, err
    assert cpu_isa.os.environ[cpu_isa.ENV] == cpu_isa.BELOW_AMX  # set either way: harmless where it changes nothing


def _config(log_dir: Path):
    return config_from_dict({"log": {"dir": str(log_dir)}})


def test_a_symbolic_link_loop_as_log_dir_is_named_as_a_loop(tmp_path: Path) -> None:
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    a, b = tmp_path / "a", tmp_path / "b"
    assert writable_problems(_config(a)) == [f"log.dir: {str(a)!r} is a loop of symbolic links ({a} -> {b} -> {a}); point it at a folder"]
    assert writable_problems(_config(a / "run")) == [
        f"log.dir: {str(a / 'run')!r} lies under {str(a)!r}, which is a loop of symbolic links ({a} -> {b} -> {a}); point it at a folder"
    ]


def test_a_symbolic_link_to_nothing_is_named_and_one_to_a_folder_is_followed(tmp_path: Path) -> None:
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert writable_problems(_config(tmp_path / "dangling")) == [
        f"log.dir: {str(tmp_path / 'dangling')!r} is a symbolic link to {str(tmp_path / 'gone')!r}, which does not exist; "
        "create that folder or point it elsewhere"
    ]
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    assert writable_problems(_config(tmp_path / "link" / "run")) == []
    assert (tmp_path / "real" / "run" / "checkpoints").is_dir()


# ----------------------------------------------------------------- a stop before the ranks run
@pytest.fixture
def handlers():
    """The process's SIGINT / SIGTERM handlers, as they were before the test, checked after it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield saved
    now = {s: signal.getsignal(s) for s in saved}
    for s, h in saved.items():
        signal.signal(s, h)
    assert now == saved, "portapipe train left its stop handlers installed"


def test_a_stop_before_the_ranks_start_ends_the_run_with_one_line_and_starts_no_rank(
    handlers, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import portapipe.train
    from portapipe.ranks import local_job

    checked = portapipe.train.check_before_launch

    def check_then_ctrl_c(config):
        checked(config)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the config and data are checked

    def no_start(self):
        raise AssertionError("ranks were started after the stop")

    monkeypatch.setattr(portapipe.train, "check_before_launch", check_then_ctrl_c)
    monkeypatch.setattr(local_job.LocalJob, "_start", no_start)
    assert main(["train", str(EXAMPLE), "--set", f"log.dir={tmp_path / 'run'}"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["portapipe: stopped by SIGINT before the ranks started: nothing was trained"]


def slow_text(text: str) -> str:
    time.sleep(1.5)
    return text


class SlowToUnpickle(str):
    """A rank's argument that takes 1.5 s to unpickle: the rank is then started but has no handlers yet."""

    def __reduce__(self):
        return (slow_text, (str(self),))


_SIGNAL_AT_START = """
import json, os, signal, sys
from portapipe.ranks import local_job
from portapipe.ranks.launch import LaunchError, print_launch_error, run_ranks
from tests import dist_checks
from tests.test_attacks_launch2 import SlowToUnpickle
started = local_job.LocalJob._start
def start(self):
    store = started(self)
    os.kill(os.getpid(), signal.SIGTERM)  # the ranks exist but are still unpickling their function
    return store
local_job.LocalJob._start = start
try:
    print(json.dumps(run_ranks(dist_checks.stepping, 2, SlowToUnpickle(sys.argv[1]), 1000, True, 0.02, stop_grace_s=60)))
except LaunchError as err:
    sys.exit(print_launch_error(err))
"""


def test_a_stop_while_the_ranks_start_reaches_them_once_their_handlers_are_in_place(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PORTAPIPE_DEBUG", None)
    out = subprocess.run([sys.executable, "-c", _SIGNAL_AT_START, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr.strip()) == (0, ""), out.stderr[-3000:]
    results = json.loads(out.stdout)
    assert [r["stopped"] for r in results] == [signal.SIGTERM] * 2 and results[0]["steps"] == results[1]["steps"] < 1000


# ------------------------------------------------------------------- a rank that stops progressing
def busy_from(backend, busy_rank: int, at_step: int) -> int:
    """Steps of a sleep and an all-reduce, each marked as progress; ``busy_rank`` busy-loops at ``at_step``
    (its heartbeat thread goes on beating)."""
    import torch
    import torch.distributed as dist

    from portapipe.ranks import lifeline

    flag = torch.ones(1)
    for step in range(10_000):
        if dist.get_rank() == busy_rank and step == at_step:
            while True:
                pass
        time.sleep(0.02)
        backend.all_reduce(flag)
        lifeline.mark_progress()
    return 0


def test_a_rank_that_busy_loops_while_beating_is_named_as_stalled_by_its_progress() -> None:
    from portapipe.ranks.launch import LaunchError, run_ranks

    with pytest.raises(LaunchError) as err:  # the collective's timeout (120 s) would end it otherwise
        run_ranks(busy_from, 3, 1, 8, stall_timeout_s=4.0, pg_timeout_s=120.0, wall_timeout_s=180.0)  # 4 s: no false stall under load
    line = str(err.value)
    assert line.startswith("rank 1 stalled: step 9 has taken ") and line.endswith(
        "(its heartbeat went on: a busy loop or a step that never ends); every rank was ended"), line
    assert err.value.rank == 1 and 4.0 <= float(line.split()[7]) < 15  # named within seconds of the limit


def _beat(steps: int, cpu: float, at: float, median: float, done: bool = False):
    from portapipe.ranks.lifeline import Beat

    return Beat(0, steps, done, cpu, at, median)


def test_the_progress_watch_waits_for_a_median_and_names_the_rank_burning_cpu() -> None:
    from portapipe.ranks.lifeline import PROGRESS_FACTOR, ProgressWatch

    watch = ProgressWatch(2)
    watch.update(0, _beat(1, cpu=0.1, at=1.0, median=0.0))
    assert watch.stalled(1000.0, [0, 1], floor_s=1.0) is None  # no median yet: nothing to compare with
    watch.update(0, _beat(4, cpu=0.45, at=1.3, median=0.1))  # rank 0 then waits in a collective
    watch.update(1, _beat(4, cpu=0.4, at=1.35, median=0.1))
    watch.update(1, _beat(4, cpu=2.3, at=1.35, median=0.1))  # rank 1 spins
    limit = PROGRESS_FACTOR * 0.1  # 2 s, above the floor of 1 s
    assert watch.stalled(1.3 + limit - 0.01, [0, 1], floor_s=1.0) is None
    assert watch.stalled(1.3 + limit + 0.02, [0, 1], floor_s=1.0) is None  # rank 0 is over, but rank 1 spins: wait for it
    rank, line = watch.stalled(1.35 + limit + 0.01, [0, 1], floor_s=1.0)
    assert rank == 1 and line.startswith("rank 1 stalled: step 5 has taken 2.0 s, 20 times the run's median step of 0.1 s, and used 1.9 s of CPU")
    assert watch.stalled(1.35 + 5.0, [0, 1], floor_s=10.0) is None  # the stall timeout is the floor
    watch.update(1, _beat(4, cpu=2.3, at=1.35, median=0.1, done=True))
    assert watch.stalled(100.0, [0, 1], floor_s=1.0)[0] == 0  # a rank past its last step is not watched


def test_a_rank_times_its_own_steps_the_first_excepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from portapipe.ranks import lifeline

    for name, value in (("_steps", 0), ("_done", False), ("_last", 0.0), ("_durations", [])):
        monkeypatch.setattr(lifeline, name, value)
    # a first step ending at 10 s (the start before it), then 4 more; the fourth waits 5 s for a checkpoint
    clock = iter([10.0, 10.5, 10.7, 10.75, 15.75, 15.8, 16.2])
    monkeypatch.setattr(lifeline.time, "monotonic", lambda: next(clock))
    for step in range(5):
        if step == 3:
            with lifeline.untimed():
                assert lifeline.Beat.decode(lifeline._beat()).done  # not watched meanwhile
        lifeline.mark_progress(last=step == 4)
    beat = lifeline.Beat.decode(lifeline._beat())
    assert (beat.steps, beat.done) == (5, True) and beat.last_step_at == pytest.approx(16.2)
    assert beat.median_s == pytest.approx(0.3)  # median of 0.5, 0.2, 0.1, 0.4: the wait left out


# ------------------------------------------------------------------------ the launcher killed
def test_killing_the_launcher_under_load_ends_every_process_of_the_job_within_2_s(tmp_path: Path) -> None:
    """kill -9 of the launcher while every core is busy: its ranks, fork server and resource
    tracker are gone well within the 5 s promised."""
    from .test_attacks_launch import Job, alive, descendants

    job = Job(tmp_path, world=2)
    job.rank_pids()
    others = descendants(job.proc.pid)
    assert len(others) >= 3  # 2 ranks and the fork server (and its resource tracker)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)  # the load is on
        t0 = time.monotonic()
        job.proc.kill()
        job.proc.wait()
        while any(alive(p) for p in others) and time.monotonic() - t0 < 5.0:
            time.sleep(0.02)
        took = time.monotonic() - t0
    finally:
        for b in burners:
            b.kill()
            b.wait()
    left = [p for p in others if alive(p)]
    assert not left and took < 2.0, f"{left} still running {took:.1f} s after the launcher was killed"


def test_the_fork_servers_tie_does_nothing_when_imported_elsewhere() -> None:
    code = ("import ctypes, portapipe.ranks.forkserver_tie; v = ctypes.c_int(-1); "
            "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)")  # 2: PR_GET_PDEATHSIG
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "0", out.stderr
