"""``portapipe plan CONFIG --devices N --memory 80GiB``: the fastest setup that fits (without
``--devices``: on the fewest devices it fits on).

Enumerates pp x ep x dp layouts of N devices, the five schedules, micro-batch counts (the
config's global batch kept) and memory options; drops what breaks a compatibility rule or the
memory budget (saying why for your own config); ranks the rest by step time predicted from a
device profile; prints the table (step time, tokens/s, peak memory, bubble, exposed
all-to-all) and writes the best as a complete config.

    portapipe plan examples/cpu.yaml --devices 4 --memory 2GiB --profile cpu.json --out best.yaml
    portapipe plan deepseek.yaml --devices 2048 --memory 80GiB --profile h800 --plot plan.png
    portapipe plan deepseek.yaml --memory 80GiB --profile h800 --allow offload   # the fewest devices, then their plan

Without ``--devices`` the fewest devices (up to ``--most``, default the config's own count) on
which a setup fits ``--memory`` are searched first, by bisection over the counts with a layout;
``--allow offload`` lets a setup keep the optimizer's states and the parts' saved tensors in host
memory where nothing else fits.

``--profile`` is a file from ``portapipe profile`` or a published device (h800); without it a
profile of the config is measured here first. ``--loads`` (a run's expert_loads.json) sets the
expert imbalance, with the config's balancer applied. Exit codes: 0 a plan was printed, 1
nothing fits, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _fail(message: str) -> int:
    print(f"portapipe plan: {message}", file=sys.stderr)
    return 2


def _profile(args: argparse.Namespace, config: Any) -> Any:
    from ..plan.profile import Profile
    from ..plan.published import DEVICES, published
    from ..config.setup import shape_of

    if args.profile and not Path(args.profile).exists() and args.profile in DEVICES:
        return published(args.profile, shape_of(config.model, config.train, config.backend))
    if args.profile:
        return Profile.load(args.profile)
    from ..ranks.launch import run_ranks
    from ..plan.measure import profile_rank

    print(f"no --profile: measuring one for {config.world_size} {config.backend} ranks first (portapipe profile)", file=sys.stderr)
    results = run_ranks(profile_rank, config.world_size, config.to_dict(), 5, 1, backend=config.backend, backend_options=config.backend_options)
    return Profile.from_dict(results[0])  # every rank returns the same profile, as `portapipe profile` reads it


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..plan.imbalance import LoadsError, read_loads
    from ..plan.planner import plan
    from ..plan.profile import ProfileError
    from ..plan.report import best_yaml, nothing_fits, parse_bytes, plot, row, summary, table

    if args.rules:
        from ..config.rules import table as rule_table

        for r in rule_table():
            print(f"{r['name']:<32} {r['scope']:<9} {r['severity']:<6} {r['reason']}")
        return 0
    if args.devices is None and args.memory is None:
        return _fail("--devices or --memory is required: the devices to plan for, or the memory per device to find the fewest devices for")
    if args.devices is not None and args.devices < 1:
        return _fail(f"--devices: {args.devices}; give the number of devices (>= 1)")
    if args.top < 1:
        return _fail(f"--top: {args.top}; show at least 1 row")
    try:
        budget = parse_bytes(args.memory) if args.memory is not None else None
    except ValueError as err:
        return _fail(str(err))
    config = load_config(args.config, args.set)
    from ..config.setup import shape_of
    from ..plan.shape import unmodelled

    shape = shape_of(config.model, config.train, config.backend)
    if (why := unmodelled(shape)) is not None:
        return _fail(why)
    try:
        loads = read_loads(args.loads) if args.loads else None
        profile = _profile(args, config)
        profile.check_shape(shape)
    except (ProfileError, LoadsError) as err:
        return _fail(str(err))
    if loads is not None and len(loads[0]) != config.model.n_experts:
        return _fail(f"--loads: {args.loads} has {len(loads[0])} experts per layer, the model {config.model.n_experts}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("--plot needs matplotlib: pip install 'portapipe[viz]'")
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None and total >= 2000:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="plan", unit="setup", file=sys.stderr, mininterval=0.5, leave=False)
        if bar is not None:
            bar.update(done - bar.n)

    if args.devices is None:
        from ..plan.planner import fewest_devices

        most = args.most or config.world_size
        tried: list[str] = []
        found = fewest_devices(config, budget, profile, tuple(args.allow), most, progress=lambda n, ok: tried.append(f"{n}{'' if ok else ' no'}"))
        print(f"fewest devices: searched {', '.join(tried)}", file=sys.stderr)
        if found is None:
            print(f"portapipe plan: no setup fits {args.memory} per device on {most} devices (--most)", file=sys.stderr)
            return 1
        if not args.json:
            print(f"fewest devices that fit {args.memory} each: {found} (of the counts with a layout up to {most})")
        args.devices = found
    try:
        result = plan(config, args.devices, budget, profile, loads=loads, keep=args.top, progress=progress, allow=tuple(args.allow))
    except ProfileError as err:  # a profile that cannot price what the devices would run
        return _fail(str(err))
    finally:
        if bar is not None:
            bar.close()
    best = result.ranked[0] if result.ranked else None
    if args.json:
        print(json.dumps({
            "devices": args.devices, "memory_bytes": budget, "profile": profile.source, "considered": result.considered,
            "dropped": result.dropped, "ranked": [row(c) for c in result.ranked[: args.top]], "user": row(result.user),
            "notes": result.notes, "closest": None if result.ranked or result.closest is None else row(result.closest),
            "untried": result.untried,
        }))
    else:
        mtp = f" + {config.model.mtp_layers} multi-token prediction module(s) on the last stage" if config.model.mtp_layers else ""
        print(f"model: {config.model.n_layers} layers{mtp}, {config.model.n_experts} experts top-{config.model.top_k}, hidden {config.model.hidden}; "
              f"global batch {result.user.setup.global_batch} sequences of {config.model.seq_len}; profile: {profile.source}")
        for line in summary(result):
            print(line)
        if result.ranked:
            print(table(result, args.top))
    if best is None:
        print(f"portapipe plan: {nothing_fits(result)}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(best_yaml(result, best))
        if not args.json:
            print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="rank schedules, layouts, micro-batch counts and memory options for a device count and memory budget",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config file (its model, batch, balancer and backend are kept)")
    p.add_argument("--devices", type=int, help="devices to plan for (without it: the fewest that fit --memory)")
    p.add_argument("--most", type=int, help="without --devices: the most devices to search up to [the config's own count]")
    p.add_argument("--memory", help="memory per device, e.g. 80GiB (default: no budget)")
    p.add_argument("--profile", help="profile JSON from `portapipe profile`, or a published device: h800")
    p.add_argument("--loads", help="recorded expert loads (a run's expert_loads.json, or a .txt/.csv/.pt file as portapipe balance reads) for the expert imbalance")
    p.add_argument("--out", help="write the best setup as a complete config YAML")
    p.add_argument("--plot", metavar="FILE", help="draw predicted step time against peak memory (.png, .svg, .pdf)")
    p.add_argument("--top", type=int, default=10, help="rows of the table [10]")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--allow", action="append", default=[], choices=["moments_dtype", "offload"],
                   help="let the plan choose this setting too (repeatable): moments_dtype (AdamW's moments in bfloat16 where yours do not fit), "
                   "offload (train.optimizer_offload, then memory.offload too, where nothing else fits)")
    p.add_argument("--rules", action="store_true", help="print the compatibility rules (name, scope, severity, reason) and exit")
    p.set_defaults(func=run)
