"""``portapipe simulate``: price a schedule with the cost model, show its timeline.

    portapipe simulate --schedule dualpipe --pp 8 --microbatches 20 --cost F=1,B=2,W=1,FB=2.5
    portapipe simulate --schedule dualpipev --pp 4 --microbatches 10 --json
    portapipe simulate --schedule dualpipe --pp 8 --microbatches 20 --plot dualpipe.png

Costs are per action (one virtual stage), in the DualPipe paper's terms: F a forward, B a
backward, W the weight-gradient part of B, FB an overlapped F&B unit, p2p the latency of one
transfer. The timeline and the chart use the same letters: a backward split in two is a B cell
(its input-gradient part, B-W) and a W cell; a backward run whole is an X cell (B).
The lists simulated are the lowered ones (with SEND/RECV), i.e. what the executor runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def run(args: argparse.Namespace) -> int:
    from ..scheduling.comms import lower_comms
    from ..scheduling.plot import LEGEND, check_chart_path, gantt, text_timeline, to_json_timeline
    from ..scheduling.schedules import build, without_w_split
    from ..scheduling.simulate import Costs, bubble_formula, simulate
    from ..scheduling.validate import validate

    try:
        costs = Costs.parse(args.cost)
        schedule = build(args.schedule, args.pp, args.microbatches, args.chunks)
        if args.layers_per_stage:
            costs.stage_scale = stage_scale(args.layers_per_stage, schedule)
            costs.__post_init__()
        if args.plot:
            check_chart_path(args.plot)
    except (ValueError, TypeError) as err:
        print(f"portapipe simulate: {err}", file=sys.stderr)
        return 2
    if args.no_w_split:
        schedule = without_w_split(schedule)
    lowered = lower_comms(schedule)
    validate(lowered)
    result = simulate(lowered, costs)
    # the closed forms hold for equal stages only
    formula = None if costs.stage_scale and len(set(costs.stage_scale)) > 1 else bubble_formula(args.schedule, args.pp, costs, args.chunks)
    summary: dict[str, Any] = {
        "schedule": args.schedule,
        "pp": args.pp,
        "microbatches": args.microbatches,
        **({"chunks": args.chunks} if args.schedule == "interleaved" else {}),
        "w_split": not args.no_w_split,
        "costs": costs.to_dict(),
        "makespan": result.makespan,
        "bubble": {"per_rank": result.bubble, "max": result.max_bubble},
        "bubble_formula": {"formula": formula[0], "value": formula[1]} if formula else None,
        "peak_activations": result.peak_activations,
        "params_per_rank": result.params_per_rank,
    }
    try:
        timeline = None if args.json else text_timeline(result, args.width)
    except ValueError as err:
        print(f"portapipe simulate: --width: {err}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            gantt(result, args.plot, title=_title(summary))
        except OSError as err:  # e.g. a read-only folder, a full disk
            print(f"portapipe simulate: cannot write a chart to {args.plot!r}: {err.strerror or err}", file=sys.stderr)
            return 2
        summary["plot"] = args.plot
    if args.json:
        if args.timeline:
            summary["timeline"] = to_json_timeline(result)
        print(json.dumps(summary))
        return 0
    print(_title(summary))
    print(timeline)
    print(LEGEND)
    per_rank = ", ".join(f"{b:g}" for b in result.bubble)
    print(f"makespan {result.makespan:g}; bubble max {result.max_bubble:g} (per rank: {per_rank})")
    if formula:
        print(f"closed form {formula[0]} = {formula[1]:g}")
    print(f"peak activations per rank: {result.peak_activations}; params per rank: {result.params_per_rank:g}x")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def stage_scale(text: str, schedule: Any) -> list[float]:
    """``--layers-per-stage 3,4,4,2``: each model block's layers (``parallel.layers_per_stage``), as
    each virtual stage's cost relative to a block of the mean size (F, B and W are that block's)."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--layers-per-stage: {text!r} is not a comma-separated list of layer counts") from None
    if len(counts) != schedule.n_blocks:
        raise ValueError(f"--layers-per-stage: {len(counts)} entries; {schedule.name} with pp={schedule.n_ranks} has {schedule.n_blocks} model blocks")
    if min(counts) < 1:
        raise ValueError("--layers-per-stage: every block needs a layer to be priced (a block of the embedding or the head alone: "
                         "give it the share of a layer its work is)")
    mean = sum(counts) / len(counts)
    return [counts[b] / mean for b in schedule.stage_block]


def _title(summary: dict[str, Any]) -> str:
    c = summary["costs"]
    return (
        f"{summary['schedule']}: pp={summary['pp']}, microbatches={summary['microbatches']}"
        + (f", chunks={summary['chunks']}" if "chunks" in summary else "")
        + f"; F={c['F']:g} B={c['B']:g} W={c['W']:g} FB={c['FB']:g} p2p={c['p2p']:g}; bubble {summary['bubble']['max']:g}"
    )


def register(sub: Any) -> None:
    from ..scheduling.schedules import NAMES

    p = sub.add_parser("simulate", help="simulate a pipeline schedule: timeline, bubble, activations")
    p.add_argument("--schedule", required=True, choices=NAMES)
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--chunks", type=int, default=2, help="model chunks per rank (interleaved)")
    p.add_argument(
        "--cost", default="F=1,B=2,W=1",
        help="per-action costs, e.g. F=1,B=2,W=1,FB=2.5,p2p=0: F forward, B a backward (a whole one: an X cell; "
        "split, its B cell costs B-W), W its weight-gradient part, FB an overlapped F&B unit, p2p one transfer",
    )
    p.add_argument("--no-w-split", action="store_true", help="run every backward whole (X cells, no B/W split)")
    p.add_argument(
        "--layers-per-stage", metavar="N,N,...",
        help="layers of each model block (parallel.layers_per_stage): each stage's costs scale with its layers over the mean "
        "(F, B, W are a mean block's); the closed-form bubble is then not given",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the timeline")
    p.add_argument("--timeline", action="store_true", help="with --json: include every action's start and end")
    p.add_argument("--plot", metavar="FILE", help="write a Gantt chart (.png, .svg, .pdf)")
    p.add_argument("--width", type=int, default=None, help="cap the text timeline at this many columns")
    p.set_defaults(func=run)
