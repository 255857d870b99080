"""Expert parallelism: routed experts sharded over the EP group, tokens moved by all-to-all.

EP rank ``j`` of ``ep`` holds the logical experts ``[j*E/ep, (j+1)*E/ep)``. A dispatch sends
each (token, k) row to the rank holding its expert; rows arrive grouped by source rank, then
by expert (the all-to-all keeps the sender's order), and run as a grouped matmul whose groups
are (source, expert) pairs in that order. Combine is the same exchange with the splits swapped.

Before the rows, the ranks exchange how many rows each sends each expert. :func:`plan_dispatch`
starts that small exchange and returns at once: what a rank sends is known from its own
routing, and the plan's receiving side waits for the counts when first read, so the MoE
program yields while they travel (an F&B pair's other micro-batch computes meanwhile).

The rows a rank routes to its own experts need no exchange: the dispatch and the combine carry
only the rows of the other ranks (this rank's split is 0 both ways), and the local rows go to
the experts without leaving the rank, so their compute can run while an exchange of the remote
rows travels (see :meth:`portapipe.models.layer.Layer.moe_program`).

Each sent row carries its router weight as one more column (:func:`with_weights`), so the
weights need no exchange of their own, nor their gradients in the backward; the receiver splits
them off (:func:`split_weights`). Moving a value changes nothing about it, so this is exact.

The exchanges themselves (asynchronous with timing, or as an autograd function) are the
scheduling layer's (:mod:`portapipe.scheduling.exchange`): :class:`ExpertParallel` is an
:class:`~portapipe.scheduling.exchange.ExchangeGroup` that also knows which experts live where.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..scheduling import spans
from ..scheduling.exchange import A2AStats, ExchangeGroup, Pending


@dataclass
class ExpertParallel(ExchangeGroup):
    """This rank's place in the EP group, the transport used for dispatch / combine, and the balancer."""

    #: the expert balancer (portapipe.balancing.runtime.ExpertBalancer) when balancer.kind is not
    #: none: it places logical experts in physical slots and routes tokens to them
    balancer: Any = None
    #: the time of the exchanges of row counts that precede each dispatch (:func:`plan_dispatch`),
    #: apart from the rows' (``stats``): the executor reports them as ``counts_a2a_*``
    counts_stats: A2AStats = field(default_factory=A2AStats)

    def local_experts(self, n_experts: int) -> int:
        if n_experts % self.size:
            raise ValueError(f"{n_experts} experts do not split over {self.size} EP ranks")
        return n_experts // self.size

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        per = self.local_experts(n_experts)
        return self.rank * per, (self.rank + 1) * per


class Received(NamedTuple):
    """The receiving side of a :class:`DispatchPlan`: what the other ranks' counts decide."""

    recv_splits: list[int]
    offs: torch.Tensor
    #: ``recv_splits`` with this rank's entry 0: what the dispatch receives
    remote_recv_splits: list[int]
    #: grouped-matmul offsets of the received (remote) rows: (source, expert) groups, source-major
    remote_offs: torch.Tensor
    #: rows received from each other rank, in ``remote_offs``' order (each a tile of the local experts' groups)
    remote_tile_rows: list[int]


