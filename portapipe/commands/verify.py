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

from . import add_config_args, load_checked_config


def run(args: argparse.Namespace) -> int:
    from ..launch import LaunchError, print_launch_error
    from ..verify import verify

    config = load_checked_config(args)
    try:
        result = verify(config)
    except LaunchError as err:
        return print_launch_error(err)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="one step pipelined vs one process in float64; prints loss and gradient differences as JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.set_defaults(func=run)
