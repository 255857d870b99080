"""``portapipe verify CONFIG [--set k=v ...]``: prove a parallel configuration numerically exact.

Runs one step pipelined on pp x dp x ep ranks and the same step in one process, in float64,
and prints one JSON line {schedule, pp, ep, dp, microbatches, loss_diff, max_rel_grad_diff,
ok}. Exit 0 when ok, 1 when the numbers differ or a rank failed (its traceback on stderr),
2 for a config that cannot run (reported before any rank starts).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..launch import LaunchError, print_launch_error
    from ..verify import verify

    config = load_config(args.config, args.set)
    try:
        result = verify(config)
    except LaunchError as err:
        print_launch_error(err)
        return 1
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="one step pipelined vs one process in float64; prints loss and gradient differences as JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. --set parallel.pp=4 (repeatable)"
    )
    p.set_defaults(func=run)
