"""The simulator's plan of a recorded step, and how far the step strayed from it.

The plan is the run's schedule (rebuilt from the config its files carry) run through the
simulator (:mod:`portapipe.scheduling.simulate`) with one of two cost models:

- the run's own measured times (:class:`MeasuredCosts`): each action costs the median of the
  measured actions of its kind on its stage (a pair: of its two halves' kinds and stages) over the
  ranks at its pipeline position, a transfer the shortest time a receive took after its send was
  posted. The plan is then the schedule run at the step's typical pace, with no stragglers and no
  waits beyond the schedule's own; the actions most off the plan are those slower or faster than
  their kind;
- a device profile (``portapipe profile``'s JSON, or a published device): the planner's time
  model (:class:`~portapipe.plan.time_model.TimeModel`), the same prices ``portapipe plan`` ranks by.

Per rank, :func:`compare` gives the bubble measured and planned, the exposed communication by
kind (ms and share of the step) and the actions whose measured time differs most from the plan's.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..scheduling.comms import matching_send
from ..scheduling.ir import Action, Schedule, parse_action
from ..scheduling.simulate import SimResult, Slot, simulate
from . import analyze
from .record import action_name

#: actions listed per rank as the most off the plan
OFF_PLAN = 5


def schedule_of(doc: dict[str, Any]) -> Schedule:
    """The lowered schedule the recorded run ran (what its executor ran)."""
    from ..config import config_from_dict
    from ..scheduling.runnable import build_schedule

    return build_schedule(config_from_dict(doc["config"]))


def signature(a: Action) -> tuple[Any, ...]:
    """What an action costs by: its kind and stage (a pair: its two halves')."""
    if a.pair is not None:
        f, s = a.pair
        return ("FB", f.stage, s.kind.value, s.stage)
    return (a.kind.value, a.stage)


class MeasuredCosts:
    """The simulator's cost model from a recorded step (see the module docstring)."""

    rank_scale = None
    stage_scale = None
    per_action = True

    def __init__(self, doc: dict[str, Any], schedule: Schedule) -> None:
        samples: dict[tuple[int, tuple[Any, ...]], list[float]] = {}
        for r, events in analyze.by_rank(doc).items():
            p = doc["ranks"][r]["pp_rank"]
            for i, took in analyze.busy(events).items():
                samples.setdefault((p, signature(parse_action(events[i]["ir"]))), []).append(took)
        self.median = {k: statistics.median(v) for k, v in samples.items()}
        self.p2p = transfer_s(doc, schedule)

    def of(self, action: Action, rank: int) -> float:
        key = (rank, signature(action))
        if key not in self.median:
            raise ValueError(f"the recorded step holds no {action} on pipeline rank {rank}: it is not this run's schedule")
        return self.median[key]


def transfer_s(doc: dict[str, Any], schedule: Schedule) -> float:
    """The shortest time a recorded receive took to complete after its send was posted (0 without any)."""
    ranks = analyze.by_rank(doc)
    posted = {(r, e["ir"]): e["begin_s"] for r, events in ranks.items() for e in events if e["kind"] == "p2p" and "SEND" in e["ir"]}
    took = []
    for r, events in ranks.items():
        for e in events:
            if e["kind"] == "p2p" and "RECV" in e["ir"]:
                send = matching_send(schedule, parse_action(e["ir"]))
                src = analyze.global_rank(doc, r, schedule.stage_rank[send.stage])
                if (src, str(send)) in posted:
                    took.append(e["end_s"] - posted[(src, str(send))])
    return max(0.0, min(took)) if took else 0.0


def measured_plan(doc: dict[str, Any], schedule: Schedule) -> SimResult:
    return simulate(schedule, MeasuredCosts(doc, schedule))


def profile_plan(doc: dict[str, Any], schedule: Schedule, profile: Any) -> SimResult:
    """The planner's time model of the run's setup under ``profile`` (a :class:`~portapipe.plan.profile.Profile`)."""
    from ..config import config_from_dict
    from ..config.setup import Setup
    from ..plan.time_model import TimeModel

    return TimeModel(Setup.from_config(config_from_dict(doc["config"])), profile, schedule).simulated()


def measured_slots(events: list[dict[str, Any]], origin: float) -> list[Slot]:
    """A rank's recorded actions as the simulator's slots, from ``origin`` (its step's start): each
    ends where it ended and lasts its time less its waits for receives (:func:`.analyze.busy`)."""
    took = analyze.busy(events)
    return sorted((Slot(events[i]["end_s"] - t - origin, events[i]["end_s"] - origin, parse_action(events[i]["ir"])) for i, t in took.items()),
                  key=lambda s: s.start)


def compare(doc: dict[str, Any], plan: SimResult) -> list[dict[str, Any]]:
    """Per rank (in rank order): its step (wall, compute, idle), the exposed communication by kind
    (``s`` and ``share`` of the step), the bubble measured and planned, and the :data:`OFF_PLAN`
    actions whose measured time differs most from the plan's (measured and planned start and
    length, from the step's start)."""
    out = []
    planned_slots = {r: {str(s.action): s for s in row} for r, row in enumerate(plan.timeline)}
    for r, events in sorted(analyze.by_rank(doc).items()):
        info = doc["ranks"][r]
        p = info["pp_rank"]
        acc = analyze.accounting(events)
        origin = analyze.step_span(events)["begin_s"]
        off = []
        for s in measured_slots(events, origin):
            want = planned_slots[p].get(str(s.action))
            if want is None:
                continue
            off.append({"action": action_name(s.action), "ir": str(s.action), "measured_ms": 1e3 * (s.end - s.start), "planned_ms": 1e3 * (want.end - want.start),
                        "start_ms": 1e3 * s.start, "planned_start_ms": 1e3 * want.start,
                        "diff_ms": 1e3 * ((s.end - s.start) - (want.end - want.start))})
        off.sort(key=lambda x: -abs(x["diff_ms"]))
        wall = acc["wall_s"]
        out.append({
            "rank": r, "pp_rank": p, "dp_rank": info["dp_rank"], "ep_rank": info["ep_rank"],
            "step_ms": 1e3 * wall, "compute_ms": 1e3 * acc["compute_s"], "idle_ms": 1e3 * acc["idle_s"],
            "exposed": {k: {"ms": 1e3 * v, "share": v / wall if wall > 0 else 0.0} for k, v in acc["exposed_s"].items()},
            "bubble": {"measured": acc["bubble_frac"], "planned": plan.bubble[p] / plan.makespan if plan.makespan > 0 else 0.0},
            "off_plan": off[:OFF_PLAN],
        })
    return out
