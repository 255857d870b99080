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

A :class:`Wire` changes how rows travel without changing what the stages compute with: each
direction may send an encoding of its rows (FP8 rows with their scales, :mod:`portapipe.fp8.dispatch`)
and decode what arrives; a forward whose rows travel encoded gives autograd a stand-in of the
rows' shape and dtype (:func:`standin`) through which their gradient comes back.

Each asynchronous exchange's total time (issue to completion, taken from the work's future)
and the time the caller spent blocked in ``wait`` are added to a :class:`A2AStats`. Taking the
completion time costs something on every exchange (a callback on the communication thread,
which must take the interpreter lock while the rank computes), so it is taken only while the
stats are ``timed``; untimed, only the blocked time is added, and the total is not known.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..backends.base import Backend
from . import spans


@dataclass
class A2AStats:
    """All-to-all time of one step: total (issue -> done) and the part spent blocked waiting.

    ``timed`` False: exchanges issued meanwhile add only their blocked time (``wait_s``) and
    ``count``; their completion is not taken, so ``total_s`` and ``hidden_frac`` say nothing.
    ``sent_bytes``: what this rank sent to the others (an FP8 dispatch's encoded rows as they travel).
    """

    total_s: float = 0.0
    wait_s: float = 0.0
    count: int = 0
    timed: bool = True
    sent_bytes: int = 0

    def reset(self) -> None:
        self.total_s = self.wait_s = 0.0
        self.count = self.sent_bytes = 0

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


class Wire(Protocol):
    """How an exchange's rows travel when not as they are. ``forward`` / ``backward``: whether
    that direction's rows are encoded; ``encode`` / ``decode`` the forward's (``decode`` gets the
    stand-in that autograd routes the rows' gradient through, :func:`standin`, and returns what
    the receiver computes with), ``encode_grad`` / ``decode_grad`` the backward's (a gradient
    decoded back to a tensor of ``like``'s dtype and the received rows' count)."""

    forward: bool
    backward: bool

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, received: torch.Tensor, standin: torch.Tensor) -> Any: ...

    def encode_grad(self, g: torch.Tensor) -> torch.Tensor: ...

    def decode_grad(self, received: torch.Tensor, like: torch.Tensor) -> torch.Tensor: ...


def standin(rows: int, like: torch.Tensor) -> torch.Tensor:
    """``rows`` rows shaped and typed like ``like``'s that hold no data (a zero broadcast): what
    autograd sees of rows that travelled encoded, and routes their gradient through."""
    return like.new_zeros(()).expand(rows, *like.shape[1:])


#: what an exchange is, for a recorded step: what its caller calls it and the model layer
#: (``("dispatch", 5)``; the recorder adds the micro-batch of the program that issued it)
Label = tuple[str, "int | None"]


class Pending:
    """An exchange in flight; ``wait()`` returns the received rows (timing the block), or with
    ``decode``, ``decode(rows)`` (made once). ``token``: its span on a recorded step
    (:func:`.spans.begin`), None otherwise."""

    def __init__(self, output: torch.Tensor, work: Any, stats: A2AStats | None, decode: Callable[[torch.Tensor], Any] | None = None,
                 token: Any = None) -> None:
        self.output = output
        self._token = token
        self._decode = decode
        self._decoded: Any = None
        self._work = work
        self._stats = stats
        self._issued = time.perf_counter()
        self._done_at: list[float] = []
        self._waited = work is None
        self._timed = stats is not None and stats.timed
        watched = work is not None and self._timed and hasattr(work, "get_future")
        if watched:
            # Completion time from the communication thread: the true length of the exchange,
            # whether or not anybody was waiting for it.
            work.get_future().add_done_callback(lambda _f: self._done_at.append(time.perf_counter()))
        if token is not None:  # a recorded step: the same completion time, where the clock is the host's
            spans.issued(token, work, self._done_at if watched else None)

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

    def wait(self) -> Any:
        if self._decode is not None:
            if self._decoded is None:
                self._decoded = self._decode(self._rows())
            return self._decoded
        return self._rows()

    def _rows(self) -> torch.Tensor:
        if not self._waited:
            t0 = time.perf_counter()
            with spans.waiting(self._token):
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


