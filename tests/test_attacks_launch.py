"""The launcher attacked with real processes: a rank killed or stopped, the launcher killed,
SIGINT / SIGTERM. Each case ends within its bound, names the cause in one line, leaves nothing
running; a stop is forwarded once and the ranks' results come back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portapipe.config import LaunchConfig
from portapipe.ranks.local_job import LaunchError, choose_cause

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu.yaml"
pytestmark = pytest.mark.multiproc


class Job:
    """``python -m tests.launch_job``: 4 ranks stepping (sleep + all-reduce), each writing its pid."""

    def __init__(self, tmp_path: Path, *args: str, world: int = 4) -> None:
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        self.world = world
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("PORTAPIPE_DEBUG", None)
        cmd = [sys.executable, "-m", "tests.launch_job", str(self.pid_dir), "--world", str(world), *args]
        # Its own session, as a job started from a shell is: a signal to its group reaches no one else.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def rank_pids(self, timeout: float = 90.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = [self.pid_dir / f"rank{r}.pid" for r in range(self.world)]
            if all(f.is_file() for f in files):
                return [int(f.read_text()) for f in files]
            assert self.proc.poll() is None, self.proc.communicate()
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"ranks did not start within {timeout} s")

    def finish(self, timeout: float = 60.0) -> tuple[int, str, list[str], float]:
        """Exit code, stdout, stderr lines, and when the first stderr line came (monotonic; the
        job's verdict, printed before the interpreter winds down) or the exit if none came."""
        assert self.proc.stderr is not None
        first = self.proc.stderr.readline()
        said = time.monotonic()
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, (first + err).strip().splitlines(), said


def alive(pid: int) -> bool:
    """Running, i.e. present and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for c in map(int, children):
            out += [c, *descendants(c)]
    return out


def test_a_rank_killed_with_sigkill_is_named_with_its_signal_not_its_peers(tmp_path: Path) -> None:
    job = Job(tmp_path, "--step-s", "0")  # the peers sit in all-reduces: they see the broken connections
    pids = job.rank_pids()
    time.sleep(0.3)
    t0 = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    code, out, lines, said = job.finish()
    assert (code, lines, out) == (1, ["portapipe: rank 2 was killed by SIGKILL"], "")
    assert said - t0 < 2.0, said - t0
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("stall, pg_timeout", [(2.0, 120.0), (30.0, 3.0)])
def test_a_stopped_rank_is_named_by_its_heartbeat_and_the_job_ends(tmp_path: Path, stall: float, pg_timeout: float) -> None:
    """With the heartbeat limit first, or with its peers' collectives timing out first: either
    way the stopped rank is named, not the peers that waited for it."""
    job = Job(tmp_path, "--stall", str(stall), "--pg-timeout", str(pg_timeout))
    pids = job.rank_pids()
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        code, out, lines, said = job.finish()
    finally:
        os.kill(pids[1], signal.SIGCONT) if alive(pids[1]) else None
    elapsed = said - t0
    assert code == 1 and out == "" and len(lines) == 1, lines
    assert lines[0].startswith("portapipe: rank 1 stalled: no heartbeat for "), lines
    limit = "(launch.stall_timeout_s = 2)" if stall < pg_timeout else "while its peers timed out waiting for it"
    assert lines[0].endswith(f"{limit} and its process is stopped (SIGSTOP or a debugger); every rank was ended"), lines
    first = min(stall, pg_timeout)
    assert first - 0.25 <= elapsed < first + 4.0, elapsed  # its last beat came up to 0.2 s before the stop
    assert not any(alive(p) for p in pids)


def test_the_default_stall_timeout_is_at_most_60_s() -> None:
    import inspect

    from portapipe.ranks.launch import run_ranks

    assert 0 < LaunchConfig().stall_timeout_s <= 60
    assert 0 < inspect.signature(run_ranks).parameters["stall_timeout_s"].default <= 60


def test_killing_the_launcher_ends_every_rank_and_the_fork_server_within_5_s(tmp_path: Path) -> None:
    run = tmp_path / "run"
    small = ["parallel.ep=1", "model.hidden=32", "model.seq_len=16", "train.micro_batch_size=2"]  # 2 ranks, quick steps
    cmd = [sys.executable, "-m", "portapipe.cli", "train", str(EXAMPLE), "--set", f"log.dir={run}", "--set", "train.steps=100000",
           "--set", "log.progress=false", "--set", "checkpoint.every=5", *(x for s in small for x in ("--set", s))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    others = descendants(launcher.pid)
    assert len(others) >= 3  # 2 ranks and the fork server (and its resource tracker)
    t0 = time.monotonic()
    launcher.kill()
    launcher.wait()
    while any(alive(p) for p in others) and time.monotonic() - t0 < 5.0:
        time.sleep(0.05)
    left = [p for p in others if alive(p)]
    assert not left, f"still running 5 s after the launcher was killed: {left}"
    steps = metrics.read_text().count("\n")
    time.sleep(1.0)
    assert metrics.read_text().count("\n") == steps  # nobody trains headless


def test_sigterm_is_forwarded_and_the_ranks_results_come_back(tmp_path: Path) -> None:
    job = Job(tmp_path, "--poll-stop", "--grace", "30")
    job.rank_pids()
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    code, out, lines, _ = job.finish()
    assert (code, lines) == (0, []), lines
    results = json.loads(out)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["stopped"] for r in results} == {signal.SIGTERM} and len({r["steps"] for r in results}) == 1
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("how", ["group", "everyone"])
def test_a_signal_the_ranks_also_received_is_not_delivered_twice(tmp_path: Path, how: str) -> None:
    """Ctrl-C in a terminal signals the launcher's process group; a batch system's stop signals
    every process of the job. Neither may reach a rank twice (twice means: end at once)."""
    job = Job(tmp_path, "--poll-stop", "--grace", "30")
    pids = job.rank_pids()
    sig = signal.SIGINT if how == "group" else signal.SIGTERM
    if how == "group":
        os.killpg(job.proc.pid, sig)
    else:
        for pid in [job.proc.pid, *pids]:
            os.kill(pid, sig)
    code, out, lines, _ = job.finish()
    assert (code, lines) == (0, []), lines
    assert {r["stopped"] for r in json.loads(out)} == {sig}


def test_ranks_that_do_not_stop_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    job = Job(tmp_path, "--grace", "1")  # these ranks never ask whether to stop
    pids = job.rank_pids()
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    code, out, lines, said = job.finish()
    assert (code, lines) == (143, ["portapipe: stopped by SIGTERM, but the ranks did not finish within launch.stop_grace_s = 1 s and were killed"])
    assert 1.0 <= said - t0 < 3.0, said - t0
    assert not any(alive(p) for p in pids)


def test_a_second_signal_ends_the_ranks_at_once(tmp_path: Path) -> None:
    job = Job(tmp_path, "--grace", "60")
    pids = job.rank_pids()
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    job.proc.send_signal(signal.SIGINT)
    code, out, lines, said = job.finish()
    assert (code, lines) == (130, ["portapipe: stopped by a second SIGINT: the ranks were ended at once, without a checkpoint"])
    assert said - t0 < 2.5, said - t0
    assert not any(alive(p) for p in pids)


def _dies_of_sigill_on_rank_1(backend: object) -> None:
    import resource

    import torch.distributed as dist

    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.kill(os.getpid(), signal.SIGILL)
    dist.barrier()


def test_a_rank_killed_by_sigill_is_named_with_the_likely_cause_and_the_way_out(tmp_path, monkeypatch, capsys) -> None:
    from portapipe.ranks import cpu_isa
    from portapipe.ranks.launch import print_launch_error, run_ranks

    monkeypatch.setattr(cpu_isa, "CPUINFO", tmp_path / "no-cpuinfo")  # the launcher's own cap stays out of this
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    with pytest.raises(LaunchError) as info:
        run_ranks(_dies_of_sigill_on_rank_1, 2)
    assert print_launch_error(info.value) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "portapipe: rank 1 was killed by SIGILL: a CPU can advertise an instruction set that a process may not use "
        "(e.g. AMX in some virtual machines); ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 keeps oneDNN below AMX"
    ]
    monkeypatch.setenv(cpu_isa.ENV, "AVX512_CORE_BF16")  # set already: a lower level is the way out
    assert str(choose_cause({}, [(1.0, 0, -signal.SIGILL, "")], 600)).endswith("ONEDNN_MAX_CPU_ISA is AVX512_CORE_BF16 here: set it lower")


def test_the_cause_is_a_ranks_own_error_then_a_death_then_a_peers_connection_error() -> None:
    comm = {"time_ns": 1, "error": "RuntimeError: Connection closed by peer", "traceback": "tb1", "comm": True}
    own = {"time_ns": 5, "error": "ValueError: boom", "traceback": "tb2", "comm": False}
    killed = [(10.0, 3, -signal.SIGKILL, "")]
    assert str(choose_cause({0: comm, 2: own}, killed, 600)) == "rank 2 failed: ValueError: boom"
    assert str(choose_cause({0: comm}, killed, 600)) == "rank 3 was killed by SIGKILL"
    assert str(choose_cause({0: comm, 1: {**comm, "time_ns": 0}}, [], 600)) == "rank 1 failed: RuntimeError: Connection closed by peer"
    stalled = LaunchError("rank 3 stalled: no heartbeat for 2.0 s", rank=3)
    assert choose_cause({0: comm}, [], 600, stalled=stalled) is stalled  # its peers' timeouts are not the cause
    assert str(choose_cause({0: comm}, killed, 600, stalled=stalled)) == "rank 3 was killed by SIGKILL"
    watchdog = choose_cause({}, [(1.0, 1, 1, "Thread 0x1 (most recent call first):")], 30)
    assert (str(watchdog), watchdog.rank) == ("rank 1 exceeded its wall-clock limit of 30 s (its stacks were dumped)", 1)
    assert isinstance(watchdog, LaunchError)
