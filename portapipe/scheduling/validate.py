"""Schedule validator: completeness, dependency order, send/receive matching, no deadlock.

Checks, in order (later checks run only when the earlier ones pass, so messages point at
the first real fault):

1. placement: pipelines cover every virtual stage once, micro-batches map to pipelines;
2. every action runs on the rank its stage lives on, for a micro-batch of that stage;
3. every (stage, micro-batch) gets exactly one forward and one complete backward: one BW,
   or one B plus one W;
4. same-rank order: F(v) after F(prev v), B(v) after B(next v) and after F(v), W after B;
   the two halves of an F&B unit do not depend on each other;
5. communication (on lowered lists): every cross-rank edge has one SEND right after its
   producer and one RECV before its consumer, no other comm actions, and per directed pair of
   ranks the RECVs follow the order of the SENDs (FIFO matching);
6. deadlock: the lowered lists run to the end when each compute waits for its inputs and
   posts never block. Whether that happens does not depend on the costs (a compute waits
   only on other computes and posts), so one run with unit costs decides it for every choice
   of positive costs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from .comms import has_comms, incoming, matching_send, outgoing, plan
from .ir import Action, Kind, Schedule, gc_paused


class ScheduleError(ValueError):
    """A schedule breaks one or more rules; ``problems`` lists them."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:10]
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        super().__init__(f"schedule {name!r} is invalid:\n  " + "\n  ".join(shown) + more)


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming every problem found; return None for a valid schedule."""
    found = problems(schedule)
    if found:
        raise ScheduleError(schedule.name, found)


def problems(schedule: Schedule) -> list[str]:
    """Every rule the schedule breaks, as readable lines (empty when valid)."""
    with gc_paused():
        for check in (_placement, _ownership, _completeness, _order, _comms, _deadlock):
            out = check(schedule)
            if out:
                return out
    return []


# ------------------------------------------------------------------------------ checks
def _placement(s: Schedule) -> list[str]:
    out = []
    if len(s.actions) != s.n_ranks:
        out.append(f"{len(s.actions)} action lists for n_ranks={s.n_ranks}")
    if len(s.stage_block) != len(s.stage_rank):
        out.append(f"stage_block has {len(s.stage_block)} entries, stage_rank {len(s.stage_rank)}")
    bad = [v for v, r in enumerate(s.stage_rank) if not 0 <= r < s.n_ranks]
    if bad:
        out.append(f"virtual stages {bad} are placed on ranks outside 0..{s.n_ranks - 1}")
    seen = Counter(v for p in s.pipelines for v in p)
    if sorted(seen) != list(range(s.n_stages)) or any(c != 1 for c in seen.values()):
        out.append(f"pipelines {s.pipelines} must list every virtual stage 0..{s.n_stages - 1} exactly once")
    if len(s.mb_pipeline) != s.n_microbatches:
        out.append(f"mb_pipeline has {len(s.mb_pipeline)} entries for {s.n_microbatches} micro-batches")
    if any(not 0 <= p < len(s.pipelines) for p in s.mb_pipeline):
        out.append(f"mb_pipeline names pipelines outside 0..{len(s.pipelines) - 1}")
    return out


def _ownership(s: Schedule) -> list[str]:
    out = []
    pipe_of = {v: p for p, stages in enumerate(s.pipelines) for v in stages}
    for r, acts in enumerate(s.actions):
        for a in acts:
            for h in a.halves():
                if not 0 <= h.stage < s.n_stages:
                    out.append(f"rank {r}: {a} names virtual stage {h.stage}, outside 0..{s.n_stages - 1}")
                elif s.stage_rank[h.stage] != r:
                    out.append(f"rank {r}: {a} runs stage {h.stage}, which lives on rank {s.stage_rank[h.stage]}")
                elif not 0 <= h.mb < s.n_microbatches:
                    out.append(f"rank {r}: {a} names micro-batch {h.mb}, outside 0..{s.n_microbatches - 1}")
                elif s.mb_pipeline[h.mb] != pipe_of[h.stage]:
                    out.append(f"rank {r}: {a}: micro-batch {h.mb} takes pipeline {s.mb_pipeline[h.mb]}, stage {h.stage} is in pipeline {pipe_of[h.stage]}")
    return out


def _completeness(s: Schedule) -> list[str]:
    n_mb = s.n_microbatches
    kinds = (Kind.F, Kind.B, Kind.W, Kind.BW)
    count = {k: [0] * (s.n_stages * n_mb) for k in kinds}
    for acts in s.actions:
        for a in acts:
            if a.pair is not None:
                for h in a.pair:
                    count[h.kind][h.stage * n_mb + h.mb] += 1
            elif a.kind in count:
                count[a.kind][a.stage * n_mb + a.mb] += 1
    cf, cb, cw, cbw = (count[k] for k in kinds)
    out = []
    for v in range(s.n_stages):
        for m in s.microbatches_of(v):
            i = v * n_mb + m
            f, b, w, bw = cf[i], cb[i], cw[i], cbw[i]
            if f != 1:
                out.append(f"{Action(Kind.F, v, m)} runs {f} times, expected once")
            if bw == 1 and b == 0 and w == 0 or bw == 0 and b == 1 and w == 1:
                continue
            if bw == 0 and b == 1 and w == 0:
                out.append(f"{Action(Kind.B, v, m)} has no weight-gradient pass {Action(Kind.W, v, m)}")
            elif bw == 0 and b == 0 and w == 1:
                out.append(f"{Action(Kind.W, v, m)} has no input-gradient pass {Action(Kind.B, v, m)}")
            else:
                out.append(f"stage {v} micro-batch {m}: backward as BW x{bw}, B x{b}, W x{w}; expected one BW or one B and one W")
    return out


def _order(s: Schedule) -> list[str]:
    out = []
    n_mb = s.n_microbatches
    for r, acts in enumerate(s.actions):
        # step of each compute half on this rank, keyed (class * n_stages + stage) * n_mb + mb
        # with class 0 forward, 1 input gradient (B or BW), 2 weights
        where: dict[int, int] = {}
        halves: list[tuple[int, Action, Action]] = []
        for i, a in enumerate(acts):
            if a.kind.is_comm:
                continue
            for h in a.pair if a.pair is not None else (a,):
                where[(_ORDER_CLASS[h.kind] * s.n_stages + h.stage) * n_mb + h.mb] = i
                halves.append((i, a, h))
        for i, a, h in halves:
            for dep in _same_rank_needs(s, h):
                j = where.get((_ORDER_CLASS[dep[0]] * s.n_stages + dep[1]) * n_mb + dep[2])
                if j is None or j < i:
                    continue  # missing actions are _completeness's business
                name = _name(dep)
                if j > i:
                    out.append(f"rank {r}: {h} at step {i} runs before {name} at step {j}, which it needs")
                else:
                    out.append(f"rank {r}: {a} at step {i} pairs {h} with {name}, which it needs; a pair's halves must be independent")
    return out


_ORDER_CLASS = {Kind.F: 0, Kind.B: 1, Kind.BW: 1, Kind.W: 2}


def _comms(s: Schedule) -> list[str]:
    if not has_comms(s):
        return []
    out = []
    sends: dict[Action, tuple[int, int]] = {}
    recvs: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                continue
            table = sends if a.kind in (Kind.SEND_F, Kind.SEND_B) else recvs
            if a in table:
                out.append(f"rank {r}: {a} posted twice (steps {table[a][1]} and {i})")
            table[a] = (r, i)
    expected_sends: set[Action] = set()
    expected_recvs: set[Action] = set()
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if not a.kind.is_compute:
                continue
            for h in a.halves():
                for send in outgoing(s, h):
                    expected_sends.add(send)
                    got = sends.get(send)
                    if got is None:
                        out.append(f"rank {r}: {h} at step {i} feeds another rank but no {send} follows it")
                    elif got[0] != r or got[1] < i:
                        out.append(f"{send} at rank {got[0]} step {got[1]} is not after its producer {h} (rank {r} step {i})")
                for recv, _ in incoming(s, h):
                    expected_recvs.add(recv)
                    got = recvs.get(recv)
                    if got is None:
                        out.append(f"rank {r}: {h} at step {i} needs {recv}, which is never posted")
                    elif got[0] != r or got[1] > i:
                        out.append(f"{recv} at rank {got[0]} step {got[1]} is not before its consumer {h} (rank {r} step {i})")
    for a in sends.keys() - expected_sends:
        out.append(f"rank {sends[a][0]}: {a} has no receiver (no cross-rank consumer of stage {a.stage} micro-batch {a.mb})")
    for a in recvs.keys() - expected_recvs:
        out.append(f"rank {recvs[a][0]}: {a} has no sender (no cross-rank producer for stage {a.stage} micro-batch {a.mb})")
    if out:
        return out
    # FIFO: per (src, dst), receive order == send order
    channel_sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for send, (r, i) in sorted(sends.items(), key=lambda kv: kv[1]):
        channel_sends[(r, recvs[_recv_of(s, send)][0])].append(send)
    channel_recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for recv, (r, i) in sorted(recvs.items(), key=lambda kv: kv[1]):
        send = matching_send(s, recv)
        channel_recvs[(sends[send][0], r)].append(send)
    for ch, order in channel_sends.items():
        got = channel_recvs[ch]
        if got != order:
            k = next(i for i, (x, y) in enumerate(zip(order, got)) if x != y)
            out.append(
                f"ranks {ch[0]}->{ch[1]}: message {k} is sent as {order[k]} but received as the match of {got[k]}; "
                "receives must follow the send order on each pair of ranks"
            )
    return out


def _deadlock(s: Schedule) -> list[str]:
    lists = s.actions if has_comms(s) else plan(s)  # the lowered lists, posts as light tuples
    stuck, unposted = _run(s, lists)
    if unposted:
        return [unposted]
    if not stuck:
        return []
    lines = [f"rank {r} waits at step {i} ({_show(lists[r][i])})" for r, i in stuck[:8]]
    more = f" and {len(stuck) - 8} more ranks" if len(stuck) > 8 else ""
    return ["schedule cannot finish: " + "; ".join(lines) + more + " (steps count in the lowered lists)"]


def stalls(s: Schedule) -> list[tuple[int, int]]:
    """Where the ranks of a schedule that cannot finish stop: (rank, index of the compute action
    in its list without posts), for every rank that stops; empty when it finishes."""
    lists = plan(s)
    stuck, _ = _run(s, lists)
    out = []
    for r, i in stuck:
        out.append((r, sum(1 for a in lists[r][:i] if a.__class__ is not tuple and a.kind.is_compute)))
    return out


def _run(s: Schedule, lists: list[list[Any]]) -> tuple[list[tuple[int, int]], str]:
    """Run the lowered lists without costs: a compute proceeds once every input is there (a
    same-rank input computed; a cross-rank one sent by its producer's SEND and received by a
    RECV posted earlier on this rank); posts always proceed. Finishing does not depend on
    costs, so this decides deadlock freedom for all positive costs at once. Returns where the
    ranks that cannot finish stop (rank, step of the lowered list), and a problem line if a
    compute consumes a transfer whose receive is not posted before it."""
    n_st, n_mb = s.n_stages, s.n_microbatches
    prev, nxt = s.links()
    rank_of = s.stage_rank
    # completion keys (class * n_st + stage) * n_mb + mb, classes as in the simulator
    code = {Kind.F: 0, Kind.B: 1, Kind.BW: 1, Kind.W: 2, Kind.SEND_F: 3, Kind.SEND_B: 4, Kind.RECV_F: 5, Kind.RECV_B: 6}
    stride = n_st * n_mb
    needs_of: dict[tuple[Kind, int], tuple[tuple[int, int], ...]] = {}

    def needs(kind: Kind, v: int) -> tuple[tuple[int, int], ...]:
        """(key base, RECV key base or -1) per input of (kind, stage v)."""
        src: list[tuple[int, int]] = []
        if kind is Kind.F and prev[v] is not None:
            src.append((0, prev[v]))  # type: ignore[arg-type]
        elif kind is Kind.B or kind is Kind.BW:
            src.append((0, v))
            if nxt[v] is not None:
                src.append((1, nxt[v]))  # type: ignore[arg-type]
        elif kind is Kind.W:
            src.append((1, v))
        out = []
        for cls, u in src:
            if rank_of[u] == rank_of[v]:
                out.append(((cls * n_st + u) * n_mb, -1))
            else:
                send, recv = (3, 5) if cls == 0 else (4, 6)
                out.append(((send * n_st + u) * n_mb, (recv * n_st + v) * n_mb))
        needs_of[(kind, v)] = res = tuple(out)
        return res

    done = bytearray(7 * stride)
    pos = [0] * s.n_ranks
    waiting: dict[int, list[int]] = {}
    todo = list(range(s.n_ranks))
    while todo:
        r = todo.pop()
        acts = lists[r]
        i = pos[r]
        made: list[int] = []
        while i < len(acts):
            a = acts[i]
            if a.__class__ is tuple or a.kind.is_comm:  # a post: never waits
                kind, v, m = a if a.__class__ is tuple else (a.kind, a.stage, a.mb)
                k = (code[kind] * n_st + v) * n_mb + m
                done[k] = 1
                made.append(k)
                i += 1
                continue
            blocked = -1
            for h in a.pair if a.pair is not None else (a,):
                m = h.mb
                for base, recv in needs_of.get((h.kind, h.stage)) or needs(h.kind, h.stage):
                    if not done[base + m]:
                        blocked = base + m
                        break
                    if recv >= 0 and not done[recv + m]:
                        return [], f"rank {r}: {a} at step {i} consumes a transfer whose receive is not posted before it"
                if blocked >= 0:
                    break
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            for h in a.pair if a.pair is not None else (a,):
                k = (code[h.kind] * n_st + h.stage) * n_mb + h.mb
                done[k] = 1
                made.append(k)
            i += 1
        pos[r] = i
        for k in made:
            woken = waiting.pop(k, None)
            if woken:
                todo.extend(woken)
    return [(r, pos[r]) for r in range(s.n_ranks) if pos[r] < len(lists[r])], ""


def _show(a: object) -> str:
    return str(Action(*a) if a.__class__ is tuple else a)  # type: ignore[misc]


# ----------------------------------------------------------------------------- helpers
def _same_rank_needs(s: Schedule, h: Action) -> list[tuple[Kind, int, int]]:
    """Dependencies of a compute half on the same rank, keyed (F|B|W, stage, mb); B stands
    for the input-gradient pass whether it runs as B or BW."""
    prev, nxt = s.links()
    rank_of = s.stage_rank
    here = rank_of[h.stage]
    k = h.kind
    if k is Kind.F:
        p = prev[h.stage]
        return [(Kind.F, p, h.mb)] if p is not None and rank_of[p] == here else []
    if k is Kind.B or k is Kind.BW:
        n = nxt[h.stage]
        if n is not None and rank_of[n] == here:
            return [(Kind.F, h.stage, h.mb), (Kind.B, n, h.mb)]
        return [(Kind.F, h.stage, h.mb)]
    if k is Kind.W:
        return [(Kind.B, h.stage, h.mb)]
    return []


def _name(dep: tuple[Kind, int, int]) -> str:
    kind, v, m = dep
    return f"{v}{kind.value}{m}" if kind is not Kind.B else f"the backward of stage {v} micro-batch {m}"


def _recv_of(s: Schedule, send: Action) -> Action:
    if send.kind is Kind.SEND_F:
        nxt = s.next_stage(send.stage)
        assert nxt is not None
        return Action(Kind.RECV_F, nxt, send.mb)
    prv = s.prev_stage(send.stage)
    assert prv is not None
    return Action(Kind.RECV_B, prv, send.mb)
