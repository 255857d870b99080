"""Activation offload (``memory.offload``): chosen parts' saved tensors wait for their backward in
host memory.

A layer's parts named by ``memory.offload`` (``attention``, ``dense``, ``shared``, ``experts``; in
the first ``memory.offload_layers`` layers of each stage) run inside :meth:`ActivationOffload.part`:
each tensor autograd saves there (through every other hook owner's chain: zero-memory's and the
norms' recipes, FP8-cached activations) is kept by its storage. When the part returns, each such
storage that nothing but autograd's saved tensors holds any more (not the part's inputs or
outputs, which the tape keeps, nor a parameter or buffer) is copied to a host buffer on the
backend's copy stream (:meth:`~portapipe.backends.base.Backend.copy_async`), whole and byte for
byte, and the device copy is let go: the forward goes on while it travels. What stays is filed
under the tape of the micro-batch whose forward saved it.

The executor calls :meth:`ActivationOffload.prefetch` at the start of each compute action with
the tapes of that action's backwards and of the rank's next compute action's: their storages
travel back on the copy stream while the action runs, so a backward finds them on the device, one
action ahead in every schedule's own order (an F&B pair's and a lone action's alike). A backward
that reads one first waits for its copy (the compute stream, not the host); the host buffer is
let go then. The bytes come back as they left: the backward computes on the same values, and the
gradients are those without offload, bit for bit.

An active :class:`~.accounting.SavedActivations` counts these storages on the device while they
are there and in host memory while they are there (``host_live_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..scheduling.observe import PART_TAPE
from . import accounting


def _use_count(t: torch.Tensor) -> int:
    """How many holders the storage behind ``t`` has (tensors and storage objects)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _alone() -> int:
    """The use count of a storage that one tensor alone holds, as :func:`_use_count` reads it."""
    probe = torch.empty(0, dtype=torch.uint8).set_(torch.zeros(4).untyped_storage(), 0, (16,), (1,))
    return _use_count(probe)


ALONE = _alone()


def tensors_in(x: Any, depth: int = 3) -> Iterable[torch.Tensor]:
    """The tensors in a part's arguments or outputs: tuples, lists, dicts and dataclasses (FP8
    rows, dispatch plans) opened ``depth`` levels deep."""
    if isinstance(x, torch.Tensor):
        yield x
    elif depth and isinstance(x, (tuple, list)):
        for v in x:
            yield from tensors_in(v, depth - 1)
    elif depth and isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v, depth - 1)
    elif depth and dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from tensors_in(getattr(x, f.name), depth - 1)


class _Stored:
    """One storage a part saved: its bytes on the device (``device``, a uint8 view of the whole
    storage) and / or in a host buffer (``host``), and the copies between them. Until it is sent,
    the tracker counts it as any saved storage (``kept``: what it packed)."""

    __slots__ = ("offload", "device", "host", "nbytes", "where", "arriving", "kept", "token", "__weakref__")

    def __init__(self, offload: ActivationOffload, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.offload, self.nbytes, self.where = offload, storage.nbytes(), t.device
        self.device: torch.Tensor | None = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (self.nbytes,), (1,))
        self.host: torch.Tensor | None = None
        self.arriving: Any = None  # the event of a copy back still on its way
        # the tracker counts the storage by this view of it (no view base to hold it a second time)
        self.kept: Any = accounting.track_saved(self.device)
        self.token: Any = None

    def away(self) -> bool:
        """Whether nothing but this view holds the storage: sending it frees its memory."""
        return _use_count(self.device) <= ALONE

    def send(self) -> None:
        off = self.offload
        tracker = getattr(self.kept, "tracker", None)
        self.kept = None  # the tracker's count of it as a saved storage goes, a count of its moves replaces it
        self.token = tracker.moving(self.nbytes) if tracker is not None else None
        self.host = off.backend.host_buffer(self.nbytes, torch.uint8, self.where)
        off.backend.copy_async(self.host, self.device)
        self.device = None
        off.sent(self.nbytes)
        self._place()

    def fetch(self) -> None:
        """Start the copy back (once)."""
        if self.device is None:
            self.device = torch.empty(self.nbytes, dtype=torch.uint8, device=self.where)
            self.arriving = self.offload.backend.copy_async(self.device, self.host)
            self._place()

    def bytes_on_device(self) -> torch.Tensor:
        """The storage's bytes on the device, for the compute stream's next work (waited for here)."""
        self.fetch()
        if self.arriving is not None:
            self.offload.backend.wait_copy(self.arriving)
            self.arriving, self.host = None, None  # the compute stream reads the device copy from here on
            self.offload.dropped(self.nbytes)
            self._place()
        assert self.device is not None
        return self.device

    def _place(self) -> None:
        if self.token is not None:
            self.token.tracker.place(self.token, self.device is not None, self.host is not None)

    def __del__(self) -> None:  # the last saved tensor of it released: its host bytes go too
        if getattr(self, "host", None) is not None:
            self.offload.dropped(self.nbytes)


