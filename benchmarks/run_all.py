"""Every quoted figure in one run: the benchmarks and the README's training examples, on one machine.

Each benchmark runs as its own process with the arguments its README row names, one after the
other (nothing else of ours runs beside it), and the training examples run as a user would run
them, in a temporary folder. One JSON file records the machine (processor, cores, torch, Python,
commit), the load average before and after each entry, its wall time and its JSON output, so
every figure in README.md and docs/ can name the run it came from.

    python benchmarks/run_all.py --out benchmarks/results.json [--only a,b] [--skip a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# one reader of a program's final JSON for both drivers (this folder is on the path as the script's own)
from gpu_check_parts.common import last_json

ROOT = Path(__file__).resolve().parents[1]

#: benchmark -> the arguments of the run its README row quotes; every script beside this one is
#: an entry (tests/test_run_all.py checks it)
BENCHMARKS: dict[str, list[str]] = {
    "schedule_speed": [],
    "schedules_vs_torch": [],
    "step_vs_torch": [],
    "eplb": ["--threads", "1"],
    "eplb_migration": ["--png", "{root}/docs/eplb_migration.png"],  # the plot docs/eplb.md shows
    "lplb": ["--threads", "1"],
    "memory": [],
    "checkpoint": ["--repeats", "5"],
    "plan_accuracy": ["--steps", "8", "--warmup", "2"],
    "precision": ["--steps", "200", "--png", "{root}/docs/precision.png"],  # the README's precision section
    "balance_e2e": ["--steps", "12", "--warmup", "3"],  # docs/balancers-in-training.md's end-to-end table
    "expert_tiles": [],  # docs/executor.md's grouped-matmul layouts
    "mtp": ["--steps", "100"],  # the README's multi-token prediction section
    "fp8": ["--steps", "300"],  # the README's precision section: FP8 against bfloat16
    "lone_overlap": ["--reps", "20"],  # docs/executor.md's lone actions' hidden exchange time
    "balancer_collectives": ["--ep", "4", "--redundant", "1"],  # docs/balancers-in-training.md's replica sum and figure gather
    "validation": ["--rounds", "5"],  # docs/training.md's forward-only validation
    "restart": ["--repeats", "3"],  # the README's When something fails: a restart's time and shares
    "data": [],  # the README's data figures: tokenize vs datasets.map, batch making, a 20 GB corpus, blends, document masking
    "timeline": ["--pairs", "15"],  # docs/timeline.md's cost of recording a step, on and off
}
#: benchmark scripts whose figures come from another machine, with where they run instead
ELSEWHERE: dict[str, str] = {
    "gpu_check": "on a GPU machine (docs/gpu.md); its CPU dry mode runs in make test (tests/test_gpu_check.py)",
}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch  # only for its version; the entries run in their own processes

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def run_command(cmd: list[str], cwd: Path) -> tuple[dict[str, Any], Any]:
    """Run one entry; its record (load before/after, wall time, exit code) and its JSON output."""
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    record: dict[str, Any] = {
        "command": " ".join(cmd),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "exit_code": proc.returncode,
    }
    if proc.returncode != 0:
        record["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return record, None
    try:
        return record, last_json(proc.stdout)
    except ValueError as exc:
        record["error"] = str(exc)
        return record, None


def training_entries(tmp: Path) -> dict[str, list[list[str]]]:
    """The README's training examples (one command list each), writing under ``tmp``."""
    cli = [sys.executable, "-m", "portapipe.cli"]
    tokens = str(tmp / "shakespeare-1k")
    return {
        "train_cpu": [cli + ["train", str(ROOT / "examples" / "cpu.yaml"), "--set", f"log.dir={tmp / 'cpu'}", "--set", "log.progress=false"]],
        "train_deepseek_v3": [
            cli + ["tokenize", tokens],  # the shipped corpus with its tokenizer, as the README's command
            cli + ["train", str(ROOT / "examples" / "deepseek_v3.yaml"), "--set", f"data.path={tokens}", "--set", f"log.dir={tmp / 'deepseek_v3'}"],
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results.json"), help="where the JSON goes [benchmarks/results.json]")
    ap.add_argument("--only", default="", help="comma-separated entries to run (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated entries to leave out")
    ap.add_argument("--list", action="store_true", help="list the entries and exit")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="portapipe-bench-"))
    try:
        entries: dict[str, list[list[str]]] = {
            name: [[sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *(a.format(root=ROOT) for a in extra)]]
            for name, extra in BENCHMARKS.items()
        }
        entries.update(training_entries(tmp))
        if args.list:
            print("\n".join(entries))
            return 0
        only = {n for n in args.only.split(",") if n}
        skip = {n for n in args.skip.split(",") if n}
        unknown = (only | skip) - set(entries)
        if unknown:
            print(f"run_all: unknown entries {sorted(unknown)}; known: {', '.join(entries)}", file=sys.stderr)
            return 2
        chosen = [n for n in entries if (not only or n in only) and n not in skip]
        report: dict[str, Any] = {"machine": machine(), "entries": {}}
        failed = 0
        for i, name in enumerate(chosen, 1):
            print(f"[{i}/{len(chosen)}] {name} ...", file=sys.stderr, flush=True)
            steps = []
            output = None
            for cmd in entries[name]:
                record, output = run_command(cmd, cwd=tmp)
                steps.append(record)
                if record["exit_code"] != 0 or "error" in record:
                    break
            ok = all(s["exit_code"] == 0 and "error" not in s for s in steps)
            failed += not ok
            report["entries"][name] = {"ok": ok, "steps": steps, "result": output}
            print(f"[{i}/{len(chosen)}] {name}: {'ok' if ok else 'FAILED: ' + steps[-1].get('error', '')} ({sum(s['wall_s'] for s in steps):.0f} s)", file=sys.stderr, flush=True)
            # written after every entry, so a long run interrupted keeps what it measured
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({"out": args.out, "entries": len(chosen), "failed": failed}))
        return 1 if failed else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
