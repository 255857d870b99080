"""Communication lowering: insert SEND/RECV actions into each rank's compute list.

Semantics (the executor posts every SEND/RECV without blocking; only the compute that
consumes a received tensor waits for it):

- ``SEND_F(v, m)`` sends stage v's output activation to the rank of ``next_stage(v)``; it is
  placed right after the compute that produced it. ``SEND_B(v, m)`` sends stage v's input
  gradient to the rank of ``prev_stage(v)``, right after the B/BW that produced it.
- ``RECV_F(v, m)`` receives stage v's input activation, ``RECV_B(v, m)`` the gradient of stage
  v's output. A RECV is posted before the compute action that precedes its consumer, so the
  transfer overlaps that compute (at the start of the list when the consumer is the first
  or second compute).
- Receives are kept in per-channel FIFO order: on every directed pair of ranks (src -> dst),
  dst posts its RECVs from src in the order src posts the matching SENDs, so transports that
  match point-to-point messages by order (NCCL, untagged gloo) pair them correctly. Where
  consumption order differs from sending order, a RECV is posted earlier than its default
  place (never later).
- Edges between two stages on the same rank get no actions: the tensor is handed over in
  memory.

Matching: ``SEND_F(v, m)`` on ``stage_rank[v]`` <-> ``RECV_F(next(v), m)`` on
``stage_rank[next(v)]``; ``SEND_B(v, m)`` <-> ``RECV_B(prev(v), m)``.
"""

from __future__ import annotations

from collections import defaultdict

from .ir import Action, Kind, Schedule, gc_paused

Message = tuple[int, int, Kind, int, int]  # (src rank, dst rank, SEND kind, stage, mb)


def outgoing(schedule: Schedule, half: Action) -> list[Action]:
    """The SEND actions a compute half posts right after it runs (cross-rank edges only)."""
    here = schedule.stage_rank[half.stage]
    if half.kind is Kind.F:
        nxt = schedule.next_stage(half.stage)
        if nxt is not None and schedule.stage_rank[nxt] != here:
            return [Action(Kind.SEND_F, half.stage, half.mb)]
    elif half.kind in (Kind.B, Kind.BW):
        prv = schedule.prev_stage(half.stage)
        if prv is not None and schedule.stage_rank[prv] != here:
            return [Action(Kind.SEND_B, half.stage, half.mb)]
    return []


def incoming(schedule: Schedule, half: Action) -> list[tuple[Action, Action]]:
    """(RECV action, matching SEND action) pairs a compute half needs from other ranks."""
    here = schedule.stage_rank[half.stage]
    if half.kind is Kind.F:
        prv = schedule.prev_stage(half.stage)
        if prv is not None and schedule.stage_rank[prv] != here:
            return [(Action(Kind.RECV_F, half.stage, half.mb), Action(Kind.SEND_F, prv, half.mb))]
    elif half.kind in (Kind.B, Kind.BW):
        nxt = schedule.next_stage(half.stage)
        if nxt is not None and schedule.stage_rank[nxt] != here:
            return [(Action(Kind.RECV_B, half.stage, half.mb), Action(Kind.SEND_B, nxt, half.mb))]
    return []


def matching_send(schedule: Schedule, recv: Action) -> Action:
    """The SEND that feeds ``recv``."""
    if recv.kind is Kind.RECV_F:
        prv = schedule.prev_stage(recv.stage)
        if prv is None:
            raise ValueError(f"{recv}: stage {recv.stage} is a first stage and receives no activation")
        return Action(Kind.SEND_F, prv, recv.mb)
    if recv.kind is Kind.RECV_B:
        nxt = schedule.next_stage(recv.stage)
        if nxt is None:
            raise ValueError(f"{recv}: stage {recv.stage} is a last stage and receives no gradient")
        return Action(Kind.SEND_B, nxt, recv.mb)
    raise ValueError(f"{recv} is not a RECV action")


def has_comms(schedule: Schedule) -> bool:
    return any(a.kind.is_comm for acts in schedule.actions for a in acts)


Post = tuple  # (Kind, stage, mb) of a SEND/RECV in a plan; an Action once materialised


def plan(schedule: Schedule) -> list[list[Action | Post]]:
    """Each rank's lowered list with comm actions as light (Kind, stage, mb) tuples and the
    compute actions as they are. :func:`lower_comms` materialises it; the validator's
    deadlock check runs it directly (long schedules hold hundreds of thousands of posts)."""
    with gc_paused():
        return _plan(schedule)


