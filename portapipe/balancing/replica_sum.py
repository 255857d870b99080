"""The gradient of a replicated expert summed between the EP ranks that hold it, and only those.

Each replica of an expert saw only its own tokens, so the expert's gradient is the sum of its
replicas' rows, and every replica must take that same sum (replicas stay bit-identical through
their optimizer steps). An all-reduce over the EP group would add a row of zeros for every rank
that does not hold the expert and move every replicated expert through every rank; here each
holder sends its rows only to the other holders of the same expert (one uneven
``all_to_all_single`` for all layers and tensors of a step):

- a holder first adds its own replicas of the expert (its local slots in slot order): its *part*;
- it sends that part to every other holder and receives theirs;
- every holder then adds the parts in ascending EP-rank order, starting from zeros, so each one
  performs the same additions in the same order and ends with a bit-identical total.

An expert whose replicas all sit on one rank is summed locally and never sent.

When experts have many holders (EPLB with several redundant slots on a small EP group) the
exchange can send as much as an all-reduce of every replicated expert over the group, which a
ring all-reduce moves faster per byte; then the parts are summed by one all-reduce instead (its
result is the same on every rank too). The choice is a function of the placement, so every rank
makes the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HolderPlan:
    """What one EP rank exchanges for one MoE layer's replicated experts.

    ``slots``: the rank's local slots holding a replicated expert; ``pos``: the index of each
    one's expert in the rank's list of held replicated experts (ascending expert id);
    ``shared``: for every other EP rank holding some of them, the positions (ascending) of the
    experts both hold. The same on every rank: ``exchange`` (whether any two EP ranks share a
    replicated expert in this layer: it decides whether a collective runs), ``most_sent`` (the
    most parts any rank sends) and ``replicated`` (replicated experts in the layer); ``rep``:
    each held expert's index among the layer's replicated experts.
    """

    slots: torch.Tensor
    pos: torch.Tensor
    held: int
    shared: dict[int, torch.Tensor]
    exchange: bool
    most_sent: int
    replicated: int
    rep: torch.Tensor


def holder_plan(phy2log: torch.Tensor, ep: int, rank: int) -> HolderPlan:
    """The :class:`HolderPlan` of EP rank ``rank`` for one layer's ``phy2log[slots]``."""
    per = phy2log.numel() // ep
    owner = torch.arange(phy2log.numel()) // per
    counts = torch.bincount(phy2log, minlength=int(phy2log.max()) + 1)
    replicated = counts[phy2log] > 1  # per slot
    holders: dict[int, list[int]] = {}
    for slot in replicated.nonzero().flatten().tolist():
        ranks = holders.setdefault(int(phy2log[slot]), [])
        if int(owner[slot]) not in ranks:
            ranks.append(int(owner[slot]))
    mine = sorted(e for e, ranks in holders.items() if rank in ranks)
    index = {e: i for i, e in enumerate(mine)}
    local = phy2log[rank * per:(rank + 1) * per].tolist()
    slots = [s for s, e in enumerate(local) if e in index]
    shared: dict[int, list[int]] = {}
    for e in mine:
        for peer in holders[e]:
            if peer != rank:
                shared.setdefault(peer, []).append(index[e])
    return HolderPlan(
        slots=torch.tensor(slots, dtype=torch.int64),
        pos=torch.tensor([index[local[s]] for s in slots], dtype=torch.int64),
        held=len(mine),
        shared={peer: torch.tensor(p, dtype=torch.int64) for peer, p in sorted(shared.items())},
        exchange=any(len(ranks) > 1 for ranks in holders.values()),
        most_sent=max(sum(len(ranks) - 1 for ranks in holders.values() if r in ranks) for r in range(ep)),
        replicated=len(holders),
        rep=torch.tensor([sorted(holders).index(e) for e in mine], dtype=torch.int64),
    )


#: an all-to-all's time per byte over a ring all-reduce's, for the same bytes sent per rank
#: (benchmarks/balancer_collectives.py on gloo, ep 4: 1.3x at redundant 2, 1.7x at redundant 1)
EXCHANGE_PER_BYTE = 1.5


