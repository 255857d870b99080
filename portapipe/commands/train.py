"""``portapipe train CONFIG [--set KEY=VALUE ...] [--steps N]``: the training job.

Checks the config, backend, data, schedule and any checkpoint to resume before a rank starts
(a problem exits 2), then starts ``world_size`` ranks. A progress bar goes to stderr, one JSON
line per step to ``<log.dir>/metrics.jsonl``, and one JSON summary line to stdout. A failing
rank stops every rank; its traceback is printed and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import add_config_args, load_checked_config


def run(args: argparse.Namespace) -> int:
    from ..launch import LaunchError, print_launch_error
    from ..train import train

    if args.steps is not None:
        args.overrides = [*args.overrides, f"train.steps={args.steps}"]
    config = load_checked_config(args)
    try:
        summary = train(config)
    except LaunchError as err:
        return print_launch_error(err)
    print(json.dumps(summary), file=sys.stdout, flush=True)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="train the configured MoE model with the configured schedule")
    add_config_args(p)
    p.add_argument("--steps", type=int, metavar="N", help="train N steps in all (same as --set train.steps=N)")
    p.set_defaults(func=run)
