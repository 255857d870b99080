"""``portapipe`` command line: init | train | verify | simulate | balance | bench | info | checkpoints | export | tokenize | profile | plan | timeline.

Each sub-command lives in ``portapipe/commands/<name>.py`` with ``register(subparsers)``,
which adds its parser and sets ``func(args) -> int``. Exit codes: 0 success, 1 a failure
while running, 2 bad input (config, arguments, a backend that cannot run here), 130 / 143 a
job stopped by SIGINT / SIGTERM. Whatever goes wrong, the user sees one line per problem; the
traceback of an unexpected error only with ``log.level: debug`` or ``PORTAPIPE_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import typing
from collections.abc import Callable

COMMANDS = ("init", "train", "verify", "simulate", "balance", "bench", "info", "checkpoints", "export", "tokenize", "profile", "plan", "timeline")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with a mistake said in one line and a pointer to ``--help`` instead of
    the usage text (which buries the error among the options)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nportapipe: see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    return guarded(lambda: args.func(args))


def guarded(run: Callable[[], int | None]) -> int:
    """``run()``'s exit code, with every error turned into one line and its exit code (2 bad
    input, 1 a failure, 130 interrupted); for the CLI and the benchmark scripts alike."""
    from .config import ConfigError
    from .backends.base import BackendUnavailable

    try:
        return int(run() or 0)
    except ConfigError as err:
        for line in err.problems:
            print(f"portapipe: config error: {line}", file=sys.stderr)
        return 2
    except BackendUnavailable as err:
        print(f"portapipe: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("portapipe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (e.g. `| head`): nothing left to say to anyone.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as err:
        return _unexpected(err)


def _unexpected(err: Exception) -> int:
    """An error nobody anticipated: one line, and the traceback only when debugging."""
    from .ranks.launch import DEBUG_HINT, LaunchError, debug_enabled, print_launch_error

    if isinstance(err, LaunchError):
        return print_launch_error(err)
    if debug_enabled():
        traceback.print_exc()
    text = " ".join(str(err).split()) or "(no message)"
    print(f"portapipe: {type(err).__name__}: {text}; {DEBUG_HINT}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
