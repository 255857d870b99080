"""Sub-commands of the ``portapipe`` CLI, one module each (see portapipe/cli.py)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """CONFIG and ``--set KEY.PATH=VALUE`` (repeatable), shared by commands that read a config.
    ``required=False``: CONFIG may be left out (the command says what to do then)."""
    parser.add_argument("config", nargs=None if required else "?", help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value (YAML syntax), e.g. --set parallel.pp=4",
    )


def load_checked_config(args: argparse.Namespace) -> Any:
    """Load and validate the config and make sure its backend can run here.

    Raises ConfigError / BackendUnavailable, which the CLI turns into exit code 2, so bad input
    fails before any rank starts.
    """
    from ..backends.registry import get_backend, resolve_name
    from ..config import ConfigError, load_config
    from ..config.rules import violations
    from ..config.setup import Setup

    cfg = load_config(args.config, args.overrides)
    if cfg.log.level == "debug":
        os.environ["PORTAPIPE_DEBUG"] = "1"  # tracebacks and the launcher's details (portapipe.ranks.launch)
    # Constructing the backend also checks its options (e.g. an EP transport the device lacks).
    try:
        get_backend(cfg.backend, cfg.backend_options)
    except ValueError as exc:  # an option value the backend refuses is bad input, like a config key
        raise ConfigError(str(exc).splitlines()) from None
    if cfg.backend == "auto":  # the rules that read a backend's capabilities, now that the device is known
        problems = violations(Setup.from_config(cfg).replace(backend=resolve_name("auto")), scopes=("backend",))
        if problems:
            raise ConfigError(problems)
    return cfg
