"""The all-to-all exchange a stage yields at: issue now, wait later, time both.

A stage that moves rows between ranks inside its forward (an MoE layer's dispatch and combine)
does it through an :class:`ExchangeGroup`: the ranks taking part, the backend that carries the
rows, and the :class:`A2AStats` the executor reports. Three ways to run an exchange share
:func:`exchange`:

- :func:`issue` (what :meth:`~portapipe.scheduling.overlap.Tape.all_to_all` uses): start it on
  the backend's communication stream and return a :class:`Pending`, so the caller can compute
  something else while the rows are in flight (the F&B overlap does this, part by part);
- ``exchange(..., async_op=False)``: a blocking exchange;
- :class:`AllToAll`: an autograd function (forward and backward each one blocking exchange,
  the backward with the splits swapped) for code that runs one plain autograd graph.

Each asynchronous exchange's total time (issue to completion, taken from the work's future)
and the time the caller spent blocked in ``wait`` are added to a :class:`A2AStats`. Taking the
completion time costs something on every exchange (a callback on the communication thread,
which must take the interpreter lock while the rank computes), so it is taken only while the
stats are ``timed``; untimed, only the blocked time is added, and the total is not known.
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
    """All-to-all time of one step: total (issue -> done) and the part spent blocked waiting.

    ``timed`` False: exchanges issued meanwhile add only their blocked time (``wait_s``) and
    ``count``; their completion is not taken, so ``total_s`` and ``hidden_frac`` say nothing.
    """

    total_s: float = 0.0
    wait_s: float = 0.0
    count: int = 0
    timed: bool = True

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
class ExchangeGroup:
    """The ranks an exchange runs over: this rank's place among them and the transport."""

    backend: Backend
    size: int = 1
    rank: int = 0
    group: Any = None
    stats: A2AStats = field(default_factory=A2AStats)
    _comm_stream: Any = field(default=None, init=False, repr=False, compare=False)

    def comm_stream(self) -> Any:
        """The backend's communication stream for this group (made once)."""
        if self._comm_stream is None:
            self._comm_stream = self.backend.comm_stream()
        return self._comm_stream


class Pending:
    """An exchange in flight; ``wait()`` returns the received rows (timing the block)."""

    def __init__(self, output: torch.Tensor, work: Any, stats: A2AStats | None) -> None:
        self.output = output
        self._work = work
        self._stats = stats
        self._issued = time.perf_counter()
        self._done_at: list[float] = []
        self._waited = work is None
        self._timed = stats is not None and stats.timed
        if work is not None and self._timed and hasattr(work, "get_future"):
            # Completion time from the communication thread: the true length of the exchange,
            # whether or not anybody was waiting for it.
            work.get_future().add_done_callback(lambda _f: self._done_at.append(time.perf_counter()))

    @property
    def in_flight(self) -> bool:
        return not self._waited

    @property
    def arrived(self) -> bool:
        """Whether the rows are here, so that :meth:`wait` would not block."""
        if self._waited or self._done_at:
            return True
        completed = getattr(self._work, "is_completed", None)  # a backend's work may not tell
        return bool(completed()) if completed is not None else False

    def wait(self) -> torch.Tensor:
        if not self._waited:
            t0 = time.perf_counter()
            self._work.wait()
            t1 = time.perf_counter()
            self._waited = True
            if self._stats is not None:
                self._stats.wait_s += t1 - t0
                self._stats.count += 1
                if self._timed:
                    done = min(self._done_at[0], t1) if self._done_at else t1
                    self._stats.total_s += max(done - self._issued, t1 - t0)
        return self.output


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory now, keeping the tensor object (shape and autograd links stay):
    an exchange buffer nothing reads again, still named by whoever recorded the exchange."""
    storage = t.untyped_storage()
    if storage.nbytes() > 0:
        storage.resize_(0)


def exchange(
    group: ExchangeGroup,
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    async_op: bool = True,
    stats: A2AStats | None = None,
) -> Pending:
    """Send ``in_splits[j]`` rows of ``x`` to rank j of ``group``; receive ``out_splits[j]`` rows from each.

    An asynchronous exchange's time goes to ``stats`` (default: the group's).
    """
    x = x.detach().contiguous()
    out = x.new_empty((int(sum(out_splits)),) + tuple(x.shape[1:]))
    if group.size == 1:
        out.copy_(x)
        return Pending(out, None, None)
    work = group.backend.expert_all_to_all(out, x, list(out_splits), list(in_splits), group=group.group, async_op=async_op)
    if not async_op:
        return Pending(out, None, None)
    return Pending(out, work, group.stats if stats is None else stats)


def issue(
    group: ExchangeGroup, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], stats: A2AStats | None = None
) -> Pending:
    """Start an asynchronous :func:`exchange` on the communication stream (after the compute
    stream's work so far, so it sends what was computed)."""
    backend = group.backend
    if not backend.capabilities.streams:  # declared no-op streams: nothing to order
        return exchange(group, x, out_splits, in_splits, async_op=True, stats=stats)
    comm = group.comm_stream()
    comm.wait_stream(backend.compute_stream())
    with backend.stream(comm):
        return exchange(group, x, out_splits, in_splits, async_op=True, stats=stats)


class AllToAll(torch.autograd.Function):
    """Blocking, differentiable exchange: the backward sends gradients back along the same rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ExchangeGroup, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return exchange(group, x, out_splits, in_splits, async_op=False).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return exchange(ctx.group, grad, ctx.in_splits, ctx.out_splits, async_op=False).wait(), None, None, None
