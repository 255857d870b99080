"""Expert parallelism: routed experts sharded over the EP group, tokens moved by all-to-all.

EP rank ``j`` of ``ep`` holds the logical experts ``[j*E/ep, (j+1)*E/ep)``. A dispatch sends
each (token, k) row to the rank holding its expert; rows arrive grouped by source rank, then
by expert (the all-to-all keeps the sender's order), and run as one grouped matmul whose groups
are (source, expert) pairs in that order. Combine is the same exchange with the splits swapped.

Two ways to run an exchange share :func:`exchange`:

- :class:`Pending` (``async_op=True``): issue now, ``wait()`` later, so the caller can compute
  something else while the rows are in flight (the F&B overlap does this, part by part);
- :class:`AllToAll`: an autograd function (forward and backward each one blocking exchange,
  the backward with the splits swapped) for code that runs one plain autograd graph.

Each exchange's total time (issue to completion, taken from the work's future) and the time
the caller spent blocked in ``wait`` are added to :class:`A2AStats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.base import Backend


@dataclass
class A2AStats:
    """All-to-all time of one step: total (issue -> done) and the part spent blocked waiting."""

    total_s: float = 0.0
    wait_s: float = 0.0
    count: int = 0

    def reset(self) -> None:
        self.total_s = self.wait_s = 0.0
        self.count = 0

    @property
    def hidden_frac(self) -> float:
        """Share of all-to-all time during which the caller computed instead of waiting."""
        if self.total_s <= 0:
            return 0.0
        return max(0.0, min(1.0, 1.0 - self.wait_s / self.total_s))


@dataclass
class ExpertParallel:
    """This rank's place in the EP group and the transport used for dispatch / combine."""

    backend: Backend
    size: int = 1
    rank: int = 0
    group: Any = None
    stats: A2AStats = field(default_factory=A2AStats)
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


class Pending:
    """An exchange in flight; ``wait()`` returns the received rows (timing the block)."""

    def __init__(self, output: torch.Tensor, work: Any, stats: A2AStats | None) -> None:
        self.output = output
        self._work = work
        self._stats = stats
        self._issued = time.perf_counter()
        self._done_at: list[float] = []
        self._waited = work is None
        if work is not None and stats is not None and hasattr(work, "get_future"):
            # Completion time from the communication thread: the true length of the exchange,
            # whether or not anybody was waiting for it.
            work.get_future().then(lambda _f: self._done_at.append(time.perf_counter()))

    @property
    def in_flight(self) -> bool:
        return not self._waited

    def wait(self) -> torch.Tensor:
        if not self._waited:
            t0 = time.perf_counter()
            self._work.wait()
            t1 = time.perf_counter()
            self._waited = True
            if self._stats is not None:
                done = min(self._done_at[0], t1) if self._done_at else t1
                self._stats.wait_s += t1 - t0
                self._stats.total_s += max(done - self._issued, t1 - t0)
                self._stats.count += 1
        return self.output


def exchange(
    ep: ExpertParallel,
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    async_op: bool = True,
) -> Pending:
    """Send ``in_splits[j]`` rows of ``x`` to EP rank j; receive ``out_splits[j]`` rows from each."""
    x = x.detach().contiguous()
    out = x.new_empty((int(sum(out_splits)),) + tuple(x.shape[1:]))
    if ep.size == 1:
        out.copy_(x)
        return Pending(out, None, None)
    work = ep.backend.expert_all_to_all(out, x, list(out_splits), list(in_splits), group=ep.group, async_op=async_op)
    pending = Pending(out, work if async_op else None, ep.stats if async_op else None)
    return pending


class AllToAll(torch.autograd.Function):
    """Blocking, differentiable exchange: the backward sends gradients back along the same rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ep: ExpertParallel, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.ep, ctx.out_splits, ctx.in_splits = ep, out_splits, in_splits
        return exchange(ep, x, out_splits, in_splits).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return exchange(ctx.ep, grad, ctx.in_splits, ctx.out_splits).wait(), None, None, None


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
