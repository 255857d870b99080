"""Optimizer states in host memory (``train.optimizer_offload: swap``).

:class:`HostStates` moves, for the buckets of a :class:`~.sharded.ShardedAdamW` that hold
``train.optimizer_offload_fraction`` of its state (whole buckets in the order the step updates
them, the fewest that reach the share), the master weights and both moments into host buffers
(page-locked where the device is not the host: :meth:`~portapipe.backends.base.Backend.host_buffer`).
The step brings them back through two device slots: while bucket i updates in one slot, bucket
i+1's states travel to the other on the backend's copy stream; once bucket i is updated its states
travel back to their host buffers on the same stream, ahead of the next bucket's trip into that
slot. The device holds at most two buckets of them at a time, and the update itself is the one
without offload, on the same values: bit for bit the same weights and moments.

Everything that reads the states between steps (a checkpoint, the host EMA, an EPLB migration)
reads the host buffers: :meth:`HostStates.swapping` waits for the last copy back before it ends.
The same path runs on every backend; on the CPU (``capabilities.host_copies: sync``) the "device"
slots and the host buffers are separate host tensors and the copies run in order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

#: what a bucket's state holds, in the order the trips copy them
KINDS = ("master", "exp_avg", "exp_avg_sq")


def _size(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _state_bytes(st: Any) -> int:
    """The bytes of one bucket's state that the trips move (its kinds together)."""
    return sum(_size(getattr(st, kind, None)) for kind in KINDS)


def _offsets(st: Any) -> tuple[dict[str, int], int]:
    """Where each kind of a bucket's state sits in a device slot (16-byte aligned), and the bytes it takes."""
    at, where = 0, {}
    for kind in KINDS:
        t = getattr(st, kind, None)
        if t is not None:
            at = math.ceil(at / 16) * 16
            where[kind] = at
            at += _size(t)
    return where, at


def chosen(sizes: list[int], fraction: float) -> list[bool]:
    """Which buckets (their state bytes ``sizes``, in step order) go to the host: the fewest from
    the first whose bytes reach ``fraction`` of all (every bucket at 1)."""
    total, want, got = sum(sizes), fraction * sum(sizes), 0
    out = []
    for n in sizes:
        out.append(total > 0 and got < want - 1e-9 * total)
        got += n if out[-1] else 0
    return out


class HostStates:
    """The host half of ``optimizer``'s states (a :class:`~.sharded.ShardedAdamW`), ``fraction`` of
    them; :meth:`swapping` runs a step's trips."""

    def __init__(self, optimizer: Any, fraction: float, backend: Any) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"train.optimizer_offload_fraction: {fraction} is not in (0, 1]")
        self.optimizer, self.backend, self.fraction = optimizer, backend, fraction
        self.device = optimizer.grads.device
        states = optimizer.states
        self.offloaded = chosen([_state_bytes(st) for st in states], fraction)
        for st, away in zip(states, self.offloaded):
            if away:
                for kind in self.kinds(st):
                    setattr(st, kind, self._to_host(getattr(st, kind)))
        #: bytes of one slot: the largest offloaded bucket's states, each kind at its own offset
        self.slot_bytes = max((_offsets(st)[1] for st, a in zip(states, self.offloaded) if a), default=0)

    @staticmethod
    def kinds(st: Any) -> list[str]:
        """The tensors of one bucket's state that are the optimizer's own (the master weights only when kept apart)."""
        return [k for k in KINDS if getattr(st, k, None) is not None]

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = self.backend.host_buffer(t.numel(), t.dtype, t.device)
        host.copy_(t)
        return host

    # ------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def swapping(self) -> Iterator[_Trips]:
        """One optimizer step's trips (:class:`_Trips`); at its end the states are all back in
        their host buffers and the host may read them."""
        trips = _Trips(self)
        try:
            yield trips
        finally:
            trips.close()

    # ---------------------------------------------------------------- figures
    @property
    def share(self) -> float:
        """The share of the state's bytes on the host (the fraction asked for, rounded to whole buckets)."""
        sizes = [_state_bytes(st) for st in self.optimizer.states]
        return sum(n for n, a in zip(sizes, self.offloaded) if a) / max(sum(sizes), 1)


class _Trips:
    """One step's copies: :meth:`bring` bucket i to a device slot (starting the next offloaded
    bucket's trip into the other), :meth:`send_back` once it is updated."""

    def __init__(self, host: HostStates) -> None:
        self.host, self.backend = host, host.backend
        self.order = [i for i, a in enumerate(host.offloaded) if a]
        self.slots = [torch.empty(host.slot_bytes, dtype=torch.uint8, device=host.device) for _ in range(min(2, len(self.order)))]
        self.arrived: dict[int, tuple[SimpleNamespace, Any]] = {}  # bucket -> (its slot views, the event of its arrival)
        self.last: Any = None  # the event of the last copy back
        self._next = 0  # the place in ``order`` of the next bucket to send for
        self._start()

    def _views(self, i: int, slot: torch.Tensor) -> SimpleNamespace:
        st = self.host.optimizer.states[i]
        where, _ = _offsets(st)
        views = {kind: None for kind in KINDS}
        for kind, at in where.items():
            t = getattr(st, kind)
            views[kind] = slot[at : at + _size(t)].view(t.dtype)
        return SimpleNamespace(**views)

    def _start(self) -> None:
        """Send for the next offloaded bucket, into the slot its place in the order gives it."""
        if self._next >= len(self.order):
            return
        i = self.order[self._next]
        held = self._views(i, self.slots[self._next % 2])
        st = self.host.optimizer.states[i]
        done = None
        for kind in self.host.kinds(st):
            done = self.backend.copy_async(getattr(held, kind), getattr(st, kind))
        self.arrived[i] = (held, done)
        self._next += 1

    def bring(self, i: int) -> SimpleNamespace:
        """Bucket i's states on the device (its slot's views, the kinds the state has; ``master``
        None where the parameters are the master weights), once arrived; the next bucket's trip starts."""
        if i not in self.arrived:
            raise RuntimeError(f"bucket {i} is not offloaded, or was brought out of the step's order")
        held, done = self.arrived.pop(i)
        self._start()  # while bucket i updates
        self.backend.wait_copy(done)
        return held

    def send_back(self, i: int, held: SimpleNamespace) -> None:
        """Bucket i's updated states back to their host buffers (after the update issued so far)."""
        st = self.host.optimizer.states[i]
        for kind in self.host.kinds(st):
            self.last = self.backend.copy_async(getattr(st, kind), getattr(held, kind))

    def close(self) -> None:
        """Wait for the last copy back: the host buffers hold the step's states."""
        if self.last is not None:
            self.last.synchronize()
        self.slots.clear()
