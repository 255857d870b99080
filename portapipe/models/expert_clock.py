"""How long one MoE layer's routed experts computed on this rank in a step, and on how many rows.

Every EP rank of a layer waits at the combine (and, in backward, at the gradient's dispatch)
for the slowest rank of the group, so the spread of these times over the group is the time an
imbalanced router costs: :func:`portapipe.metrics.step.ep_step_figures` gathers them once per step.

:meth:`ExpertClock.run` times the experts' forward, and marks the part's output and input so
that autograd stamps the start and the end of its backward (the tape runs each part's backward
as one autograd call, so nothing else runs between the stamps). Weight gradients deferred to a
W action (a W split) are not counted.

Time is the calling thread's processor time (:data:`now`): on a host shared by several ranks
(or jobs) the wall clock would also count the time a rank sat descheduled, which says nothing
about its experts' load. Work queued on a device would need the device's events instead; the
figures are then only the launch time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


#: the clock expert compute is measured with (see the module doc)
now = time.thread_time


class _Stamp(torch.autograd.Function):
    """Identity whose backward tells the clock that the experts' backward starts (``end`` False:
    on the output) or ends (``end`` True: on the input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: ExpertClock, end: bool) -> torch.Tensor:
        ctx.clock, ctx.end = clock, end
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock._stamp(ctx.end)
        return grad, None, None


class ExpertClock:
    """Seconds of expert compute (forward and backward) and rows computed, since :meth:`take`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self.last: tuple[float, int] = (0.0, 0)  #: what the last take returned (a balancer reads it)
        self._backward_from: float | None = None

    def run(self, fn: Callable[..., torch.Tensor], rows: torch.Tensor, *args: Any) -> torch.Tensor:
        """``fn(rows, *args)``, timed; its backward is timed too when ``rows`` carries a gradient."""
        marked = rows.requires_grad and torch.is_grad_enabled()
        if marked:
            rows = _Stamp.apply(rows, self, True)
        t0 = now()
        out = fn(rows, *args)
        self.seconds += now() - t0
        self.rows += int(rows.shape[0])
        return _Stamp.apply(out, self, False) if marked else out

    def _stamp(self, end: bool) -> None:
        t = now()
        if not end:
            self._backward_from = t
        elif self._backward_from is not None:
            self.seconds += t - self._backward_from
            self._backward_from = None

    def take(self) -> tuple[float, int]:
        """(seconds, rows) since the last take; starts counting afresh."""
        self.last = (self.seconds, self.rows)
        self.seconds, self.rows = 0.0, 0
        return self.last
