"""A restart's cost: the time from a fault to the first step after the restart, and its shares.

A run of the config (examples/cpu.yaml: 4 gloo ranks, DualPipeV pp 2 x ep 2) with
``launch.max_restarts: 1`` and no backoff: rank 1 is killed (SIGKILL) after the update of step
``checkpoint.every + 2`` (portapipe.testing.faults); the launcher ends the others and starts the
job again from checkpoint ``checkpoint.every``. The time from the kill to the end of the first step
after it is split into:

- ``detect_s``: the launcher sees the rank gone, ends the others, picks the checkpoint (checking
  its files) and writes the restart row;
- ``launch_s``: the ranks start (from the warm fork server) and connect their process groups;
- ``build_s``: each rank builds its model blocks, optimizer and data;
- ``load_s``: the checkpoint is read into them;
- ``first_step_s``: the first step, with the one-time costs a process's first step pays.

The peer, in the same run: what restarting by hand (or by a SLURM requeue) costs, a new
``portapipe train`` process resuming the same folder from its newest checkpoint, timed from the
process's start to the end of its first step (``cold_resume``). The goal: a restart costs less than
one checkpoint interval of training (``checkpoint.every`` x the run's median step).

Prints one JSON object: the run of median ``fault_to_first_step_s`` over ``--repeats`` runs, its
shares adding up to it (the cold resume likewise).

    python benchmarks/restart.py [--config examples/cpu.yaml] [--repeats 3] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARES = ("detect_s", "launch_s", "build_s", "load_s", "first_step_s")


def _launches(marks: Path) -> list[dict[str, Any]]:
    """Rank 0's notes of each launch (portapipe.testing.faults), in order: the last note of each process."""
    last: dict[int, dict[str, Any]] = {}
    for line in (marks / "launches.jsonl").read_text().splitlines():
        note = json.loads(line)
        last[note["pid"]] = note
    return sorted(last.values(), key=lambda n: n["started"])


def _shares(began: float, note: dict[str, Any]) -> dict[str, float]:
    """A launch's shares from ``began`` (the launcher's restart, or a process's start)."""
    return {"launch_s": note["started"] - began, "build_s": note["restore_began"] - note["started"],
            "load_s": note["restore_done"] - note["restore_began"], "first_step_s": note["first_step_done"] - note["restore_done"]}


def one_run(config_path: str, sets: list[str], folder: Path) -> dict[str, Any]:
    """A run with one kill and its restart, then a cold resume of its folder: their figures."""
    import portapipe.train
    from portapipe.config import load_config
    from portapipe.testing.faults import Fault, faulty, fired

    every = load_config(config_path, sets).checkpoint.every
    if every < 1:
        raise SystemExit("benchmarks/restart.py: checkpoint.every must be >= 1 (a restart resumes from a periodic checkpoint)")
    kill_at, steps = every + 2, every + 3
    run = folder / "run"
    config = load_config(config_path, [*sets, f"log.dir={run}", "log.progress=false", "launch.max_restarts=1",
                                       "launch.restart_backoff_s=0", f"train.steps={steps}"])
    marks = folder / "marks"
    portapipe.train.train_rank = faulty([Fault(1, "update", kill_at)], marks)
    summary = portapipe.train.train(config)
    fault = fired(marks)[0]["time"]
    restart = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"restart"' in line)
    again = _launches(marks)[-1]
    restarted = {"detect_s": restart["time"] - fault, **_shares(restart["time"], again)}
    restarted["fault_to_first_step_s"] = again["first_step_done"] - fault

    cold_marks = folder / "cold"
    began = time.time()
    done = subprocess.run([sys.executable, "-m", "portapipe.testing.faults", "[]", str(cold_marks), "train", config_path,
                           *[x for s in [*sets, f"log.dir={run}", "log.progress=false", f"train.steps={steps + 1}"] for x in ("--set", s)]],
                          cwd=folder, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"benchmarks/restart.py: the cold resume failed: {done.stderr.strip().splitlines()[-1:]}")
    cold_note = _launches(cold_marks)[-1]
    cold = {"process_start_to_first_step_s": cold_note["first_step_done"] - began, **_shares(began, cold_note)}
    return {"every": every, "killed_after_step": kill_at, "resumed_from": restart["step"], "median_step_s": summary["median_step_s"],
            "restart": restarted, "cold_resume": cold}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "cpu.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. checkpoint.every=20")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1")
    load = os.getloadavg()
    runs = []
    for _ in range(args.repeats):
        folder = Path(tempfile.mkdtemp(prefix="portapipe-restart-bench-"))
        try:
            runs.append(one_run(args.config, args.set, folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    middle = sorted(runs, key=lambda r: r["restart"]["fault_to_first_step_s"])[len(runs) // 2]
    restart = middle["restart"]
    cold = sorted((r["cold_resume"] for r in runs), key=lambda c: c["process_start_to_first_step_s"])[len(runs) // 2]
    every, step = runs[0]["every"], statistics.median(r["median_step_s"] for r in runs)
    interval = every * step
    report = {
        "benchmark": "restart",
        "command": "python benchmarks/restart.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "load_average_at_start": load, "load_average_at_end": os.getloadavg()},
        "setup": {"config": args.config, "sets": args.set, "repeats": args.repeats, "checkpoint_every": every,
                  "killed_after_step": runs[0]["killed_after_step"], "resumed_from": [r["resumed_from"] for r in runs]},
        "restart": restart,
        "restart_all_runs_s": [r["restart"]["fault_to_first_step_s"] for r in runs],
        "shares": {k: restart[k] / restart["fault_to_first_step_s"] for k in SHARES},
        "cold_resume": cold,
        "median_step_s": step,
        "checkpoint_interval_s": interval,
        "restart_in_intervals": restart["fault_to_first_step_s"] / interval,
        "goal_met": restart["fault_to_first_step_s"] < interval,
        "cold_over_restart": cold["process_start_to_first_step_s"] / restart["fault_to_first_step_s"],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
