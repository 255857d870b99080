"""Pure schedule generators: 1F1B, ZB1P, interleaved 1F1B (VPP), DualPipe and DualPipeV.

Each generator returns a :class:`~portapipe.scheduling.ir.Schedule` holding every rank's
ordered compute actions (no communication; :func:`portapipe.scheduling.comms.lower_comms`
adds it). Costs are not the generators' business: the simulator prices the lists.

Within one virtual stage, forwards run in micro-batch order and so do backwards; every
generator keeps that invariant, which the validator checks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from typing import Callable

from .ir import BW, Action, B, F, Kind, Schedule, W, fb, gc_paused

NAMES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")


# ----------------------------------------------------------------------------- helpers
def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def one_pipeline(name: str, m: int, stage_rank: list[int], actions: list[list[Action]], **meta: object) -> Schedule:
    """A schedule of one pipeline whose virtual stage v computes block v on rank ``stage_rank[v]``."""
    n_stages = len(stage_rank)
    return Schedule(
        name=name,
        n_ranks=len(actions),
        n_microbatches=m,
        stage_rank=list(stage_rank),
        stage_block=list(range(n_stages)),
        pipelines=[list(range(n_stages))],
        mb_pipeline=[0] * m,
        actions=actions,
        meta=dict(meta),
    )


def v_shape(pp: int) -> list[int]:
    """Ranks of DualPipeV's 2 * pp stages: down the ranks, then back up (stage s and 2pp-1-s share a rank)."""
    return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]


# ------------------------------------------------------------------------------- 1F1B
def _check_one_per_stage(name: str, pp: int, m: int) -> None:
    _check_int("pp", pp, 1)
    _check_int("microbatches", m, 1)
    if m < pp:
        raise ValueError(f"{name} needs microbatches >= pp (one micro-batch per stage at least), got microbatches={m} < pp={pp}")


