"""``portapipe bench [NAME] [ARGS...]``: list or run the benchmarks in ``benchmarks/``.

Each benchmark is a script printing JSON; this command finds the folder (beside the package in
a source checkout, or ``--dir``), lists what is there, or runs one with this interpreter.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any


def benchmark_dir(explicit: str | None = None) -> Path:
    candidates = [Path(explicit)] if explicit else [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[2] / "benchmarks"]
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        "no benchmarks/ folder found (looked in: " + ", ".join(map(str, candidates)) + "); run from a source checkout or pass --dir"
    )


def available(folder: Path) -> dict[str, str]:
    """Benchmark name -> first line of its docstring."""
    out = {}
    for script in sorted(folder.glob("*.py")):
        if script.name.startswith("_"):
            continue
        text = script.read_text()
        doc = ""
        for quote in ('"""', "'''"):
            if quote in text:
                doc = text.split(quote, 2)[1].strip().splitlines()[0]
                break
        out[script.stem] = doc
    return out


def run(args: argparse.Namespace) -> int:
    try:
        folder = benchmark_dir(args.dir)
    except FileNotFoundError as exc:
        print(f"portapipe: {exc}", file=sys.stderr)
        return 2
    names = available(folder)
    if not args.name:
        width = max((len(n) for n in names), default=0)
        for name, doc in names.items():
            print(f"{name:<{width}}  {doc}")
        return 0
    if args.name not in names:
        print(f"portapipe: no benchmark {args.name!r} in {folder}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(folder / f"{args.name}.py"), *args.args])


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="list or run the benchmarks (each prints JSON)")
    p.add_argument("name", nargs="?", help="benchmark to run; omit to list them")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.add_argument("--dir", help="benchmarks folder (default: ./benchmarks or the source checkout's)")
    p.set_defaults(func=run)
