"""``portapipe train CONFIG [--set KEY=VALUE ...] [--steps N]``: the training job.

Checks the config, backend, data, schedule, the run folder and any checkpoint to resume before a
rank starts (a problem exits 2), prints the rules table's notes on keys set away from their
defaults (``portapipe: note: ...``: a setting that runs but does nothing or wastes something),
then starts ``world_size`` ranks. A progress bar goes to stderr, one JSON line per step to
``<log.dir>/metrics.jsonl``, and one JSON summary line to stdout.
Exit codes: 0 done; 1 a rank failed (its traceback is printed), after ``launch.max_restarts``
restarts where it allows them; 2 bad input; 3 the run diverged:
the loss or the gradient norm stopped being finite (the run stopped at that step), float16 skipped
train.max_skipped_steps steps in a row, the weights or the validation loss are not finite (one
line says which; with restarts, once it recurred at the same step after one); 130 / 143
stopped by SIGINT / SIGTERM after a checkpoint (one line says which; the same command resumes).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from . import add_config_args, load_checked_config

DIVERGED = 3


def run(args: argparse.Namespace) -> int:
    from ..ranks.stop import recording

    # From the start: a stop asked for before the ranks run is not lost (no rank starts, or they stop after a step).
    with recording():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ..ranks.launch import LaunchError, launching_rank, print_launch_error
    from ..config.rules import user_notes
    from ..ranks.stop import exit_code
    from ..train import train

    if args.config is None:
        print("portapipe: train needs a config file; `portapipe init` writes a starter one "
              "(portapipe init cpu --out my.yaml; portapipe init --list shows the others)", file=sys.stderr)
        return 2
    if args.steps is not None:
        args.overrides = [*args.overrides, f"train.steps={args.steps}"]
    config = load_checked_config(args)
    if launching_rank() == 0:  # under torchrun / mpirun rank 0 speaks for the job
        from ..models.fp8_layers import fp8_note

        for note in [*user_notes(config), fp8_note(config.model, config.train.fp8)]:
            if note:
                print(f"portapipe: note: {note}", file=sys.stderr, flush=True)
    try:
        summary = train(config)
    except LaunchError as err:
        return print_launch_error(err)
    # Under torchrun / mpirun every rank runs this command: rank 0 speaks for the job, as the local launcher does.
    speaks = launching_rank() == 0
    if speaks:
        print(json.dumps(summary, allow_nan=False), file=sys.stdout, flush=True)
    if "stopped" in summary:
        s = summary["stopped"]
        if speaks:
            print(f"portapipe: stopped by {s['signal']} after step {s['step']}; checkpoint {s['checkpoint']} (the same command resumes)",
                  file=sys.stderr, flush=True)
        return exit_code(signal.Signals[s["signal"]])
    if "diverged" in summary:
        d = summary["diverged"]
        if speaks:
            what = d.get("reason") or (f"loss {_figure(d['loss'])}, gradient norm {_figure(d['grad_norm'])}; that step was not "
                                       "applied and no checkpoint was written of it")
            if d.get("deterministic"):  # launch.max_restarts: the restart from the last checkpoint diverged there again
                what += "; it recurred at that step after a restart from the last checkpoint: the divergence is deterministic, not a fault"
            key = d.get("lr_key", "train.lr")  # the setting that gave the step its learning rate
            hint = f"lower {key}" if config.train.grad_clip > 0 else f"lower {key} or turn train.grad_clip on (it is 0: off)"
            print(
                f"portapipe: training stopped at step {d['step']}: {what} (last checkpoint: {summary['checkpoint'] or 'none'}); {hint}",
                file=sys.stderr,
                flush=True,
            )
        return DIVERGED
    return 0


def _figure(x: float | None) -> str:
    """A diverged row's loss or gradient norm: the number, or null (JSON's for a value that is not finite)."""
    return "not finite" if x is None else f"{x:g}"


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="train the configured MoE model with the configured schedule")
    add_config_args(p, required=False)  # without one, train points at `portapipe init`
    p.add_argument("--steps", type=int, metavar="N", help="train N steps in all (same as --set train.steps=N)")
    p.set_defaults(func=run)
