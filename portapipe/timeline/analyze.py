"""What a recorded step says: each rank's time by kind, the checks that it was recorded right.

A recorded step (:func:`portapipe.timeline.trace.merge`'s document) holds every rank's spans on
rank 0's clock. Per rank, over its ``step`` span (the executor's step: the actions, the gradient
synchronisation left after them, the losses and loads gathered at its end):

- **compute**: the schedule's actions, less the time they were blocked;
- **exposed communication**, by kind: blocked on an expert exchange (``all-to-all``), on a
  pipeline receive (``pipeline p2p``), the gradient synchronisation after the last action
  (``gradient sync``), the gathers that end the step (``step end``);
- **idle**: the rest of the step (between actions: posting transfers, the executor's own work).

The three add up to the step's wall time when the spans nest as they should (no two actions at
once, every wait inside the action that waited); :func:`accounting` measures each apart.

:func:`causality` checks the clocks' alignment against what must hold on any clock: no receive
completes before its matching send was issued (pipeline p2p), no exchange before each rank that
sent it rows had issued its part. :func:`action_problems` checks the recording against the
schedule: every action of a rank's list once, in its order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..scheduling.comms import matching_send
from ..scheduling.ir import Schedule, parse_action

#: exposed communication, by the track of the span a wait waited on
EXPOSED = {"exchange": "all-to-all", "p2p": "pipeline p2p"}
#: the compute-track parts of the step that are communication left exposed
EXPOSED_PARTS = {"grad sync": "gradient sync", "step end": "step end"}
EXPOSED_KINDS = ("all-to-all", "pipeline p2p", "gradient sync", "step end")


def by_rank(doc: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """Each rank's spans of the executor's step (its ``step`` span and all inside it), in the order
    it recorded them, ``parent`` and ``of`` indexing this list. A recording holds more (the batch,
    the update, a checkpoint; at the run's end the validation, whose forwards run the schedule's
    actions again): only the step is what the schedule says."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in doc["events"]:
        out[e["rank"]].append(e)
    return {r: _of_step(events) for r, events in out.items()}


