"""`portapipe tokenize`'s worker processes end with it: kill -9 of the command leaves no worker,
fork server or resource tracker behind, and SIGTERM stops it in one line, exit 143, nothing
written, nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tokenizer"
DOCS = (ROOT / "examples" / "corpus" / "plays.jsonl").read_text().splitlines()

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process, None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every process below ``root``, with its start time (so a reused pid is not taken for it)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
            starts[int(entry.name)] = st[2]
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = starts[pid]
        todo += children.get(pid, [])
    return found


def _running(procs: dict[int, str]) -> list[int]:
    """Those of ``procs`` still running (a zombie, ended but not waited for, runs nothing)."""
    out = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] not in ("Z", "X"):
            out.append(pid)
    return out


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], dict[int, str]]:
    """A 3-worker tokenize of a corpus big enough to keep them busy, once its workers run: (the
    command, every process below it). Its stderr goes to ``tmp_path / "err"`` (a pipe would be
    held open by any process left behind)."""
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(DOCS * 150) + "\n")
    with open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "portapipe.cli", "tokenize", str(big), str(tmp_path / "out"), "--tokenizer",
                                 str(TOKENIZER), "--eos", "187", "--workers", "3", "--no-progress"], stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 180  # a loaded machine starts processes slowly
    below: dict[int, str] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        below = _descendants(proc.pid)
        if len(below) >= 5:  # the resource tracker, the fork server and three workers
            break
        time.sleep(0.05)
    if proc.poll() is not None or len(below) < 5:
        proc.kill()
        _none_left(below)
        pytest.fail(f"the run did not reach three workers: exit {proc.poll()}, processes below it {below}")
    return proc, below


def _none_left(below: dict[int, str], seconds: float = 30.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _running(below)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # the test's own processes: never left behind, whatever it found
        os.kill(pid, signal.SIGKILL)
    return left


def test_kill_9_of_a_3_worker_run_leaves_no_process(tmp_path: Path) -> None:
    proc, below = _start(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _none_left(below) == []
    assert not (tmp_path / "out").exists()


def test_sigterm_stops_a_3_worker_run_in_one_line_with_143(tmp_path: Path) -> None:
    proc, below = _start(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
        left = _none_left(below)
    assert code == 143 and left == []
    assert (tmp_path / "err").read_text().splitlines() == [
        f"portapipe: tokenize: stopped by SIGTERM; nothing was written to {tmp_path / 'out'}"]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
