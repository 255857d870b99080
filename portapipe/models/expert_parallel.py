"""Expert parallelism: routed experts sharded over the EP group, tokens moved by all-to-all.

EP rank ``j`` of ``ep`` holds the logical experts ``[j*E/ep, (j+1)*E/ep)``. A dispatch sends
each (token, k) row to the rank holding its expert; rows arrive grouped by source rank, then
by expert (the all-to-all keeps the sender's order), and run as one grouped matmul whose groups
are (source, expert) pairs in that order. Combine is the same exchange with the splits swapped.

The exchanges themselves (asynchronous with timing, or as an autograd function) are the
scheduling layer's (:mod:`portapipe.scheduling.exchange`): :class:`ExpertParallel` is an
:class:`~portapipe.scheduling.exchange.ExchangeGroup` that also knows which experts live where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..scheduling.exchange import ExchangeGroup


@dataclass
class ExpertParallel(ExchangeGroup):
    """This rank's place in the EP group, the transport used for dispatch / combine, and the balancer."""

    #: the expert balancer (portapipe.balancing.runtime.ExpertBalancer) when balancer.kind is not
    #: none: it places logical experts in physical slots and routes tokens to them
    balancer: Any = None

    def local_experts(self, n_experts: int) -> int:
        if n_experts % self.size:
            raise ValueError(f"{n_experts} experts do not split over {self.size} EP ranks")
        return n_experts // self.size

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        per = self.local_experts(n_experts)
        return self.rank * per, (self.rank + 1) * per


@dataclass
class DispatchPlan:
    """Where each (token, k) row of one micro-batch goes and how received rows are grouped.

    ``order``: flat (token*k + slot) indices sorted by expert (stable), the send order.
    ``send_splits`` / ``recv_splits``: rows to / from each EP rank.
    ``offs``: cumulative received rows per (source rank, local expert), source-major: the
    grouped-matmul offsets. Each source's rows for an expert form a group of their own, so a
    row meets exactly the neighbours it would meet in a single process running that source's
    micro-batch (matmul kernels may round a row differently depending on the rows around it).
    ``counts``: rows this rank routed to each expert id it was given (logical experts, or
    physical slots when a balancer routes; for load statistics).
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    offs: torch.Tensor
    counts: torch.Tensor
    #: received row feeding each grouped-matmul row: the identity, as groups follow arrival order
    expert_perm: torch.Tensor
    #: position in ``order`` of each flat (token*k + slot) row: ``inverse_order[order] = arange``
    inverse_order: torch.Tensor


def plan_dispatch(ep: ExpertParallel, topk_idx: torch.Tensor, n_experts: int) -> DispatchPlan:
    """Sort rows by expert and agree with the other EP ranks on the row counts (one small exchange)."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).to(torch.int64)
    per = ep.local_experts(n_experts)
    send_splits = counts.view(ep.size, per).sum(1).tolist()
    if ep.size == 1:
        recv_counts = counts.view(1, per)
    else:
        got = torch.empty_like(counts)
        ep.backend.all_to_all_single(got, counts, group=ep.group)
        recv_counts = got.view(ep.size, per)  # [source rank, local expert]
    recv_splits = recv_counts.sum(1).tolist()
    offs = torch.cumsum(recv_counts.reshape(-1), 0)
    identity = torch.arange(int(sum(recv_splits)), device=flat.device)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return DispatchPlan(order, send_splits, recv_splits, offs, counts, identity, inverse)