def one_f_one_b(pp: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: rank r runs pp-1-r warm-up forwards, then alternates F and full
    backward, then drains the remaining backwards. Needs m >= pp."""
    _check_one_per_stage("1f1b", pp, m)
    actions = []
    for r in range(pp):
        warm = pp - 1 - r
        acts = [Action(F, r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(F, r, warm + i), Action(BW, r, i)]
        acts += [Action(BW, r, i) for i in range(m - warm, m)]
        actions.append(acts)
    return one_pipeline("1f1b", m, list(range(pp)), actions)


# ------------------------------------------------------------------------------- ZB1P
def zb1p(pp: int, m: int) -> Schedule:
    """Zero-bubble ZB-H1: the 1F1B order with each backward split into B (input gradient)
    and W (weight gradient). Rank r keeps up to r weight-gradient passes pending during the
    steady phase, and runs one pending W after each B once that many are queued; the queue
    drains at the end. The last rank thus frees its B chain early and the first rank's tail
    is filled by W passes, giving (pp-1)(F+B-2W) with the same pp activations as 1F1B."""
    _check_one_per_stage("zb1p", pp, m)
    actions = []
    for r in range(pp):
        warm = pp - 1 - r
        acts = [Action(F, r, i) for i in range(warm)]
        pending: deque[Action] = deque()
        # the number of W passes this rank may hold back: the ranks nearer the end wait less
        # for their input gradients, so they postpone more W into the drain at the end
        lag = r
        for i in range(m):
            if warm + i < m:
                acts.append(Action(F, r, warm + i))
            acts.append(Action(B, r, i))
            pending.append(Action(W, r, i))
            if len(pending) > lag:
                acts.append(pending.popleft())
        acts += list(pending)
        actions.append(acts)
    return one_pipeline("zb1p", m, list(range(pp)), actions)


# ------------------------------------------------------------------------- interleaved
def interleaved(pp: int, m: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (virtual pipeline): rank r holds virtual stages r, r+pp, ...; micro-
    batches go in rounds of pp through chunk 0, then chunk 1, ... Warm-up forwards as in
    Megatron's interleaved schedule plus one; the steady phase pairs each forward with an
    independent backward of another micro-batch into one F&B unit so the expert-parallel
    overlap applies (the extra warm-up forward is what lets the last rank pair its forward
    with an earlier micro-batch's backward; the bubble stays (pp-1)(F+B) in chunk costs);
    then the cool-down backwards. Needs chunks >= 2 and m a positive multiple of pp."""
    _check_int("pp", pp, 1)
    _check_int("microbatches", m, 1)
    _check_int("chunks", chunks, 1)
    if chunks < 2:
        raise ValueError(f"interleaved needs chunks >= 2 per rank (use 1f1b for one chunk), got chunks={chunks}")
    if m % pp:
        raise ValueError(
            f"interleaved runs micro-batches in rounds of pp, so microbatches must be a multiple of pp; got microbatches={m}, pp={pp}"
        )
    n_stages = pp * chunks
    total = m * chunks  # compute units per direction on one rank

    def unit(k: int, backward: bool) -> tuple[int, int]:
        """The k-th forward (or backward) unit of a rank: (chunk, micro-batch)."""
        group, pos = divmod(k, pp * chunks)
        chunk = (k // pp) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        return chunk, group * pp + pos % pp

    actions = []
    for r in range(pp):
        warm = min(total, (pp - 1 - r) * 2 + (chunks - 1) * pp + 1)
        acts: list[Action] = []
        for k in range(warm):
            c, mb = unit(k, False)
            acts.append(Action(F, c * pp + r, mb))
        for k in range(total - warm):
            cf, mf = unit(warm + k, False)
            cb, mbb = unit(k, True)
            f, b = Action(F, cf * pp + r, mf), Action(BW, cb * pp + r, mbb)
            # Halves of one micro-batch would depend on each other; run them in turn (a
            # safeguard: with the extra warm-up forward the sizes tested never pair them).
            acts += [f, b] if mf == mbb else [fb(f, b)]
        for k in range(total - warm, total):
            c, mb = unit(k, True)
            acts.append(Action(BW, c * pp + r, mb))
        actions.append(acts)
    return one_pipeline("interleaved", m, [s % pp for s in range(n_stages)], actions, chunks=chunks)


# ----------------------------------------------------------------- DualPipe family
# Both DualPipe and DualPipeV run one per-rank program over two "phases" (the two stages a
# rank holds). Phase 0 is the stage whose input arrives from the rank's own end of the
# pipeline, phase 1 the stage on the way back. ``half_rank`` is the rank's distance from
# the end that feeds its phase 0; ``n_half`` the number of such distances; ``n`` the
# micro-batches each phase processes. The phases follow DeepSeek's published structure:
#   1 warm-up forwards of phase 0        2 alternating forwards of both phases
#   3 B1 W1 F1 (zero-bubble warm-up)     4 steady F&B pairs (F0;B1) (F1;B0)
#   5 B1 then (F1;B0)                    6 alternating B1 B0, the second half split B/W
#   7 W then B0 (split)                  8 the remaining W passes
# Weight-gradient passes queue in order of their B and are run at the W steps.


def _dualpipe_program(half_rank: int, n_half: int, n: int) -> list[tuple[str, ...]]:
    """Symbolic per-rank program: items ("F", p), ("BW", p), ("B", p), ("W",), ("FB", pf, pb)
    and ("F_BW", pf, pb) (an unoverlapped F then BW, used at the turn of the V)."""
    prog: list[tuple[str, ...]] = []
    steps_warm = (n_half - half_rank - 1) * 2
    prog += [("F", 0)] * steps_warm
    for _ in range(half_rank + 1):
        prog += [("F", 0), ("F", 1)]
    for _ in range(n_half - half_rank - 1):
        prog += [("B", 1), ("W",), ("F", 1)]
    turn = half_rank == n_half - 1
    for i in range(n - 2 * n_half + half_rank + 1):
        if i == 0 and turn:
            # At the turn both halves feed each other on this rank: running them one after
            # the other lets F0's output and B1's gradient leave sooner.
            prog += [("F", 0), ("BW", 1)]
        else:
            prog.append(("FB", 0, 1))
        prog.append(("FB", 1, 0))
    for _ in range(n_half - half_rank - 1):
        prog += [("BW", 1), ("FB", 1, 0)]
    steps = half_rank + 1
    split = False
    for i in range(steps):
        if i == steps // 2 and half_rank % 2 == 1:
            split = True
        prog.append(("B", 1) if split else ("BW", 1))
        if i == steps // 2 and half_rank % 2 == 0:
            split = True
        prog.append(("B", 0) if split else ("BW", 0))
    for _ in range(n_half - half_rank - 1):
        prog += [("W",), ("B", 0)]
    prog += [("W",)] * (half_rank + 1)
    return prog


_OP_KIND = {"B": B, "BW": BW}


def _realise(prog: list[tuple[str, ...]], stages: tuple[int, int], mbs: tuple[list[int], list[int]]) -> list[Action]:
    """Turn a symbolic program into actions: the k-th forward (backward) of phase p runs
    micro-batch ``mbs[p][k]`` on stage ``stages[p]``; W passes pop the queue of split
    backwards in order."""
    next_f = [0, 0]
    next_b = [0, 0]
    queue: deque[Action] = deque()
    acts: list[Action] = []

    def fwd(p: int) -> Action:
        a = Action(F, stages[p], mbs[p][next_f[p]])
        next_f[p] += 1
        return a

    def bwd(p: int, kind: Kind) -> Action:
        a = Action(kind, stages[p], mbs[p][next_b[p]])
        next_b[p] += 1
        if kind is B:
            queue.append(Action(W, a.stage, a.mb))
        return a

    for item in prog:
        op = item[0]
        if op == "F":
            acts.append(fwd(item[1]))  # type: ignore[arg-type]
        elif op == "W":
            acts.append(queue.popleft())
        elif op == "FB":
            f = fwd(item[1])  # type: ignore[arg-type]
            acts.append(fb(f, bwd(item[2], BW)))  # type: ignore[arg-type]
        else:  # "B" or "BW"
            acts.append(bwd(item[1], _OP_KIND[op]))  # type: ignore[arg-type]
    if queue:
        raise AssertionError(f"program left {len(queue)} weight-gradient passes unrun")
    return acts


def dualpipev(pp: int, m: int) -> Schedule:
    """DualPipeV (DualPipe cut in half): pp ranks, 2*pp virtual stages in a V; rank r holds
    stages r and 2*pp-1-r, rank 0 feeds every micro-batch and computes the loss. Needs
    m >= 2*pp."""
    _check_int("pp", pp, 1)
    _check_int("microbatches", m, 1)
    if m < 2 * pp:
        raise ValueError(f"dualpipev needs microbatches >= 2*pp, got microbatches={m} < 2*{pp}={2 * pp}")
    n_stages = 2 * pp
    mbs = list(range(m))
    actions = [_realise(_dualpipe_program(r, pp, m), (r, n_stages - 1 - r), (mbs, mbs)) for r in range(pp)]
    return one_pipeline("dualpipev", m, v_shape(pp), actions)


def dualpipe(pp: int, m: int) -> Schedule:
    """DualPipe (bidirectional): direction 0 runs virtual stages 0..pp-1 on ranks 0..pp-1,
    direction 1 runs stages pp..2pp-1 on ranks pp-1..0, both over model blocks 0..pp-1, so
    each block lives on two ranks. Micro-batches 0..m/2-1 enter at rank 0, m/2..m-1 at rank
    pp-1. Needs even pp >= 2 and even m >= 2*pp."""
    _check_int("pp", pp, 2)
    _check_int("microbatches", m, 1)
    if pp % 2:
        raise ValueError(f"dualpipe needs an even number of pipeline ranks (two halves fed from both ends), got pp={pp}")
    if m % 2:
        raise ValueError(f"dualpipe feeds half the micro-batches from each end, so microbatches must be even; got {m}")
    if m < 2 * pp:
        raise ValueError(f"dualpipe needs microbatches >= 2*pp, got microbatches={m} < 2*{pp}={2 * pp}")
    half = m // 2
    n_half = pp // 2
    dir_mbs = [list(range(half)), list(range(half, m))]

    actions = []
    for r in range(pp):
        # phase 0 is the direction fed from the rank's own end: direction 0 on the first half
        # of the ranks, direction 1 on the second half
        stages = (r, 2 * pp - 1 - r) if r < n_half else (2 * pp - 1 - r, r)
        mbs = (dir_mbs[0], dir_mbs[1]) if r < n_half else (dir_mbs[1], dir_mbs[0])
        actions.append(_realise(_dualpipe_program(min(r, pp - 1 - r), n_half, half), stages, mbs))
    return Schedule(
        name="dualpipe",
        n_ranks=pp,
        n_microbatches=m,
        stage_rank=list(range(pp)) + list(range(pp - 1, -1, -1)),
        stage_block=list(range(pp)) * 2,
        pipelines=[list(range(pp)), list(range(pp, 2 * pp))],
        mb_pipeline=[0] * half + [1] * half,
        actions=actions,
    )


# ----------------------------------------------------------------------- entry points
def build(name: str, pp: int, microbatches: int, chunks: int = 2) -> Schedule:
    """The schedule ``name`` (one of NAMES) for ``pp`` pipeline ranks."""
    generators: dict[str, Callable[[], Schedule]] = {
        "1f1b": lambda: one_f_one_b(pp, microbatches),
        "zb1p": lambda: zb1p(pp, microbatches),
        "interleaved": lambda: interleaved(pp, microbatches, chunks),
        "dualpipe": lambda: dualpipe(pp, microbatches),
        "dualpipev": lambda: dualpipev(pp, microbatches),
    }
    if name not in generators:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(NAMES)}")
    with gc_paused():
        return generators[name]()


def pair_forwards(schedule: Schedule, blocks: Collection[int]) -> Schedule:
    """The same schedule with consecutive lone forwards run as F&F pairs (``schedule.pair_forwards``).

    Two forwards next to each other on a rank become one pair when both compute a block of
    ``blocks`` (those exchanging rows with other ranks: the pair hides one's all-to-all behind
    the other's compute, as an F&B pair does) and the second does not take the first's output;
    pairs form left to right. Where a schedule runs several forwards in a row (every warm-up)
    nothing else could overlap their exchanges. The first forward's output leaves after the
    pair, not after itself; that is the price, and where it would close a cycle (the second
    forward's input waits, through other ranks, for the first one's output: DualPipe's two
    directions) the pair is not formed. Values do not change: the forwards of two micro-batches
    share nothing."""
    from .validate import stalls

    if any(a.kind.is_comm for acts in schedule.actions for a in acts):
        raise ValueError("pair_forwards takes a schedule before its posts are added (lower_comms)")
    blocks = frozenset(blocks)
    prev, _ = schedule.links()
    exchanging = [schedule.stage_block[v] in blocks for v in range(schedule.n_stages)]

    def lone_forward(a: Action) -> bool:
        return a.kind is F and exchanging[a.stage]

    refused_at: list[set[int]] = [set() for _ in schedule.actions]  # per rank: forwards not to pair
    while True:
        actions = []
        for acts, refused in zip(schedule.actions, refused_at):
            out: list[Action] = []
            i = 0
            while i < len(acts):
                a = acts[i]
                nxt = acts[i + 1] if i + 1 < len(acts) else None
                if (
                    nxt is not None and i not in refused and lone_forward(a) and lone_forward(nxt)
                    and not (nxt.mb == a.mb and prev[nxt.stage] == a.stage)
                ):
                    out.append(fb(a, nxt))
                    i += 2
                else:
                    out.append(a)
                    i += 1
            actions.append(out)
        paired = schedule.with_actions(actions, pair_forwards=True)
        stopped = stalls(paired)
        if not stopped:
            return paired
        # a rank that stops, stops at one of the new pairs or behind one: refuse the pairs the
        # ranks stop at and pair again (each round refuses one at least, so this ends)
        at = [(r, actions[r][step]) for r, step in stopped]
        new = [(r, a.pair[0]) for r, a in at if a.ff_pair]  # type: ignore[index]
        if not new:
            return schedule
        for r, first in new:
            refused_at[r].add(schedule.actions[r].index(first))


def without_w_split(schedule: Schedule) -> Schedule:
    """The same schedule with every input-gradient B turned into a full backward BW and the W
    passes dropped (for ``schedule.w_split: false``). Communication actions are kept."""

    def full(a: Action) -> Action:
        return Action(BW, a.stage, a.mb) if a.kind is B else a

    actions = []
    for acts in schedule.actions:
        out = []
        for a in acts:
            if a.kind is W:
                continue
            if a.kind is Kind.FB:
                assert a.pair is not None
                out.append(fb(a.pair[0], full(a.pair[1])))
            else:
                out.append(full(a))
        actions.append(out)
    return schedule.with_actions(actions, w_split=False)


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in each rank's order: an evaluation's action list (an F&B
    pair keeps its forward, an F&F pair stays a pair; communication actions are dropped, for
    :func:`~.comms.lower_comms` to derive again). Every forward keeps the order and the inputs
    it had, and taking actions away from lists that run to the end never makes one wait for
    something that is not produced: the forwards run wherever the schedule does."""
    actions = []
    for acts in schedule.actions:
        out = []
        for a in acts:
            if a.kind is Kind.FB:
                assert a.pair is not None
                out.append(a if a.ff_pair else a.pair[0])
            elif a.kind is F:
                out.append(a)
        actions.append(out)
    return schedule.with_actions(actions, forward_only=True)