def exchange(
    group: ExchangeGroup,
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    async_op: bool = True,
    stats: A2AStats | None = None,
    decode: Callable[[torch.Tensor], Any] | None = None,
    label: Label | None = None,
) -> Pending:
    """Send ``in_splits[j]`` rows of ``x`` to rank j of ``group``; receive ``out_splits[j]`` rows from each
    (``wait()`` gives ``decode(rows)`` with ``decode``).

    An asynchronous exchange's time goes to ``stats`` (default: the group's); on a recorded step
    it is a span of the exchanges' track named by ``label``.
    """
    x = x.detach().contiguous()
    out = x.new_empty((int(sum(out_splits)),) + tuple(x.shape[1:]))
    if group.size == 1:
        out.copy_(x)
        return Pending(out, None, None, decode)
    rows = int(sum(in_splits)) - int(in_splits[group.rank])  # this rank's own rows never leave it
    sent = rows * (x[:1].numel() * x.element_size())
    (group.stats if stats is None else stats).sent_bytes += sent
    token = None
    if async_op and spans.RECORDER.get() is not None:  # a recorded step: its issue is now
        token = spans.begin(spans.EXCHANGES, label or ("exchange", None), {"bytes": sent, "rows_from": list(out_splits), "rows_to": list(in_splits)})
    work = group.backend.expert_all_to_all(out, x, list(out_splits), list(in_splits), group=group.group, async_op=async_op)
    if not async_op:
        return Pending(out, None, None, decode)
    return Pending(out, work, group.stats if stats is None else stats, decode, token)


def issue(
    group: ExchangeGroup, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], stats: A2AStats | None = None,
    decode: Callable[[torch.Tensor], Any] | None = None, label: Label | None = None,
) -> Pending:
    """Start an asynchronous :func:`exchange` on the communication stream (after the compute
    stream's work so far, so it sends what was computed)."""
    backend = group.backend
    if not backend.capabilities.streams:  # declared no-op streams: nothing to order
        return exchange(group, x, out_splits, in_splits, async_op=True, stats=stats, decode=decode, label=label)
    comm = group.comm_stream()
    comm.wait_stream(backend.compute_stream())
    with backend.stream(comm):
        return exchange(group, x, out_splits, in_splits, async_op=True, stats=stats, decode=decode, label=label)


def encoded(group: ExchangeGroup, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], wire: Wire | None,
            stats: A2AStats | None = None, label: Label | None = None) -> tuple[Pending, torch.Tensor | None]:
    """:func:`issue` of ``x``'s forward rows through ``wire`` (None, or a wire that leaves the
    forward as it is: plain). Returns the exchange and, when the rows travel encoded, the stand-in
    that autograd routes their gradient through (what ``wait()``'s decoded rows hold)."""
    if wire is None or not wire.forward:
        return issue(group, x, out_splits, in_splits, stats, label=label), None
    rows = standin(int(sum(out_splits)), x)
    return issue(group, wire.encode(x.detach()), out_splits, in_splits, stats, lambda got: wire.decode(got, rows), label), rows


def encoded_grad(group: ExchangeGroup, g: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], wire: Wire | None,
                 like: torch.Tensor, label: Label | None = None) -> Pending:
    """:func:`issue` of a backward's gradient ``g`` through ``wire``; ``wait()`` gives a tensor of
    ``like``'s dtype (the rows the forward sent) either way."""
    if wire is None or not wire.backward:
        return issue(group, g, out_splits, in_splits, label=label)
    return issue(group, wire.encode_grad(g.detach()), out_splits, in_splits, decode=lambda got: wire.decode_grad(got, like), label=label)


class AllToAll(torch.autograd.Function):
    """Blocking, differentiable exchange: the backward sends gradients back along the same rows.

    With a ``wire`` the rows (and the gradients) travel as it encodes them; the forward then
    returns (the stand-in autograd routes the gradient through, what the receiver computes with)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ExchangeGroup, out_splits: list[int], in_splits: list[int], wire: Wire | None = None) -> Any:
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.wire, ctx.like = group, out_splits, in_splits, wire, x.detach()
        if wire is None or not wire.forward:
            return exchange(group, x, out_splits, in_splits, async_op=False).wait()
        rows = standin(int(sum(out_splits)), x)
        return rows, exchange(group, wire.encode(x.detach()), out_splits, in_splits, async_op=False, decode=lambda got: wire.decode(got, rows)).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        wire = ctx.wire
        if wire is None or not wire.backward:
            back = exchange(ctx.group, grad, ctx.in_splits, ctx.out_splits, async_op=False).wait()
        else:
            back = exchange(ctx.group, wire.encode_grad(grad), ctx.in_splits, ctx.out_splits, async_op=False,
                            decode=lambda got: wire.decode_grad(got, ctx.like)).wait()
        return back, None, None, None, None