class _Saved:
    """What autograd keeps of one saved tensor of an offloaded part: its storage and its view."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset")

    def __init__(self, stored: _Stored, t: torch.Tensor) -> None:
        self.stored, self.dtype, self.size, self.stride, self.offset = stored, t.dtype, t.size(), t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        storage = self.stored.bytes_on_device().untyped_storage()
        return torch.empty(0, dtype=self.dtype, device=self.stored.where).set_(storage, self.offset, self.size, self.stride)


class ActivationOffload:
    """One rank's activation offload: wraps the parts :func:`~.policy.configure` names, keeps what
    they sent by tape, and fetches it back for the executor (:meth:`prefetch`).

    Figures of the step (:meth:`take`): bytes sent, and the most held in host memory at once."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._by_tape: weakref.WeakKeyDictionary[Any, list[_Stored]] = weakref.WeakKeyDictionary()
        self.sent_bytes = 0
        self.host_bytes = 0
        self.host_peak_bytes = 0
        #: bytes sent by the label of the part that saved them (:func:`~.accounting.region`; layers or parts)
        self.by_region: dict[Any, int] = {}

    # ------------------------------------------------------------------ forward
    def part(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a layer's part) whose saved tensors go to the host when it returns."""

        @functools.wraps(fn)
        def offloaded(*args: Any) -> Any:
            tape = PART_TAPE.get()
            if tape is None or not torch.is_grad_enabled() or getattr(tape, "replay", False):
                return fn(*args)  # a plain call (evaluation, the reference) or a recompute's replay: nothing waits
            stored: dict[Any, _Stored] = {}

            def pack(t: torch.Tensor) -> Any:
                found = accounting.storage_key(t)
                if found is None or isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):  # weights stay
                    return accounting.track_saved(t)
                if found[0] not in stored:
                    stored[found[0]] = _Stored(self, t)
                return _Saved(stored[found[0]], t)

            with accounting.packing(pack):
                out = fn(*args)
            kept = {found[0] for t in (*tensors_in(args), *tensors_in(out)) if (found := accounting.storage_key(t)) is not None}
            sent = [s for key, s in stored.items() if key not in kept and s.away()]
            for s in sent:
                s.send()
            if sent:
                self._by_tape.setdefault(tape, []).extend(sent)
            return out

        return offloaded

    # ----------------------------------------------------------------- backward
    def prefetch(self, tapes: list[Any]) -> None:
        """Start bringing back what the forwards of ``tapes`` sent (the executor's hook)."""
        for tape in tapes:
            for s in self._by_tape.pop(tape, ()):
                s.fetch()

    # ------------------------------------------------------------------ figures
    def sent(self, nbytes: int) -> None:
        label = accounting.current_label()
        self.by_region[label] = self.by_region.get(label, 0) + nbytes
        self.sent_bytes += nbytes
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def dropped(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def take(self) -> dict[str, int]:
        """The step's figures (bytes sent to the host, the most held there at once), restarted."""
        out = {"offload_sent_bytes": self.sent_bytes, "offload_host_peak_bytes": self.host_peak_bytes}
        self.sent_bytes, self.host_peak_bytes = 0, self.host_bytes
        return out