def exchange_pays(jobs: list[tuple[torch.Tensor, HolderPlan]], ep: int) -> bool:
    """Whether the holder exchange beats one all-reduce of every replicated expert (the same on every rank)."""
    exchanged = sum(plan.most_sent * rows.shape[1] for rows, plan in jobs)
    reduced = sum(plan.replicated * rows.shape[1] for rows, plan in jobs) * 2 * (ep - 1) / ep
    return EXCHANGE_PER_BYTE * exchanged < reduced


def sum_over_holders(jobs: list[tuple[torch.Tensor, HolderPlan]], backend: Any, group: Any, ep: int, rank: int,
                     how: str = "auto") -> int:
    """Give every replica slot of ``jobs`` (``rows[local slots, n]``, each with its layer's plan)
    its expert's total over all holders, in place. Collective over the EP group when any plan
    exchanges (every EP rank passes the same layers and ``how``). ``how``: ``exchange`` or
    ``all_reduce`` forces a path, ``auto`` takes the one :func:`exchange_pays` says. Returns the
    bytes this rank sent."""
    if how not in ("auto", "exchange", "all_reduce"):
        raise ValueError(f"how: {how!r}; expected auto, exchange or all_reduce")
    if not jobs:
        return 0
    if len({rows.dtype for rows, _ in jobs}) != 1:
        raise TypeError("expert gradients of different dtypes cannot share one replica exchange")
    parts = []
    for rows, plan in jobs:
        slots, pos = plan.slots.to(rows.device), plan.pos.to(rows.device)
        parts.append(rows.new_zeros(plan.held, rows.shape[1]).index_add_(0, pos, rows.index_select(0, slots)))
    collective = ep > 1 and any(plan.exchange for _, plan in jobs)
    if collective and (how == "all_reduce" or how == "auto" and not exchange_pays(jobs, ep)):
        return _all_reduce(jobs, parts, backend, group, ep)
    received: list[dict[int, torch.Tensor]] = [{} for _ in jobs]
    sent = 0
    if collective:
        # per peer: every job's shared parts, in job order (the peer builds the same order)
        sizes = [[len(plan.shared.get(peer, ())) * rows.shape[1] for rows, plan in jobs] for peer in range(ep)]
        send = torch.cat([parts[j][plan.shared[peer].to(rows.device)].reshape(-1)
                          for peer in range(ep) for j, (rows, plan) in enumerate(jobs) if peer in plan.shared]
                         or [jobs[0][0].new_zeros(0)])
        splits = [sum(s) for s in sizes]
        recv = send.new_empty(sum(splits))
        backend.all_to_all_single(recv, send, splits, splits, group=group)
        sent = send.numel() * send.element_size()
        at = 0
        for peer in range(ep):
            for j, (rows, plan) in enumerate(jobs):
                n = sizes[peer][j]
                if n:
                    received[j][peer] = recv[at:at + n].view(-1, rows.shape[1])
                    at += n
    for (rows, plan), part, got in zip(jobs, parts, received):
        total = torch.zeros_like(part)
        for peer in range(ep):  # ascending rank order on every holder: bit-identical totals
            if peer == rank:
                total += part
            elif peer in got:
                total.index_add_(0, plan.shared[peer].to(rows.device), got[peer])
        rows.index_copy_(0, plan.slots.to(rows.device), total.index_select(0, plan.pos.to(rows.device)))
    return sent


def _all_reduce(jobs: list[tuple[torch.Tensor, HolderPlan]], parts: list[torch.Tensor], backend: Any, group: Any, ep: int) -> int:
    """Every rank's parts in one row per replicated expert (zeros where it holds none), summed over the group."""
    bufs = []
    for (rows, plan), part in zip(jobs, parts):
        bufs.append(part.new_zeros(plan.replicated, part.shape[1]).index_copy_(0, plan.rep.to(part.device), part))
    flat = torch.cat([b.reshape(-1) for b in bufs])
    backend.all_reduce(flat, group=group)
    at = 0
    for (rows, plan), buf in zip(jobs, bufs):
        total = flat[at:at + buf.numel()].view_as(buf)
        at += buf.numel()
        rows.index_copy_(0, plan.slots.to(rows.device), total.index_select(0, plan.rep.to(rows.device)).index_select(0, plan.pos.to(rows.device)))
    return int(flat.numel() * flat.element_size() * 2 * (ep - 1) / ep)  # as a ring all-reduce sends
