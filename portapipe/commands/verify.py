"""``portapipe verify CONFIG [--set k=v ...] [--precision highest|model]``: prove a parallel configuration numerically exact.

Runs one step pipelined on pp x dp x ep ranks and the same step in one process, and prints
one JSON line {schedule, pp, ep, dp, microbatches, loss_diff, max_rel_grad_diff, ok,
precision, changed, loss_scale, tolerance, batch} (under ``train.fp8``, fp8_linears: how many
Linears ran in FP8; with ``--precision model``, float64 last). The step runs on a batch
generated from ``train.seed`` (``batch``: its sequences and tokens, with ``data.document_mask``
or ``data.mask_eos_loss`` its documents); the config's data are not read, and where training
would refuse them (a ``data.path`` that does not exist, ids beyond the vocabulary) one line on
stderr says so. A config training refuses for its model, weights (``model.init_from``), FP8
recipe (``train.fp8`` where no Linear can run in FP8) or schedule is refused with training's line. ``--precision highest`` (the default): where the
backend declares float64 compute and communication both run in float64 and must agree exactly
(loss bit for bit, gradients to 1e-12); elsewhere (Ascend) the pipelined step runs in float32 on
the device against a float64 reference on the CPU, within the tolerance printed (derived from
float32 rounding and the model's depth). The master weights and the gradients' reduction run in
that dtype too; each dtype key changed for it is listed in ``changed`` and named on stderr.
``--precision model`` checks the config's own dtypes instead (bfloat16 / float16, the master
dtype, the reduction's dtype, float16's loss scaling) against the one-process step in the same
dtypes and rounding points, within 4 times the noise floor it measures (the same step with its
sums in the reverse order), routing forced by position on both sides; the distance from the
float64 step is printed beside it (``float64``). Exit 0 when ok, 1 when the numbers differ or a rank failed (its traceback on stderr),
2 for a config that cannot run (reported before any rank starts).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import add_config_args, load_checked_config


def run(args: argparse.Namespace) -> int:
    from ..ranks.launch import LaunchError, print_launch_error
    from ..verify import verify

    config = load_checked_config(args)
    data = unread_data_problems(config)
    try:
        result = verify(config, args.precision)
    except LaunchError as err:
        return print_launch_error(err)
    if data:
        print(f"portapipe: verify ran on a generated batch, not on the config's data, which training refuses: {'; '.join(data)}",
              file=sys.stderr)
    if result["changed"]:
        changes = ", ".join(f"{key} {change}" for key, change in result["changed"].items())
        print(f"portapipe: verify checked the pipeline in {result['precision']}, not in the config's dtypes ({changes}); "
              "--precision model checks those", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def unread_data_problems(config: Any) -> list[str]:
    """What training would refuse of the config's data, which verify does not read (its ids are
    not scanned: only what opening the data finds)."""
    from ..data.corpus import data_problems

    return data_problems(config, check_ids=False)


#: portapipe.verify.tolerance.PRECISIONS (not imported here: the CLI starts without torch)
PRECISIONS = ("highest", "model")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="one step pipelined vs one process (float64, or float32 where the device has no float64; "
        "--precision model: the config's own dtypes); prints the differences as JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--precision", choices=PRECISIONS, default="highest",
                   help="highest: float64 where the backend has it, else float32 (default); model: the config's own dtypes")
    p.set_defaults(func=run)
