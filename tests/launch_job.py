"""A small job for the launcher tests, run as its own process: ``python -m tests.launch_job``.

Its ranks run :func:`tests.dist_checks.stepping`; the job prints their results as one JSON line
and exits 0, or prints portapipe's line for a failed or stopped job and exits with its code,
as ``portapipe train`` does.
"""

from __future__ import annotations

import argparse
import json
import sys

from portapipe.ranks.launch import LaunchError, print_launch_error, run_ranks

from . import dist_checks


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("pid_dir")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--poll-stop", action="store_true")
    p.add_argument("--stall", type=float, default=60.0)
    p.add_argument("--grace", type=float, default=60.0)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--pg-timeout", type=float, default=120.0)
    a = p.parse_args()
    try:
        results = run_ranks(
            dist_checks.stepping, a.world, a.pid_dir, a.steps, a.poll_stop, a.step_s, stall_timeout_s=a.stall, stop_grace_s=a.grace, pg_timeout_s=a.pg_timeout
        )
    except LaunchError as err:
        return print_launch_error(err)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
