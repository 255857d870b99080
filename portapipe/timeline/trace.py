"""A recorded step's files: every rank's spans merged on rank 0's clock, as Chrome trace-event JSON
(Perfetto, chrome://tracing and HTA open it) and as plain rows for scripts.

``<log.dir>/timeline/step_<N>.json``: one process per rank (``rank 3 (pp 1, dp 0, ep 1)``), one
track per stream: ``compute`` (the step, its actions, the time each was blocked, the loop's own
work) as begin / end pairs, properly nested; ``exchanges``, ``pipeline p2p`` and ``gradient sync``
as complete events from issue to completion, spread over as many lanes of the track as overlap
(``exchanges``, ``exchanges 2``, ...). Times are microseconds from the recording's start on rank
0. ``otherData`` holds the step, the clock kind and each rank's offset and residual bound.

``<log.dir>/timeline/step_<N>.rows.json``: the same spans as rows (:mod:`.record`), seconds from
that start, with the run's config and each rank's place and alignment: what ``portapipe
timeline`` and :mod:`.analyze` read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..scheduling.spans import COMPUTE, TRACKS

FOLDER = "timeline"


def paths(log_dir: str | Path, step: int) -> tuple[Path, Path]:
    """(the Chrome trace, the rows) of (1-based) step ``step`` of a run in ``log_dir``."""
    folder = Path(log_dir) / FOLDER
    return folder / f"step_{step}.json", folder / f"step_{step}.rows.json"


def merge(payloads: list[dict[str, Any]], step: int, config: dict[str, Any]) -> dict[str, Any]:
    """The rows document of one step from every rank's payload (:meth:`TimelineHook.payload`),
    each rank's times moved onto rank 0's clock by its offset, from rank 0's start."""
    payloads = sorted(payloads, key=lambda p: p["rank"])
    origin = payloads[0]["start_s"]
    events = []
    ranks = []
    for p in payloads:
        shift = p["alignment"]["offset_s"] - origin
        for e in p["rows"]:
            events.append({**e, "rank": p["rank"], "begin_s": e["begin_s"] + shift, "end_s": e["end_s"] + shift})
        ranks.append({k: v for k, v in p.items() if k not in ("rows",)})
    return {"step": step, "clock": payloads[0]["clock"], "config": config, "ranks": ranks, "events": events}


def _lanes(spans: list[dict[str, Any]]) -> list[int]:
    """A lane for each span (in begin order) so that no two in one lane overlap."""
    ends: list[float] = []
    out = []
    for e in spans:
        lane = next((i for i, end in enumerate(ends) if end <= e["begin_s"]), len(ends))
        if lane == len(ends):
            ends.append(e["end_s"])
        else:
            ends[lane] = e["end_s"]
        out.append(lane)
    return out


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def chrome(doc: dict[str, Any]) -> dict[str, Any]:
    """The Chrome trace-event document of a rows document."""
    out: list[dict[str, Any]] = []
    for info in doc["ranks"]:
        r = info["rank"]
        events = [e for e in doc["events"] if e["rank"] == r]
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                    "args": {"name": f"rank {r} (pp {info['pp_rank']}, dp {info['dp_rank']}, ep {info['ep_rank']})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        tids = {COMPUTE: 0}
        out += _compute_events(r, events)
        tid = 1
        for track in TRACKS[1:]:
            mine = sorted((e for e in events if e["track"] == track), key=lambda e: e["begin_s"])
            lanes = _lanes(mine)
            for lane in range(max(lanes, default=-1) + 1):
                tids[f"{track} {lane + 1}"] = tid + lane
            for e, lane in zip(mine, lanes):
                out.append({"ph": "X", "name": e["name"], "cat": e["kind"], "pid": r, "tid": tid + lane, "ts": _us(e["begin_s"]),
                            "dur": _us(e["end_s"] - e["begin_s"]), "args": _args(e)})
            tid += max(lanes, default=-1) + 1
        for name, t in tids.items():
            shown = name if name == COMPUTE else (name[: -2] if name.endswith(" 1") else name)
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": t, "args": {"name": shown}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": t, "args": {"sort_index": t}})
    ranks = doc["ranks"]
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {
            "portapipe_step": doc["step"], "clock": doc["clock"],
            "offsets_s": [p["alignment"]["offset_s"] for p in ranks], "residual_bound_s": [p["alignment"]["bound_s"] for p in ranks],
            "max_residual_bound_s": max(p["alignment"]["bound_s"] for p in ranks),
        },
    }


def _args(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k in ("ir", "stage", "mb", "stage2", "mb2", "layer")} | dict(e.get("args") or {})


