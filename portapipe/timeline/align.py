"""Ranks on one clock: each rank's offset against rank 0, from round trips over the backend.

Rank r sends its clock's time t1 to rank 0, which answers with its own t2; rank r reads t3 when
the answer is in. Over a round trip of t3 - t1 rank 0's clock read t2 somewhere inside it, so
``t2 - (t1 + t3) / 2`` is rank 0's clock minus rank r's, within half the round trip. Of a few
rounds the shortest wins (the least queueing in it): its half is the residual bound, what the
alignment cannot promise beyond. Rank 0 answers the ranks one after another; every rank takes
part (the others wait), outside any step, and all leave it together (a barrier): answered one
after another, the first rank answered would otherwise start the recorded step ahead of the
others and wait inside it for them (measured: 3-4% on the step's time, 4 ranks on 2 cores).

Times travel as two float32 numbers (whole seconds and the rest: every backend moves float32),
and a device's receive is waited for on the host (a synchronisation, here, before the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

#: round trips per rank; the shortest wins
ROUNDS = 8


@dataclass(frozen=True)
class Alignment:
    """This rank's clock against rank 0's: ``offset_s`` added to a time of this rank gives rank
    0's time, within ``bound_s``; ``samples``: the round trips (t1, t2, t3) it came from."""

    offset_s: float = 0.0
    bound_s: float = 0.0
    samples: list[tuple[float, float, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"offset_s": self.offset_s, "bound_s": self.bound_s, "samples": [list(s) for s in self.samples]}


def from_samples(samples: list[tuple[float, float, float]]) -> Alignment:
    """The offset and bound of the shortest of ``samples`` (rank 0 itself: none, offset 0)."""
    if not samples:
        return Alignment()
    t1, t2, t3 = min(samples, key=lambda s: s[2] - s[0])
    return Alignment(t2 - (t1 + t3) / 2, (t3 - t1) / 2, list(samples))


def _pack(t: float) -> list[float]:
    whole = float(int(t))
    return [whole, t - whole]


def _unpack(x: torch.Tensor) -> float:
    whole, rest = x.tolist()
    return whole + rest


def measure(backend: Any, now: Any, rounds: int = ROUNDS) -> Alignment:
    """This rank's :class:`Alignment` (collective over the default group); ``now()`` the clock
    the recorded spans are read on (a span clock's :meth:`~portapipe.backends.base.SpanClock.now`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = backend.device()
    box = torch.zeros(2, dtype=torch.float32, device=device)
    samples: list[tuple[float, float, float]] = []

    def exchange(op: Any, peer: int) -> None:
        for work in backend.batch_isend_irecv([dist.P2POp(op, box, peer)]):
            work.wait()
        backend.synchronize()  # the receive is in (a device's wait holds a stream, not the host)

    for r in range(1, world):
        for _ in range(rounds):
            if rank == 0:
                exchange(dist.irecv, r)
                box.copy_(torch.tensor(_pack(now()), dtype=torch.float32))
                exchange(dist.isend, r)
            elif rank == r:
                t1 = now()
                box.copy_(torch.tensor(_pack(t1), dtype=torch.float32))
                exchange(dist.isend, 0)
                exchange(dist.irecv, 0)
                t3 = now()
                samples.append((t1, _unpack(box.cpu()), t3))
    backend.barrier()
    return from_samples(samples)