class _Receiving:
    """A field of the plan's receiving side, read through :meth:`DispatchPlan._receive` (which
    waits for the counts the first time)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, plan: Any, owner: type | None = None) -> Any:
        return self if plan is None else getattr(plan._receive(), self.name)


@dataclass
class DispatchPlan:
    """Where each (token, k) row of one micro-batch goes and how received rows are grouped.

    ``order``: flat (token*k + slot) indices sorted by expert (stable).
    ``send_splits`` / ``recv_splits``: rows to / from each EP rank, this one included.
    ``offs``: cumulative received rows per (source rank, local expert), source-major: the
    grouped-matmul offsets. Each source's rows for an expert form a group of their own, so a
    row meets exactly the neighbours it would meet in a single process running that source's
    micro-batch (matmul kernels may round a row differently depending on the rows around it).
    ``counts``: rows this rank routed to each expert id it was given (logical experts, or
    physical slots when a balancer routes; for load statistics).

    What the rank sends is known from its own routing; what it receives takes the other ranks'
    counts, which travel in a small exchange started by :func:`plan_dispatch`. The fields that
    need them (``recv_splits``, ``offs``, ``remote_recv_splits``, ``remote_offs``,
    ``remote_tile_rows``) wait for that exchange when first read, so a caller may compute
    something else while it travels (:attr:`counts_exchange`) and can never read them early.
    """

    order: torch.Tensor
    send_splits: list[int]
    counts: torch.Tensor
    #: ``order`` with this rank's own rows moved to the end: the remote rows (rank order, what
    #: the dispatch sends), then the local ones (what the local experts take without an exchange)
    send_order: torch.Tensor
    #: rows sent to other ranks: ``send_order[:n_remote]``
    n_remote: int
    #: the exchanged splits: ``send_splits`` with this rank's entry 0
    remote_send_splits: list[int]
    #: grouped-matmul offsets of the local rows: one group per local expert
    local_offs: torch.Tensor
    #: position in ``send_order`` of each flat (token*k + slot) row: ``inverse_order[send_order] = arange``
    inverse_order: torch.Tensor
    #: this rank's place in the EP group and the local experts per rank
    rank: int
    per: int
    #: the counts exchange: rows per (source rank, local expert) as they arrive (``_received``
    #: once it is waited for); None when nothing travels
    counts_exchange: Any = None
    _received: torch.Tensor | None = None
    _recv: Received | None = field(default=None, repr=False)

    def _receive(self) -> Received:
        if self._recv is None:
            got = self._received if self.counts_exchange is None else self.counts_exchange.wait()
            recv_counts = got.view(-1, self.per)  # [source rank, local expert]
            recv_splits = recv_counts.sum(1).tolist()
            others = [j for j in range(len(recv_splits)) if j != self.rank]
            self._recv = Received(
                recv_splits,
                torch.cumsum(recv_counts.reshape(-1), 0),
                [0 if j == self.rank else n for j, n in enumerate(recv_splits)],
                torch.cumsum(recv_counts[others].reshape(-1), 0),
                [recv_splits[j] for j in others],
            )
        return self._recv

    recv_splits = _Receiving()
    offs = _Receiving()
    remote_recv_splits = _Receiving()
    remote_offs = _Receiving()
    remote_tile_rows = _Receiving()


def plan_dispatch(ep: ExpertParallel, topk_idx: torch.Tensor, n_experts: int, layer: int | None = None) -> DispatchPlan:
    """Sort rows by expert and start the small exchange of row counts with the other EP ranks
    (asynchronous: the plan's receiving side waits for it when first read; ``layer`` names it on a
    recorded step)."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).to(torch.int64)
    per = ep.local_experts(n_experts)
    send_splits = counts.view(ep.size, per).sum(1).tolist()
    pending = None
    if ep.size > 1:
        got = torch.empty_like(counts)
        token = None
        if spans.RECORDER.get() is not None:  # a recorded step: the counts' exchange is issued now
            token = spans.begin(spans.EXCHANGES, ("counts", layer), {"bytes": counts.numel() * counts.element_size(), "rows_from": [per] * ep.size})
        pending = Pending(got, ep.backend.all_to_all_single(got, counts, group=ep.group, async_op=True), ep.counts_stats, token=token)
    me = ep.rank
    start = sum(send_splits[:me])
    end = start + send_splits[me]
    send_order = torch.cat([order[:start], order[end:], order[start:end]]) if ep.size > 1 else order
    inverse = torch.empty_like(send_order).scatter_(0, send_order, torch.arange(send_order.numel(), device=order.device))
    remote_send = [0 if j == me else n for j, n in enumerate(send_splits)]
    local_offs = torch.cumsum(counts.view(ep.size, per)[me], 0)  # what this rank sends itself
    plan = DispatchPlan(
        order, send_splits, counts, send_order, int(order.numel()) - send_splits[me], remote_send, local_offs, inverse,
        me, per, pending, counts if pending is None else None,
    )
    if pending is None:  # nothing travels: the receiving side now (the memory model counts its tensors)
        plan._receive()
    return plan


def with_weights(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``rows[n, H]`` with each row's router weight ``weights[n]`` as column H: what a dispatch sends."""
    if weights.dtype != rows.dtype:  # a cast would change the weights' values
        raise ValueError(f"router weights in {weights.dtype} cannot travel beside rows in {rows.dtype}: the router must return the rows' dtype")
    return torch.cat([rows, weights.unsqueeze(1)], 1)


def split_weights(received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dispatch's received ``[m, H + 1]`` as (rows ``[m, H]``, weights ``[m]``), each contiguous
    (the grouped matmul's layout; a row meets the same kernel as before the merge). One split, so
    the backward joins the two gradients by one concatenation, with no sum."""
    rows, weights = torch.split(received, [received.shape[1] - 1, 1], dim=1)
    # Always copies: the caller frees ``received`` next, and ``contiguous()`` would return a view
    # of it where the slice already counts as contiguous (one row, or the weights of one row).
    return rows.clone(memory_format=torch.contiguous_format), weights.reshape(-1).clone(memory_format=torch.contiguous_format)