def _compute_events(r: int, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compute track as begin / end pairs, depth first (children held inside their parent)."""
    index = {id(e): i for i, e in enumerate(events)}
    children: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e["track"] == COMPUTE:
            children.setdefault(e["parent"], []).append(e)
    out: list[dict[str, Any]] = []

    def walk(parent: int, lo: float, hi: float) -> None:
        for e in sorted(children.get(parent, []), key=lambda e: e["begin_s"]):
            b = min(max(e["begin_s"], lo), hi)  # a device's clock may jitter a mark past its parent's or its sibling's
            end = max(min(e["end_s"], hi), b)
            out.append({"ph": "B", "name": e["name"], "cat": e["kind"], "pid": r, "tid": 0, "ts": _us(b), "args": _args(e)})
            walk(index[id(e)], b, end)
            out.append({"ph": "E", "name": e["name"], "cat": e["kind"], "pid": r, "tid": 0, "ts": _us(end)})
            lo = end

    walk(-1, float("-inf"), float("inf"))
    return out


def write(doc: dict[str, Any], log_dir: str | Path) -> tuple[Path, Path]:
    """Both files of ``doc``'s step in ``log_dir``/timeline/ (made when missing)."""
    trace, rows = paths(log_dir, doc["step"])
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text(json.dumps(chrome(doc)))
    rows.write_text(json.dumps(doc))
    return trace, rows


def recorded(log_dir: str | Path) -> list[int]:
    """The steps recorded in a run's folder, in order."""
    folder = Path(log_dir) / FOLDER
    return sorted(int(p.name[len("step_"):-len(".rows.json")]) for p in folder.glob("step_*.rows.json")) if folder.is_dir() else []


def newest(log_dir: str | Path) -> int:
    """The newest step recorded in ``log_dir``; FileNotFoundError when there is none."""
    have = recorded(log_dir)
    if not have:
        raise FileNotFoundError(f"{Path(log_dir) / FOLDER} holds no recorded step: record some with log.timeline (e.g. --set log.timeline.steps=[20])")
    return have[-1]


def read(log_dir: str | Path, step: int) -> dict[str, Any]:
    """The rows document of ``step``; FileNotFoundError naming the steps recorded there when absent."""
    _, rows = paths(log_dir, step)
    if not rows.exists():
        have = recorded(log_dir)
        said = f"the steps recorded there: {', '.join(map(str, have))}" if have else "no step was recorded there (log.timeline)"
        raise FileNotFoundError(f"{rows} does not exist: {said}")
    return json.loads(rows.read_text())


#: the fields every event of a phase carries (Chrome's trace-event format)
REQUIRED = {"B": ("name", "pid", "tid", "ts"), "E": ("pid", "tid", "ts"), "X": ("name", "pid", "tid", "ts", "dur"), "M": ("name", "pid", "args")}


def trace_problems(trace: dict[str, Any]) -> list[str]:
    """What makes ``trace`` not a valid trace-event document: a phase without its fields, a time
    that is not a number, a negative duration, begin / end pairs that do not balance or nest per
    thread (an end without its begin, an end naming another span, a begin never ended)."""
    out = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    open_: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for i, e in enumerate(events):
        ph = e.get("ph")
        if ph not in REQUIRED:
            out.append(f"event {i}: phase {ph!r} is not one of {', '.join(REQUIRED)}")
            continue
        missing = [k for k in REQUIRED[ph] if k not in e]
        if missing:
            out.append(f"event {i} ({ph}): lacks {', '.join(missing)}")
            continue
        if ph != "M" and not isinstance(e["ts"], (int, float)):
            out.append(f"event {i}: ts {e['ts']!r} is not a number")
        if ph == "X" and not (isinstance(e["dur"], (int, float)) and e["dur"] >= 0):
            out.append(f"event {i}: dur {e['dur']!r} is not a number >= 0")
        key = (e.get("pid"), e.get("tid"))
        if ph == "B":
            stack = open_.setdefault(key, [])
            if stack and e["ts"] < stack[-1]["ts"]:
                out.append(f"event {i}: {e['name']} begins before the span it is inside")
            stack.append(e)
        elif ph == "E":
            stack = open_.get(key) or []
            if not stack:
                out.append(f"event {i}: an end on pid {key[0]} tid {key[1]} with no begin open")
                continue
            top = stack.pop()
            if e.get("name", top["name"]) != top["name"] or e["ts"] < top["ts"]:
                out.append(f"event {i}: the end of {e.get('name')} at {e['ts']} closes {top['name']} begun at {top['ts']}")
    for key, stack in open_.items():
        out += [f"{b['name']} on pid {key[0]} tid {key[1]} begins and never ends" for b in stack]
    return out