def _plan(schedule: Schedule) -> list[list[Action | Post]]:
    compute = [[a for a in acts if a.kind.is_compute] for acts in schedule.actions]
    prev, nxt = schedule.links()
    rank_of = schedule.stage_rank
    F_, B_, BW_ = Kind.F, Kind.B, Kind.BW
    # per stage: the rank its output / its input gradient goes to (None: same rank or none)
    f_dst = [rank_of[n] if n is not None and rank_of[n] != rank_of[v] else None for v, n in enumerate(nxt)]
    b_dst = [rank_of[p] if p is not None and rank_of[p] != rank_of[v] else None for v, p in enumerate(prev)]

    # SENDs follow their producer; number each channel's messages in send order. Indices of
    # sends live in a flat list keyed (direction * n_stages + stage) * n_mb + mb.
    n, n_mb = schedule.n_ranks, schedule.n_microbatches
    n_st = len(rank_of)
    SEND_F, SEND_B, RECV_F, RECV_B = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B
    send_index = [0] * (2 * n_st * n_mb)
    channel_len = [[0] * n for _ in range(n)]
    sends_after: list[list[list[Post]]] = []
    for src, acts in enumerate(compute):
        per_action = []
        counts = channel_len[src]
        for a in acts:
            posts: list[Post] = []
            for h in a.pair if a.pair is not None else (a,):
                k, v = h.kind, h.stage
                if k is F_:
                    dst = f_dst[v]
                    if dst is not None:
                        posts.append((SEND_F, v, h.mb))
                        send_index[v * n_mb + h.mb] = counts[dst]
                        counts[dst] += 1
                elif k is B_ or k is BW_:
                    dst = b_dst[v]
                    if dst is not None:
                        posts.append((SEND_B, v, h.mb))
                        send_index[(n_st + v) * n_mb + h.mb] = counts[dst]
                        counts[dst] += 1
            per_action.append(posts)
        sends_after.append(per_action)

    out_lists: list[list[Action | Post]] = []
    for dst, acts in enumerate(compute):
        # per channel from src: (send index, default slot, RECV) for each message consumed here
        wanted: dict[int, list[tuple[int, int, Post]]] = defaultdict(list)
        for i, a in enumerate(acts):
            slot = i - 1 if i > 0 else 0  # before the compute preceding the consumer
            for h in a.pair if a.pair is not None else (a,):
                k, v, m = h.kind, h.stage, h.mb
                if k is F_:
                    if b_dst[v] is not None:
                        u = prev[v]
                        wanted[rank_of[u]].append((send_index[u * n_mb + m], slot, (RECV_F, v, m)))  # type: ignore[index,operator]
                elif k is B_ or k is BW_:
                    if f_dst[v] is not None:
                        u = nxt[v]
                        wanted[rank_of[u]].append((send_index[(n_st + u) * n_mb + m], slot, (RECV_B, v, m)))  # type: ignore[index,operator]
        before: dict[int, list[Post]] = defaultdict(list)
        for src, msgs in wanted.items():
            if len(msgs) != channel_len[src][dst]:
                raise ValueError(f"rank {dst} consumes {len(msgs)} of the {channel_len[src][dst]} messages rank {src} sends it")
            msgs.sort()  # send order
            # walk backwards: a RECV may move earlier so receives keep the send order
            latest = len(acts)
            placed = []
            for _, slot, recv in reversed(msgs):
                if slot < latest:
                    latest = slot
                placed.append((latest, recv))
            for pos, recv in reversed(placed):
                before[pos].append(recv)  # per channel in send order
        out: list[Action | Post] = []
        after = sends_after[dst]
        for i, a in enumerate(acts):
            if i in before:
                out += before[i]
            out.append(a)
            out += after[i]
        out_lists.append(out)
    return out_lists


def lower_comms(schedule: Schedule) -> Schedule:
    """``schedule`` with SEND/RECV actions inserted (see the module docstring). On an already
    lowered schedule, existing comm actions are dropped and derived again."""
    with gc_paused():
        lowered = [[Action(*a) if a.__class__ is tuple else a for a in acts] for acts in _plan(schedule)]
    return schedule.with_actions(lowered)
