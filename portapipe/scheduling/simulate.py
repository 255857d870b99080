"""Cost-model simulation of a schedule: timelines, makespan, bubble, peak activations.

Cost convention (the DualPipe paper's): ``F`` is one forward of one virtual stage (chunk),
``B`` its *full* backward, ``W`` the weight-gradient part of ``B``, ``FB`` one overlapped
F&B unit. So a full backward ``BW`` costs ``B``, an input-gradient backward ``B`` costs
``B - W``, a ``W`` costs ``W``, and an F&B pair costs ``FB`` (``FB - W`` when its backward
half is an input-gradient B; ``F + B`` when ``FB`` is not given, i.e. no overlap gain); an
F&F pair (``schedule.pair_forwards``) costs ``2F``: no cost of its own is given.

Each rank runs its list in order; an action starts when the rank is free and its inputs are
ready: a forward needs the previous stage's forward of the same micro-batch, a backward
needs its own forward and the next stage's backward, a W needs its B. A cross-rank input is
ready ``p2p`` after it was sent. On a lowered schedule (with SEND/RECV actions) the consumer
waits for the matching SEND to have been posted and for its own RECV to have been posted
(transfer starts when both are); posts cost nothing and never block, as in the executor.

Bubble of a rank = makespan - its busy time (an F&B unit counts as its FB cost); the
schedule's bubble is the maximum over ranks. Activations: a rank holds a micro-batch chunk
from its forward until its backward (B or BW) ran; in an F&B unit the forward is counted
first, since both halves' tensors are live while they overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .comms import has_comms
from .ir import Action, Kind, Schedule, gc_paused


class DeadlockError(RuntimeError):
    """The lists cannot all run to the end: some rank waits for something never produced."""


@dataclass
class Costs:
    F: float = 1.0
    B: float = 2.0  # full backward (input + weight gradients)
    W: float = 1.0  # weight-gradient part of B
    FB: float | None = None  # overlapped F&B unit; None = F + B (no overlap gain)
    p2p: float = 0.0  # latency of one cross-rank transfer
    rank_scale: list[float] | None = None  # multiplies every cost on that rank
    stage_scale: list[float] | None = None  # multiplies the cost of that virtual stage's work

    def __post_init__(self) -> None:
        for name in ("F", "B", "W", "FB", "p2p"):
            value = getattr(self, name)
            if value is not None and not (0 <= value < math.inf):  # also refuses NaN
                raise ValueError(f"cost {name} must be a finite number >= 0, got {value}")
        if self.W > self.B:
            raise ValueError(f"cost W (weight part of the backward) must be <= B (full backward), got W={self.W} > B={self.B}")
        if self.FB is not None and self.FB < max(self.F, self.B):
            raise ValueError(
                f"cost FB (an overlapped forward and full backward) cannot be shorter than its longer half: "
                f"need FB >= max(F, B) = {max(self.F, self.B)}, got FB={self.FB}"
            )
        for name in ("rank_scale", "stage_scale"):
            scale = getattr(self, name)
            if scale is not None and any(x <= 0 for x in scale):
                raise ValueError(f"{name} entries must be > 0, got {scale}")

    @classmethod
    def parse(cls, text: str) -> Costs:
        """``"F=1,B=2,W=1,FB=2.5,p2p=0"`` -> Costs (keys case-insensitive, any subset)."""
        keys = {"f": "F", "b": "B", "w": "W", "fb": "FB", "p2p": "p2p"}
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            key = keys.get(name.strip().lower())
            if not sep or key is None:
                raise ValueError(f"cannot read cost {part!r}: expected NAME=VALUE with NAME one of F, B, W, FB, p2p")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"cost {name.strip()}={value!r} is not a number") from None
        return cls(**values)

    @property
    def fb(self) -> float:
        return self.F + self.B if self.FB is None else self.FB

    def base(self, kind: Kind) -> float:
        if kind is Kind.F:
            return self.F
        if kind is Kind.BW:
            return self.B
        if kind is Kind.B:
            return self.B - self.W
        if kind is Kind.W:
            return self.W
        raise ValueError(f"no cost for {kind.value}")

    def of(self, action: Action, rank: int) -> float:
        """Duration of a compute action on ``rank``."""
        scale = self.rank_scale[rank] if self.rank_scale is not None else 1.0
        if action.kind is Kind.FB:
            assert action.pair is not None
            f, b = action.pair
            if b.kind is Kind.F:  # an F&F pair: no cost of its own is given, so no overlap gain
                cost = 2 * self.F
            else:
                cost = self.fb - (self.W if b.kind is Kind.B else 0.0)
            if self.stage_scale is not None:  # the pair's stages may differ in size: average
                cost *= (self.stage_scale[f.stage] + self.stage_scale[b.stage]) / 2
            return cost * scale
        cost = self.base(action.kind)
        if self.stage_scale is not None:
            cost *= self.stage_scale[action.stage]
        return cost * scale

    def to_dict(self) -> dict[str, Any]:
        return {"F": self.F, "B": self.B, "W": self.W, "FB": self.fb, "p2p": self.p2p}


class CostModel(Protocol):
    """What the simulator asks of its costs. :class:`Costs` is the closed-form one; a model
    priced from measurements (portapipe.plan.time_model) gives every action its own duration."""

    p2p: float
    rank_scale: list[float] | None
    stage_scale: list[float] | None
    #: True when two micro-batches of one (kind, stage) may cost differently on a rank
    per_action: bool

    def of(self, action: Action, rank: int) -> float: ...


class Slot(NamedTuple):
    start: float
    end: float
    action: Action


@dataclass
class SimResult:
    schedule: Schedule
    costs: Costs | CostModel
    makespan: float
    busy: list[float]
    timeline: list[list[Slot]]  # compute actions only, per rank
    peak_activations: list[int]
    bubble: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.bubble = [self.makespan - b for b in self.busy]

    @property
    def max_bubble(self) -> float:
        return max(self.bubble)

    @property
    def params_per_rank(self) -> float:
        return self.schedule.params_per_rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "makespan": self.makespan,
            "bubble": {"per_rank": self.bubble, "max": self.max_bubble},
            "busy": self.busy,
            "peak_activations": self.peak_activations,
            "params_per_rank": self.params_per_rank,
        }


# Integer completion keys: (class * n_stages + stage) * n_mb + mb. Classes: forward output
# ready, input gradient ready (B or BW), weights done, SEND_F / SEND_B / RECV_F / RECV_B posted.
_CF, _CB, _CW, _SF, _SB, _RF, _RB = range(7)
_CLASS = {Kind.F: _CF, Kind.B: _CB, Kind.BW: _CB, Kind.W: _CW, Kind.SEND_F: _SF, Kind.SEND_B: _SB, Kind.RECV_F: _RF, Kind.RECV_B: _RB}


def simulate(schedule: Schedule, costs: Costs | CostModel | None = None, timeline: bool = True) -> SimResult:
    """Run every rank's list under the cost model; raises DeadlockError if they cannot end.
    ``timeline=False`` skips recording per-action slots (the deadlock check needs none)."""
    return run_lists(schedule, schedule.actions, costs, timeline, has_comms(schedule))


def run_lists(schedule: Schedule, lists: list[list[Any]], costs: Costs | CostModel | None, timeline: bool, lowered: bool) -> SimResult:
    """:func:`simulate` on per-rank ``lists`` placed by ``schedule``; comm entries may be
    Actions or (Kind, stage, mb) tuples (a :func:`~portapipe.scheduling.comms.plan`)."""
    with gc_paused():
        return _run_lists(schedule, lists, costs, timeline, lowered)


def _run_lists(schedule: Schedule, lists: list[list[Any]], costs: Costs | CostModel | None, timeline: bool, lowered: bool) -> SimResult:
    """:func:`simulate` on per-rank ``lists`` placed by ``schedule``; comm entries may be
    Actions or (Kind, stage, mb) tuples (a :func:`~portapipe.scheduling.comms.plan`)."""
    costs = costs or Costs()
    n = schedule.n_ranks
    if costs.rank_scale is not None and len(costs.rank_scale) != n:
        raise ValueError(f"rank_scale has {len(costs.rank_scale)} entries, the schedule has {n} ranks")
    if costs.stage_scale is not None and len(costs.stage_scale) != schedule.n_stages:
        raise ValueError(f"stage_scale has {len(costs.stage_scale)} entries, the schedule has {schedule.n_stages} virtual stages")
    rank_of = schedule.stage_rank
    prev, nxt = schedule.links()
    n_st, n_mb = schedule.n_stages, schedule.n_microbatches
    p2p = costs.p2p

    def key(cls: int, stage: int, mb: int) -> int:
        return (cls * n_st + stage) * n_mb + mb

    templates: dict[tuple[Kind, int], list[tuple[int, int, float]]] = {}

    def template(kind: Kind, v: int) -> list[tuple[int, int, float]]:
        """Inputs of (kind, stage v) as (key base, RECV key base or -1, latency); adding the
        micro-batch to a base gives the key, so each (kind, stage) is worked out once."""
        src: list[tuple[int, int]] = []  # (class of the producing completion, its stage)
        if kind is Kind.F:
            if prev[v] is not None:
                src.append((_CF, prev[v]))  # type: ignore[arg-type]
        elif kind is Kind.B or kind is Kind.BW:
            src.append((_CF, v))
            if nxt[v] is not None:
                src.append((_CB, nxt[v]))  # type: ignore[arg-type]
        elif kind is Kind.W:
            src.append((_CB, v))
        out = []
        for cls, u in src:
            if rank_of[u] == rank_of[v]:
                out.append((key(cls, u, 0), -1, 0.0))
            elif lowered:  # wait for the SEND's post and our RECV's post
                send_cls, recv_cls = (_SF, _RF) if cls == _CF else (_SB, _RB)
                out.append((key(send_cls, u, 0), key(recv_cls, v, 0), p2p))
            else:
                out.append((key(cls, u, 0), -1, p2p))
        templates[(kind, v)] = out
        return out

    # Compile each rank's list into entries (action, cost, deps, mb, made, up, down): deps are
    # (key base, RECV key base or -1, latency) and made are key bases, all offset by mb at run
    # time, so entries of one (kind, stage) share their tuples. F&B pairs (two micro-batches)
    # store absolute keys with mb = 0. Posts have cost None and made = (key,).
    programs: list[list[tuple]] = []
    shared: dict[tuple[Kind, int, int], tuple] = {}  # (kind, stage, rank) -> (cost, deps, made, up, down)
    per_action = getattr(costs, "per_action", False)  # costs may differ between micro-batches

    def single(a: Action, r: int) -> tuple:
        kind = a.kind
        up, down = (1, 0) if kind is Kind.F else (0, 0) if kind is Kind.W else (0, 1)
        info = (costs.of(a, r), tuple(templates.get((kind, a.stage)) or template(kind, a.stage)), (key(_CLASS[kind], a.stage, 0),), up, down)
        shared[(kind, a.stage, r)] = info
        return info

    for r, acts in enumerate(lists):
        prog = []
        for a in acts:
            if a.__class__ is tuple:  # a post of a plan: (Kind, stage, mb)
                prog.append((a, None, (), 0, (key(_CLASS[a[0]], a[1], a[2]),), 0, 0))
                continue
            kind = a.kind
            if kind.is_comm:
                prog.append((a, None, (), 0, (key(_CLASS[kind], a.stage, a.mb),), 0, 0))
            elif a.pair is None:
                info = shared.get((kind, a.stage, r)) or single(a, r)
                cost = costs.of(a, r) if per_action else info[0]
                prog.append((a, cost, info[1], a.mb, info[2], info[3], info[4]))
            else:
                deps: list[tuple[int, int, float]] = []
                made = []
                for h in a.pair:
                    m = h.mb
                    tpl = templates.get((h.kind, h.stage)) or template(h.kind, h.stage)
                    deps += [(kb + m, rb + m if rb >= 0 else -1, lat) for kb, rb, lat in tpl]
                    made.append(key(_CLASS[h.kind], h.stage, m))
                prog.append((a, costs.of(a, r), tuple(deps), 0, tuple(made), 1, 1))
        programs.append(prog)

    done: list[float | None] = [None] * (7 * n_st * n_mb)
    waiting: dict[int, list[int]] = {}
    clock = [0.0] * n
    busy = [0.0] * n
    pos = [0] * n
    record = timeline
    timeline_: list[list[Slot]] = [[] for _ in range(n)]
    live = [0] * n
    peak = [0] * n

    def advance(r: int) -> list[int]:
        """Run rank r as far as it can; returns the keys it completed."""
        prog = programs[r]
        produced: list[int] = []
        t = clock[r]
        i = pos[r]
        n_prog = len(prog)
        while i < n_prog:
            a, dur, deps, m, made, up, down = prog[i]
            if dur is None:  # a post: never blocks, costs nothing
                done[made[0]] = t
                produced.append(made[0])
                i += 1
                continue
            start = t
            blocked = -1
            for kb, rb, lat in deps:
                tk = done[kb + m]
                if tk is None:
                    blocked = kb + m
                    break
                if rb >= 0:
                    tr = done[rb + m]
                    if tr is None:
                        raise DeadlockError(f"rank {r}: {a} needs a receive that is posted only after it")
                    if tr > tk:
                        tk = tr
                tk += lat
                if tk > start:
                    start = tk
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            t = start + dur
            busy[r] += dur
            if record:
                timeline_[r].append(Slot(start, t, a))
            if up:
                live[r] += up
                if live[r] > peak[r]:
                    peak[r] = live[r]
            live[r] -= down
            for kb in made:
                if done[kb + m] is not None:
                    raise DeadlockError(f"rank {r}: {a} completes work that already ran")
                done[kb + m] = t
                produced.append(kb + m)
            i += 1
        clock[r] = t
        pos[r] = i
        return produced

    todo = list(range(n))
    while todo:
        r = todo.pop()
        for k in advance(r):
            woken = waiting.pop(k, None)
            if woken:
                todo.extend(woken)
    stuck = [r for r in range(n) if pos[r] < len(programs[r])]
    if stuck:
        lines = [f"rank {r} waits at step {pos[r]} ({_show(lists[r][pos[r]])})" for r in stuck[:8]]
        more = f" and {len(stuck) - 8} more ranks" if len(stuck) > 8 else ""
        raise DeadlockError("schedule cannot finish: " + "; ".join(lines) + more)
    makespan = max(clock) if n else 0.0
    return SimResult(schedule, costs, makespan, busy, timeline_, peak)


def _show(a: Any) -> str:
    return str(Action(*a) if a.__class__ is tuple else a)


def bubble_formula(name: str, pp: int, costs: Costs, chunks: int = 2) -> tuple[str, float] | None:
    """The closed-form bubble of the REFERENCE table in per-action costs, and its value.

    ``pp`` counts pipeline ranks. The interleaved formula uses per-chunk costs: with F, B
    the costs of one rank's whole share (v chunks) it reads (pp-1)(F+B)/v. Conditions under
    which each is exact are in the scheduling README; None for an unknown name."""
    F, Bf, W, FB = costs.F, costs.B, costs.W, costs.fb
    if name == "1f1b":
        return "(pp-1)(F+B)", (pp - 1) * (F + Bf)
    if name == "zb1p":
        return "(pp-1)(F+B-2W)", (pp - 1) * (F + Bf - 2 * W)
    if name == "interleaved":
        return "(pp-1)(F+B)/v  [F, B per rank share = v chunks]", (pp - 1) * (F + Bf)
    if name == "dualpipe":
        return "(pp/2-1)(F&B+B-3W)", (pp / 2 - 1) * (FB + Bf - 3 * W)
    if name == "dualpipev":
        return "(pp-1)(F&B+B-3W)  [pp ranks, 2pp stages]", (pp - 1) * (FB + Bf - 3 * W)
    return None


__all__ = ["CostModel", "Costs", "DeadlockError", "SimResult", "Slot", "simulate", "bubble_formula"]
