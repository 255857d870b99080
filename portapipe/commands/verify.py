"""``portapipe verify CONFIG [--set k=v ...]``: prove a parallel configuration numerically exact.

Runs one step pipelined on pp x dp x ep ranks and the same step in one process, and prints
one JSON line {schedule, pp, ep, dp, microbatches, loss_diff, max_rel_grad_diff, ok,
precision, tolerance}. Where the backend declares float64 compute and communication both run
in float64 and must agree exactly (loss bit for bit, gradients to 1e-12); elsewhere (Ascend)
the pipelined step runs in float32 on the device against a float64 reference on the CPU,
within the tolerance printed (derived from float32 rounding and the model's depth). Exit 0
when ok, 1 when the numbers differ or a rank failed (its traceback on stderr), 2 for a config
that cannot run (reported before any rank starts).
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
        help="one step pipelined vs one process (float64, or float32 where the device has no float64); prints the differences as JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.set_defaults(func=run)
