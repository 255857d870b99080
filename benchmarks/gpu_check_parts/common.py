"""What the GPU check's parts share: a part's record and context, child processes (the driver's
parts, `portapipe` commands, pytest) and the CUDA questions asked without making a CUDA context."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: a source checkout (tests/ beside portapipe/); None where the benchmark runs from the package
CHECKOUT = ROOT if (ROOT / "tests").is_dir() and (ROOT / "portapipe").is_dir() else None
T0 = time.time()


def say(msg: str) -> None:
    """A progress line with the time and the seconds since the command started."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the checkout first on the path (children import its code)."""
    env = os.environ.copy()
    if CHECKOUT is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


#: where a process's state and environment can be read (Linux); elsewhere a command's process group is all that is ended
PROC = Path("/proc/self/environ").exists()
#: each command run_cmd starts carries a variable of this prefix and its own token, inherited by
#: whatever it starts (a new session, a double fork, an orphan); nested runners each add their own
MARK_PREFIX = "PORTAPIPE_RUN_MARK_"


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (R, S, D, T, Z, ...), None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running, sleeping or stopped: not gone and not a zombie (ended, waiting to be reaped)."""
    return _state(pid) not in (None, "Z", "X", "x")


def descendants(*roots: int) -> list[int]:
    """Every live process below ``roots`` (children, theirs, ...), read from /proc; empty where there
    is none (zombies, ended and not yet reaped, left out)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # ended meanwhile
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    found, todo, seen = [], list(roots), set(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                found.append(child)
                todo.append(child)
    return found


def marked(mark: str) -> list[int]:
    """Every live process of this user whose environment holds the variable ``mark`` (its
    environment as it started: /proc/PID/environ), this process left out."""
    needle, found = mark.encode() + b"=", []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue  # ended meanwhile, or another user's
            if (env.startswith(needle) or b"\0" + needle in env) and alive(int(entry)):
                found.append(int(entry))
    return found


def kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids``, and reap those that are this process's children (adopted orphans)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(OSError):  # not our child: its own parent reaps it
            os.waitpid(pid, 0)


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def end_command(root: int, mark: str, limit_s: float = 30.0) -> list[int]:
    """End ``root`` and every process it started: those below it, those carrying ``mark`` and those
    below them (a child that cleared its environment). Each round stops all it finds until a new look
    finds no more (a stopped process starts nothing), kills them and waits until each is gone or a
    zombie, then looks again; within ``limit_s`` in all, however busy the machine. Returns the
    processes still alive at the limit (none, but for one stuck in the kernel)."""
    deadline = time.monotonic() + limit_s

    def tracked() -> set[int]:
        roots = {pid for pid in [root, *marked(mark)] if alive(pid)}
        return roots | set(descendants(root, *roots))

    while True:
        seen: set[int] = set()
        while (new := tracked() - seen) and time.monotonic() < deadline:
            _signal(new, signal.SIGSTOP)
            seen |= new
        _signal(seen, signal.SIGKILL)
        while any(alive(pid) for pid in seen) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = sorted(tracked())
        if not left or time.monotonic() >= deadline:
            return left


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (Linux), so that :func:`descendants`
    still finds a grandchild whose parent died (a part killed at its cap, a rank's helper)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def run_cmd(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own session; at ``timeout_s`` it is killed with every process it started,
    found by the variable it carries (:func:`end_command`: those that started sessions of their own
    too: pytest's, a launch's ranks). Where /proc is missing only its process group is killed, and
    the record says so (``tracking``); ``left_running`` names any process that outlived the kill."""
    t0 = time.perf_counter()
    mark = MARK_PREFIX + uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**(env or child_env()), mark: "1"}, cwd=cwd, start_new_session=True)
    extra: dict[str, Any] = {}
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
        timed_out = False
    except subprocess.TimeoutExpired:
        if PROC:  # while proc lives its children are still below it
            extra["left_running"] = end_command(proc.pid, mark)
        else:
            extra["tracking"] = "process group only (no /proc here): processes that left it were not looked for"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)  # collects proc's status
        except subprocess.TimeoutExpired:  # a survivor holds its output open
            proc.wait()
            out, err = "", "its output was not read: a process it started still holds it open"
        timed_out = True
    return {"cmd": " ".join(cmd), "rc": proc.returncode, "timed_out": timed_out, "s": round(time.perf_counter() - t0, 1),
            "stdout": out, "stderr": err, **extra}


def last_json(text: str) -> Any:
    """The last top-level JSON value printed (progress lines may come before it)."""
    decoder = json.JSONDecoder()
    for start in reversed([i for i, ch in enumerate(text) if ch in "{[" and (i == 0 or text[i - 1] == "\n")]):
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if not text[end:].strip():
            return value
    raise ValueError("printed no JSON at its end")


def cli(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`portapipe ARGS` as a child process; its last JSON line as ``json`` when it printed one."""
    res = run_cmd([sys.executable, "-m", "portapipe.cli", *args], timeout_s, env)
    with contextlib.suppress(ValueError):
        res["json"] = last_json(res["stdout"])
    return res


def starter(name: str) -> Path:
    """A starter config shipped with portapipe (examples/NAME.yaml in a checkout)."""
    return Path(str(resources.files("portapipe") / "configs" / f"{name}.yaml"))


def cuda_reason() -> str | None:
    """Why the cuda backend cannot run here, or None (asked without creating a CUDA context)."""
    from portapipe.backends.registry import backend_class

    cls = backend_class("cuda")
    return None if cls.is_available() else cls.unavailable_reason()


def gpu_count() -> int:
    from portapipe.backends.registry import backend_class

    return int(backend_class("cuda").device_count())


def cuda_options(ranks: int) -> dict[str, str]:
    """backend_options for ``ranks`` ranks on this machine: gloo between them where they share GPUs."""
    return {"dist_backend": "gloo"} if ranks > max(1, gpu_count()) else {}


def set_args(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        out += ["--set", f"{key}={value}"]
    return out


class Record(dict):
    """One part's result, written to its file each time :meth:`save` is called. Its ``status``:
    ok, dry, failed, skipped (with a ``reason``), and from the driver timeout, crashed, not run."""

    def __init__(self, path: Path, key: str, title: str, dry: bool) -> None:
        super().__init__(part=key, title=title, status="running", dry=dry, summary="", results={})
        self.path = path

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def put(self, key: str, value: Any) -> None:
        self["results"][key] = value
        self.save()


@dataclass(frozen=True)
class Ctx:
    dry: bool
    work: Path  # this part's scratch folder
    deadline: float  # time.time() by which the part must be done

    def left(self, reserve: float = 5.0) -> float:
        return max(1.0, self.deadline - time.time() - reserve)


def device_time(be: Any, fn: Callable[[], Any], reps: int) -> float:
    """Median of ``reps`` runs of ``fn`` by the backend's timer (device events on a GPU), after one warm-up run."""
    fn()
    be.synchronize()
    times = []
    for _ in range(reps):
        with be.timed() as timer:
            fn()
        times.append(timer.elapsed_s)
    return statistics.median(times)


def one_rank_runtime(backend: Any, raw: dict[str, Any]) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """(a fresh backend of ``backend``'s kind, the runtime of ``raw`` on it, the schedule's
    micro-batches of random tokens from seed 0): what the parts that time or weigh one step start from."""
    import torch

    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict

    config = config_from_dict(raw)
    p = config.parallel
    be = type(backend)(backend.options)
    rt = PipelineRuntime(config, be, be.parallel_groups(p.pp, p.dp, p.ep))
    m, g = raw["model"], torch.Generator().manual_seed(0)
    mbs = []
    for _ in range(rt.schedule.n_microbatches):
        tok = torch.randint(0, m["vocab_size"], (raw["train"]["micro_batch_size"], m["seq_len"] + 1), generator=g)
        mbs.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return be, rt, mbs
