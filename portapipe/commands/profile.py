"""``portapipe profile CONFIG [--out P]``: measure what each part of the model costs here.

Runs a few forward and backward passes on the configured backend (the config's ranks) and
writes a profile JSON (per part forward / input-gradient / weight-gradient time per token,
all-to-all, point-to-point and all-reduce latency and time per byte, saved bytes per part and
memory option, the device, torch version and model shape). ``portapipe plan --profile P``
reads it. ``--published h800`` builds one from published figures instead, without running.

Exit codes: 0 written, 1 a rank failed, 2 bad input (config, arguments).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..config.setup import shape_of

    config = load_config(args.config, args.set)
    if args.reps < 1 or args.warmup < 0:
        print(f"portapipe profile: --reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}", file=sys.stderr)
        return 2
    if (problem := out_problem(Path(args.out))) is not None:  # said before measuring, not after
        print(f"portapipe profile: {problem}", file=sys.stderr)
        return 2
    if args.published:
        from ..plan.published import published

        try:
            prof = published(args.published, shape_of(config.model, config.train, config.backend))
        except ValueError as err:
            print(f"portapipe profile: {err}", file=sys.stderr)
            return 2
        prof.save(args.out)
        print(f"wrote {args.out} ({prof.source})")
        return 0
    from ..ranks.launch import LaunchError, print_launch_error, run_ranks
    from ..plan.measure import profile_rank
    from ..plan.profile import Profile

    try:
        results = run_ranks(
            profile_rank, config.world_size, config.to_dict(), args.reps, args.warmup,
            backend=config.backend, backend_options=config.backend_options, wall_timeout_s=args.timeout,
        )
    except LaunchError as err:
        print_launch_error(err)
        return 1
    prof = Profile.from_dict(results[0])
    prof.save(args.out)
    print(f"wrote {args.out}: {config.world_size} {prof.device['backend']} ranks, parts timed on {prof.device['ep_profiled']}")
    if (note := fp8_note(config)) is not None:
        print(note)
    return 0


def out_problem(out: Path) -> str | None:
    """Why the profile cannot be written to ``out`` (a folder, or in a folder that does not exist), or None."""
    if out.is_dir():
        return f"--out: {str(out)!r} is a folder; give the profile file to write, e.g. {out / 'profile.json'}"
    if not out.parent.is_dir():
        return f"--out: the folder {str(out.parent)!r} does not exist; make it first or write the profile elsewhere"
    return None


def fp8_note(config: Any) -> str | None:
    """Under ``train.fp8``, what the profile measured of the FP8 GEMMs and what it could not."""
    from ..config.setup import declared_capabilities

    if config.train.fp8 == "off":
        return None
    kinds = {caps.fp8_matmul for _, caps in declared_capabilities(config.backend)}
    if kinds == {"blockwise"}:
        return "train.fp8: the FP8 GEMMs were timed with the backend's blockwise FP8 kernel where the device has it (else its emulation)"
    return ("train.fp8: the FP8 GEMMs were timed as this backend runs them, emulated (capabilities.fp8_matmul: "
            f"{', '.join(sorted(kinds))}): what a device's FP8 tensor cores take cannot be measured here; "
            "a published profile (--published h800) prices them at that device's FP8 peak")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="measure per-part compute, communication and memory costs on this backend (JSON for `portapipe plan`)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config file (its backend, ranks and model shape are profiled)")
    p.add_argument("--out", default="profile.json", help="profile file to write [profile.json]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement [5]")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first [1]")
    p.add_argument("--timeout", type=float, default=1800.0, help="wall-clock limit per rank, seconds [1800]")
    p.add_argument("--published", metavar="DEVICE", help="build the profile from published figures (h800) instead of measuring")
    p.set_defaults(func=run)
