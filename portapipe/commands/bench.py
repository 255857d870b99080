"""``portapipe bench [NAME] [ARGS...]``: list or run the benchmarks in ``benchmarks/``.

Each benchmark is a script printing JSON; this command finds the folder (``--dir``,
./benchmarks, the source checkout's, or else the copy shipped in the package), lists what is
there, or runs one with this interpreter. The package ships the benchmarks that need nothing but
portapipe (``portapipe/benchmarks``: links to benchmarks/ in a checkout); the others need a
source checkout, and :data:`CHECKOUT_ONLY` says why.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Benchmarks not shipped in the package, and why they need a source checkout.
CHECKOUT_ONLY = {
    "balance_e2e": "its skewed router follows examples/expert_loads.txt of the checkout",
    "precision": "it trains examples/cpu.yaml of the checkout and draws with matplotlib (the viz extra)",
    "lplb": "its peer is scipy's HiGHS, which only the test extra installs",
    "plan_accuracy": "it plans examples/plan/deepseek_v3.yaml of the checkout",
    "mtp": "it trains examples/deepseek_v3.yaml of the checkout on tokens made with its examples/tokenizer",
    "fp8": "it trains examples/deepseek_v3.yaml of the checkout on tokens made with its examples/tokenizer",
    "run_all": "it writes the checkout's benchmarks/results.json from every benchmark and the README's examples",
    "validation": "it trains examples/cpu.yaml of the checkout",
    "restart": "it trains examples/cpu.yaml of the checkout, killing a rank",
    "data": "it trains examples/deepseek_v3.yaml of the checkout and measures Hugging Face datasets (the data extra) as its peer",
    "timeline": "it trains examples/cpu.yaml of the checkout",
}


def shipped_dir() -> Path:
    """The benchmarks shipped inside the package."""
    return Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_dir(explicit: str | None = None) -> Path:
    checkout = Path(__file__).resolve().parents[2] / "benchmarks"
    candidates = [Path(explicit)] if explicit else [Path.cwd() / "benchmarks", checkout, shipped_dir()]
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        "no benchmarks/ folder found (looked in: " + ", ".join(map(str, candidates)) + "); pass --dir"
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
    missing = {n: why for n, why in CHECKOUT_ONLY.items() if n not in names} if folder.resolve() == shipped_dir() else {}
    if not args.name:
        width = max((len(n) for n in [*names, *missing]), default=0)
        for name, doc in names.items():
            print(f"{name:<{width}}  {doc}")
        for name, why in missing.items():
            print(f"{name:<{width}}  (needs a source checkout: {why})")
        return 0
    if args.name in missing:
        print(f"portapipe: benchmark {args.name!r} needs a source checkout: {missing[args.name]}", file=sys.stderr)
        return 2
    if args.name not in names:
        print(f"portapipe: no benchmark {args.name!r} in {folder}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(folder / f"{args.name}.py"), *args.args])


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="list or run the benchmarks (each prints JSON)")
    p.add_argument("name", nargs="?", help="benchmark to run; omit to list them")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.add_argument("--dir", help="benchmarks folder (default: ./benchmarks, the source checkout's, or the package's)")
    p.set_defaults(func=run)
