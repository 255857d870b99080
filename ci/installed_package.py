"""Install portapipe from its wheel into a fresh virtual environment and use it as a new user would.

1. ``pip wheel --no-deps`` builds the wheel of this checkout;
2. a fresh virtual environment gets torch's CPU build the way ``make`` installs it (``--torch``,
   default the Makefile's ``torch==2.13.0+cpu``, from pip's configured local wheels and indexes),
   then the wheel with its declared dependencies only: no extra;
3. from an empty folder, with that environment's ``bin`` first on PATH: ``portapipe info``,
   ``init`` (the file must equal examples/cpu.yaml), a 5-step ``train`` recording its last step's
   timeline, ``timeline``, ``verify``, ``simulate``, ``profile`` and ``plan``, the benchmarks
   shipped in the package, and four features whose extra is not installed (a chart, TensorBoard,
   the deepseek_v3 starter's token data from the shipped corpus and tokenizer, the timeline's
   picture), which must fail with one line naming the extra.

A command fails the run when its exit code is not the expected one or when stderr holds
anything but portapipe's own lines (``portapipe...`` messages and its progress bars): a
warning or a traceback from any library fails it. Slow (a fresh venv with torch: about 70 s),
so ``.ci/run`` runs it after ``make test`` instead of the test suite.

    python ci/installed_package.py [--torch SPEC] [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What portapipe itself writes to stderr: its messages, and its progress bars (tqdm, by description).
_OWN = re.compile(r"^(portapipe\b|(train|plan): )")


@dataclass(frozen=True)
class Step:
    command: str
    exit_code: int = 0
    stderr_has: str = ""  # a line portapipe must print (for the expected failures)


STEPS = (
    Step("portapipe --version"),
    Step("portapipe info"),
    Step("portapipe init cpu --out c.yaml"),
    Step("portapipe train c.yaml --set train.steps=5 --set 'log.timeline.steps=[5]'"),
    Step("portapipe timeline runs/cpu --step 5"),
    Step("portapipe verify c.yaml"),
    Step("portapipe simulate --schedule dualpipev --pp 4 --microbatches 16"),
    Step("portapipe profile c.yaml --out cpu.json"),
    Step("portapipe plan c.yaml --devices 4 --memory 2GiB --profile cpu.json --out best.yaml"),
    Step("portapipe bench"),
    Step("portapipe bench eplb --layers 2 --experts 16 --replicas 24 --groups 4 --nodes 2 --gpus 8 --repeats 1"),
    # The GPU check's driver and its parts (a folder the package ships beside the scripts), in its
    # dry mode; its progress lines are its own (stderr kept in a file), its table the last output.
    Step("portapipe bench gpu_check --dry --parts a,f --out gc 2> gc.log && grep -q '| f | grouped matmul' gc/gpu_check.md"),
    # The deepseek_v3 starter's token data from an empty folder: the corpus and the tokenizer ship,
    # so the one missing piece named is the extra (tokenize checks its files before the library).
    Step("portapipe init deepseek_v3 --out d.yaml"),
    Step("portapipe tokenize runs/shakespeare-1k", 2, "pip install 'portapipe[data]'"),
    # Extras not installed: one line naming the extra, before anything starts.
    Step("portapipe simulate --schedule 1f1b --pp 2 --microbatches 4 --plot s.png", 2, "pip install 'portapipe[viz]'"),
    Step("portapipe train c.yaml --set log.tensorboard=true --set log.dir=runs/tb", 2, "pip install 'portapipe[tensorboard]'"),
    Step("portapipe timeline runs/cpu --out t.png", 2, "pip install 'portapipe[viz]'"),
)


def foreign_lines(stderr: str) -> list[str]:
    """The stderr lines (progress-bar updates split at carriage returns) that portapipe did not write."""
    return [piece for piece in re.split(r"[\r\n]+", stderr) if piece.strip() and not _OWN.match(piece)]


def problem(step: Step, code: int, stderr: str) -> str:
    """Why this step failed, or "" when it did what it should."""
    if code != step.exit_code:
        return f"exit code {code}, expected {step.exit_code}"
    if step.stderr_has and step.stderr_has not in stderr:
        return f"stderr does not say {step.stderr_has!r}"
    foreign = foreign_lines(stderr)
    return f"stderr holds lines portapipe did not write: {foreign[:3]}" if foreign else ""


def _sh(cmd: list[str]) -> None:
    """Run an install step; its output only when it fails (pip's notes about this machine's indexes are noise)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")


def install(work: Path, torch_spec: str) -> Path:
    """A fresh virtual environment with the wheel of this checkout and its declared dependencies."""
    dist, venv = work / "dist", work / "venv"
    _sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)])
    wheel = next(dist.glob("portapipe-*.whl"))
    _sh([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    if torch_spec:  # as the Makefile does: the CPU build where pip finds it, else pip's default torch
        subprocess.run([*pip, "--only-binary=:all:", torch_spec], capture_output=True)
    _sh([*pip, str(wheel)])
    return venv


def run_steps(venv: Path, folder: Path) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PORTAPIPE_", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    failed = 0
    for step in STEPS:
        t0 = time.monotonic()
        print(f"$ {step.command}", flush=True)
        proc = subprocess.run(["bash", "-c", step.command], cwd=folder, env=env, capture_output=True, text=True)
        why = problem(step, proc.returncode, proc.stderr)
        if not why and step.command.startswith("portapipe init cpu"):
            same = (folder / "c.yaml").read_bytes() == (ROOT / "examples" / "cpu.yaml").read_bytes()
            why = "" if same else "c.yaml differs from examples/cpu.yaml"
        for line in (proc.stdout.strip().splitlines() + [ln for ln in proc.stderr.splitlines() if ln.startswith("portapipe")])[-4:]:
            print(f"    {line[:200]}")
        print(f"    -> {'FAILED: ' + why if why else 'ok'} ({time.monotonic() - t0:.1f} s)", flush=True)
        if why:
            failed += 1
            print(proc.stderr[-3000:], file=sys.stderr)
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch", default="torch==2.13.0+cpu", help="torch requirement installed first, as the Makefile's TORCH_CPU ('' for pip's choice)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (wheel, venv, outputs)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="portapipe-installed-"))
    t0 = time.monotonic()
    try:
        venv = install(work, a.torch)
        took = time.monotonic() - t0
        print(f"wheel built and installed into a fresh venv with its declared dependencies in {took:.0f} s", flush=True)
        (work / "empty").mkdir()
        failed = run_steps(venv, work / "empty")
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"installed package: {len(STEPS) - failed} passed, {failed} failed in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
