"""``portapipe timeline RUN_DIR --step N``: what a recorded step did, rank by rank, beside the plan.

    portapipe train examples/cpu.yaml --set log.timeline.steps=[20]
    portapipe timeline runs/cpu --step 20 --out step.png
    portapipe timeline runs/cpu --step 20 --profile cpu.json --json

Reads ``RUN_DIR/timeline/step_N.rows.json`` (written by ``log.timeline``) and prints, per rank:
the step's time, the bubble measured and planned, the communication left exposed by kind (time
blocked on expert all-to-all, on pipeline receives, the gradient synchronisation after the last
action, the gathers ending the step; ms and share of the step), and the five actions whose
measured time differs most from the plan's. The plan is the run's schedule simulated with the
run's own measured times (each action at the median of its kind on its stage), or with
``--profile`` (``portapipe profile``'s JSON, or a published device such as h800) as ``portapipe
plan`` prices it. ``--out`` draws the measured step as a Gantt chart (``simulate --plot``'s
cells) with the plan under each rank. ``--json``: the same figures as one JSON object. The
record's checks (causal order on the aligned clocks, every action of the schedule once in its
order) are part of the output. Exit codes: 0 shown, 2 bad input (no such step, a chart that
cannot be written, an unreadable profile).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _fail(message: str) -> int:
    print(f"portapipe timeline: {message}", file=sys.stderr)
    return 2


def _profile(name: str, config: Any) -> Any:
    from ..config.setup import shape_of
    from ..plan.profile import Profile
    from ..plan.published import DEVICES, published

    if not Path(name).exists() and name in DEVICES:
        return published(name, shape_of(config.model, config.train, config.backend))
    return Profile.load(name)


def run(args: argparse.Namespace) -> int:
    from ..config import config_from_dict
    from ..plan.profile import ProfileError
    from ..timeline import analyze, plan, trace

    if args.out:
        from ..scheduling.plot import check_chart_path

        try:
            check_chart_path(args.out)
        except ValueError as err:
            return _fail(str(err))
    try:
        step = args.step if args.step is not None else trace.newest(args.run_dir)
        doc = trace.read(args.run_dir, step)
    except FileNotFoundError as err:
        return _fail(str(err))
    schedule = plan.schedule_of(doc)
    if args.profile:
        try:
            profile = _profile(args.profile, config_from_dict(doc["config"]))
            planned = plan.profile_plan(doc, schedule, profile)
        except ProfileError as err:  # it names --profile itself
            return _fail(str(err))
        except (OSError, ValueError) as err:
            return _fail(f"--profile {args.profile}: {err}")
        costs = f"profile {profile.source}"
    else:
        planned = plan.measured_plan(doc, schedule)
        costs = "the run's own measured times"
    ranks = plan.compare(doc, planned)
    checks = {"causality": analyze.causality(doc, schedule), "actions": analyze.action_problems(doc, schedule)}
    bounds = [r["alignment"]["bound_s"] for r in doc["ranks"]]
    title = (f"step {doc['step']} of {schedule.name}, pp {schedule.n_ranks}, {schedule.n_microbatches} micro-batches, "
             f"{len(doc['ranks'])} ranks; plan from {costs}")
    if args.out:
        from ..timeline.draw import draw

        try:
            draw(doc, schedule, planned, args.out, title)
        except OSError as err:
            return _fail(f"cannot write a chart to {args.out!r}: {err.strerror or err}")
    out = {"step": doc["step"], "schedule": schedule.name, "clock": doc["clock"], "plan_costs": costs,
           "alignment_bound_ms": 1e3 * max(bounds), "plan_step_ms": 1e3 * planned.makespan, "ranks": ranks, "checks": checks}
    if args.out:
        out["plot"] = args.out
    if args.json:
        print(json.dumps(out))
        return 0
    print(title)
    print(f"clocks: {doc['clock']}, aligned on rank 0's within {1e3 * max(bounds):.3f} ms; the plan's pipeline: {1e3 * planned.makespan:.1f} ms")
    for r in ranks:
        print(_rank_line(r))
        for o in r["off_plan"]:
            print(f"    {o['action']:<22} {o['measured_ms']:8.2f} ms, plan {o['planned_ms']:8.2f} ms ({o['diff_ms']:+.2f}); "
                  f"started at {o['start_ms']:.1f} ms, plan {o['planned_start_ms']:.1f}")
    for line in checks["causality"] + checks["actions"]:
        print(f"check: {line}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _rank_line(r: dict[str, Any]) -> str:
    ex = r["exposed"]
    exposed = ", ".join(f"{k} {v['ms']:.1f} ms ({100 * v['share']:.1f}%)" for k, v in ex.items())
    b = r["bubble"]
    return (f"rank {r['rank']} (pp {r['pp_rank']}, ep {r['ep_rank']}, dp {r['dp_rank']}): step {r['step_ms']:.1f} ms; bubble "
            f"{100 * b['measured']:.1f}% measured, {100 * b['planned']:.1f}% planned; compute {r['compute_ms']:.1f} ms, idle "
            f"{r['idle_ms']:.1f} ms; exposed: {exposed}; most off the plan:")


def register(sub: Any) -> None:
    p = sub.add_parser("timeline", help="a recorded step (log.timeline), rank by rank, beside the simulator's plan",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (its log.dir)")
    p.add_argument("--step", type=int, help="the recorded step (1-based, as metrics.jsonl numbers them) [the newest recorded]")
    p.add_argument("--out", metavar="FILE", help="draw the step and its plan (.png, .svg, .pdf; extra viz)")
    p.add_argument("--profile", metavar="P", help="price the plan with a device profile (portapipe profile's JSON, or h800) "
                   "instead of the run's own measured times")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=run)
