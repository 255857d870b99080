"""``portapipe`` command line: train | verify | simulate | balance | bench | info | profile | plan.

Each sub-command lives in ``portapipe/commands/<name>.py`` with ``register(subparsers)``,
which adds its parser and sets ``func(args) -> int``. Exit codes: 0 success, 1 a failure
while running, 2 bad input (config, arguments, a backend that cannot run here).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("train", "verify", "simulate", "balance", "bench", "info", "profile", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="portapipe",
        description="DeepSeek-style pipeline and expert parallelism for MoE training on any accelerator.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"portapipe.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"portapipe.commands.{name}":
                raise
            continue  # a command whose module is not part of this build
        module.register(sub)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .config import ConfigError
    from .backends.base import BackendUnavailable

    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        for line in err.problems:
            print(f"portapipe: config error: {line}", file=sys.stderr)
        return 2
    except BackendUnavailable as err:
        print(f"portapipe: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