def _of_step(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    top = step_span(events)
    at = events.index(top)
    new: dict[int, int] = {}
    kept = []
    for i, e in enumerate(events):  # a span's parent was recorded before it
        if i == at or e["parent"] in new:
            new[i] = len(kept)
            kept.append(e)
    return [dict(e, parent=new.get(e["parent"], -1), **({"of": new[e["of"]]} if "of" in e else {})) for e in kept]


def _length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def step_span(events: list[dict[str, Any]]) -> dict[str, Any]:
    found = [e for e in events if e["track"] == "compute" and e["name"] == "step"]
    if len(found) != 1:
        raise ValueError(f"a recorded step holds {len(found)} executor steps on a rank, not one")
    return found[0]


def accounting(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's step: ``wall_s`` (its step span), ``compute_s``, ``exposed_s`` by kind, ``idle_s``,
    each measured on its own spans; ``bubble_frac``: the share of the pipeline's part of the step
    (from its start to the last action's end) the rank neither computed nor waited on an
    exchange (what the simulator calls bubble: p2p waits included)."""
    step = step_span(events)
    i_step = events.index(step)
    lo, hi = step["begin_s"], step["end_s"]
    inside = [e for e in events if e["track"] == "compute" and e["parent"] == i_step]
    actions = [e for e in inside if e["kind"] == "action"]
    waits = [e for e in events if e["kind"] == "wait" and events[e["parent"]]["kind"] == "action"] if events else []
    exposed = dict.fromkeys(EXPOSED_KINDS, 0.0)
    for w in waits:
        exposed[EXPOSED[events[w["of"]]["kind"]]] += w["end_s"] - w["begin_s"]
    for e in inside:
        if e["name"] in EXPOSED_PARTS:
            exposed[EXPOSED_PARTS[e["name"]]] += e["end_s"] - e["begin_s"]
    in_actions = _length([(a["begin_s"], a["end_s"]) for a in actions])
    blocked = _length([(w["begin_s"], w["end_s"]) for w in waits])
    idle = (hi - lo) - _length([(e["begin_s"], e["end_s"]) for e in inside])
    last = max((a["end_s"] for a in actions), default=lo)
    p2p = sum(w["end_s"] - w["begin_s"] for w in waits if events[w["of"]]["kind"] == "p2p")
    pipeline = last - lo
    return {
        "wall_s": hi - lo,
        "compute_s": in_actions - blocked,
        "exposed_s": exposed,
        "idle_s": idle,
        "bubble_frac": max(0.0, 1.0 - (in_actions - p2p) / pipeline) if pipeline > 0 else 0.0,
        "pipeline_s": pipeline,
    }


def busy(events: list[dict[str, Any]]) -> dict[int, float]:
    """Each action's time less its waits for pipeline receives (which the simulator counts as the
    rank idle before the action, not as the action's cost), by its index."""
    out = {i: e["end_s"] - e["begin_s"] for i, e in enumerate(events) if e["kind"] == "action"}
    for w in events:
        if w["kind"] == "wait" and w["parent"] in out and events[w["of"]]["kind"] == "p2p":
            out[w["parent"]] -= w["end_s"] - w["begin_s"]
    return out


def _tolerance(doc: dict[str, Any], *ranks: int) -> float:
    """What the alignment leaves unknown between ``ranks``: their residual bounds added."""
    return sum(doc["ranks"][r]["alignment"]["bound_s"] for r in ranks)


def global_rank(doc: dict[str, Any], rank: int, pp_rank: int) -> int:
    """The rank at pipeline position ``pp_rank`` with ``rank``'s data- and expert-parallel place."""
    info = doc["ranks"][rank]
    return (pp_rank * info["dp"] + info["dp_rank"]) * info["ep"] + info["ep_rank"]


def causality(doc: dict[str, Any], schedule: Schedule) -> list[str]:
    """Every receive that completed before its send was issued, and every exchange that
    completed before a rank sending it rows had issued its part, on the document's clock beyond
    the ranks' residual bounds; one line each (none: the trace is causally right)."""
    ranks = by_rank(doc)
    out: list[str] = []
    sends: dict[tuple[int, str], dict[str, Any]] = {}
    for r, events in ranks.items():
        for e in events:
            if e["kind"] == "p2p" and e["ir"].find("SEND") >= 0:
                sends[(r, e["ir"])] = e
    for r, events in ranks.items():
        for e in events:
            if e["kind"] != "p2p" or "RECV" not in e["ir"]:
                continue
            send = matching_send(schedule, parse_action(e["ir"]))
            src = global_rank(doc, r, schedule.stage_rank[send.stage])
            s = sends.get((src, str(send)))
            if s is None:
                out.append(f"rank {r}: {e['name']} has no matching {send} recorded on rank {src}")
            elif e["end_s"] < s["begin_s"] - _tolerance(doc, r, src):
                out.append(f"rank {r}: {e['name']} completed at {e['end_s'] * 1e3:.3f} ms, before rank {src} posted its send "
                           f"at {s['begin_s'] * 1e3:.3f} ms")
    for r, events in ranks.items():
        mine = [e for e in events if e["kind"] == "exchange"]
        group = doc["ranks"][r]["ep_ranks"]
        for j, peer in enumerate(group):
            if peer == r:
                continue
            theirs = [e for e in ranks.get(peer, []) if e["kind"] == "exchange"]
            if [e["name"] for e in theirs] != [e["name"] for e in mine]:
                out.append(f"ranks {r} and {peer} (one expert-parallel group) recorded different exchanges")
                continue
            for a, b in zip(mine, theirs):
                if a["args"]["rows_from"][j] > 0 and a["end_s"] < b["begin_s"] - _tolerance(doc, r, peer):
                    out.append(f"rank {r}: {a['name']} completed at {a['end_s'] * 1e3:.3f} ms, before rank {peer} issued its part "
                               f"at {b['begin_s'] * 1e3:.3f} ms")
    return out


def action_problems(doc: dict[str, Any], schedule: Schedule) -> list[str]:
    """Each rank's recorded actions against its list: every compute action once and in the
    list's order, every send and receive once and posted in the list's order (the executor runs
    its list as written: it posts consecutive transfers together, in order)."""
    out = []
    for r, events in by_rank(doc).items():
        listed = schedule.actions[doc["ranks"][r]["pp_rank"]]
        for kind, want in (("action", [str(a) for a in listed if a.kind.is_compute]), ("p2p", [str(a) for a in listed if a.kind.is_comm])):
            got = [e["ir"] for e in sorted((e for e in events if e["kind"] == kind), key=lambda e: e["begin_s"])]
            if sorted(got) != sorted(want):
                extra = sorted(set(got) - set(want))[:3]
                missing = sorted(set(want) - set(got))[:3]
                twice = sorted({x for x in got if got.count(x) > 1})[:3]
                out.append(f"rank {r}: recorded {len(got)} {kind} spans for {len(want)} in its list "
                           f"(missing {missing}, not in the list {extra}, twice {twice})")
            elif got != want:
                at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                out.append(f"rank {r}: {kind} {at} ran as {got[at]}, its list has {want[at]} there")
    return out


def shifted(doc: dict[str, Any], rank: int, by_s: float) -> dict[str, Any]:
    """``doc`` with ``rank``'s spans moved by ``by_s`` (its offset dropped: ``-offset``)."""
    events = [dict(e, begin_s=e["begin_s"] + by_s, end_s=e["end_s"] + by_s) if e["rank"] == rank else e for e in doc["events"]]
    return {**doc, "events": events}
