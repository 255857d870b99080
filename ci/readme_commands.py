"""Run the README's shell commands in the order written, as a newcomer on a fresh clone would.

The commands are read from the README's ```bash code blocks (so the README cannot rot without
this failing) and run one by one with bash in a temporary folder that mirrors the checkout
(symbolic links to its files and its .venv), so every output (runs/, plots) lands there and the
checkout stays clean. ``.venv/bin`` comes first on PATH, as the README says after ``make install``.
A command fails the run when it exits non-zero or prints a Python traceback.

    python ci/readme_commands.py [--readme README.md] [--skip "make test"] [--list]

``--skip`` names commands run elsewhere (``.ci/run`` runs ``make test`` just before this).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\s*$(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
#: What a checkout holds that the commands may write to; never linked into the mirror.
_OUTPUTS = {"runs", ".git", ".pytest_cache"}


def commands(readme: str) -> list[str]:
    """The commands of the README's shell code blocks, in order (comments and blank lines dropped,
    lines continued with a backslash joined)."""
    out = []
    for block in _BLOCK.findall(readme):
        pending = ""  # a command continued with a trailing backslash
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if pending:
                line = f"{pending} {line}"
                pending = ""
            if line.endswith("\\"):
                pending = line[:-1].rstrip()
            elif line and not line.startswith("#"):
                out.append(line)
        if pending:
            out.append(pending)
    return out


def bare(cmd: str) -> str:
    """The command without its trailing shell comment."""
    return re.sub(r"\s+#.*$", "", cmd).strip()


def mirror(root: Path, into: Path) -> None:
    """Link every top-level entry of the checkout into ``into`` (outputs excepted)."""
    for entry in root.iterdir():
        if entry.name not in _OUTPUTS:
            (into / entry.name).symlink_to(entry)


def run(cmds: list[str], root: Path, keep: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="portapipe-readme-"))
    mirror(root, work)
    env = {**os.environ, "PATH": f"{root / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    failed = 0
    total = time.monotonic()
    try:
        for cmd in cmds:
            t0 = time.monotonic()
            print(f"$ {cmd}", flush=True)
            proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            took = time.monotonic() - t0
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            problem = f"exit code {proc.returncode}" if proc.returncode else ("a traceback" if "Traceback (most recent call last)" in proc.stderr else "")
            for line in tail:
                print(f"    {line[:200]}")
            print(f"    -> {'FAILED: ' + problem if problem else 'ok'} ({took:.1f} s)", flush=True)
            if problem:
                failed += 1
                print(proc.stderr, file=sys.stderr)
    finally:
        if keep:
            print(f"outputs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"README commands: {len(cmds) - failed} passed, {failed} failed in {time.monotonic() - total:.0f} s")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--skip", action="append", default=[], help="a command (exactly as written) run elsewhere")
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder with the outputs")
    a = p.parse_args()
    cmds = commands(Path(a.readme).read_text())
    unknown = [s for s in a.skip if s not in map(bare, cmds)]
    if unknown:
        print(f"--skip names commands the README does not have: {unknown}", file=sys.stderr)
        return 2
    cmds = [c for c in cmds if bare(c) not in a.skip]
    if a.list:
        print("\n".join(cmds))
        return 0
    return run(cmds, ROOT, a.keep)


if __name__ == "__main__":
    sys.exit(main())
