"""Bytes of activations saved for backward, measured where autograd saves them.

Allocator figures differ between devices (caching allocators, CPU resident set size) and mix
activations with parameters, gradients and workspace. What a memory option changes is which
tensors autograd keeps between a forward and its backward, and that is the same on every
backend: :class:`SavedActivations` sees each tensor as it is saved
(``torch.autograd.graph.saved_tensors_hooks``) and counts the bytes of its *storage*, once per
storage however many views of it are saved, until the graph that saved it is released.
Parameters are not activations and are never counted.

Figures kept:

- ``live_bytes`` / ``peak_bytes``: storage bytes held for backward now / at most (this process);
- ``by_region``: bytes first saved under each (layer, micro-batch) label, set with
  :func:`region` by whoever runs the forward (the model labels layers, the runtime micro-batches);
- ``allocator_peak_bytes`` (in :meth:`SavedActivations.summary`): the backend's own peak
  (``Backend.max_memory_allocated``) where the device has one.

Use: ``tracker = SavedActivations(ignore=runtime.parameters())``, then per training step
``with tracker.step(): runtime.step(batches)`` and read ``tracker.peak_bytes`` (this rank) or
:func:`peak_per_rank` (all ranks); ``tracker.summary(backend)`` gives the JSON-ready figures.
:func:`label_layers` attributes the bytes to layers.

Other code that installs its own saved-tensor hooks (zero-memory) must chain to the tracker
with :func:`pack_saved` / :func:`unpack_saved`: autograd uses only the innermost hooks. Activation
offload (:mod:`.offload`) installs itself in that chain with :func:`packing`, and tells the tracker
where the bytes it moves are (:meth:`SavedActivations.place`): ``live_bytes`` / ``peak_bytes`` count
what is held on the device, ``host_live_bytes`` / ``host_peak_bytes`` what is held in host memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

Label = tuple[Any, int | None]  # (layer index or "<index>.<part>", micro-batch)

_LABEL: contextvars.ContextVar[Label] = contextvars.ContextVar("portapipe_saved_label", default=(None, None))
_ACTIVE: contextvars.ContextVar[SavedActivations | None] = contextvars.ContextVar("portapipe_saved_tracker", default=None)

_PACKER: contextvars.ContextVar[Any] = contextvars.ContextVar("portapipe_saved_packer", default=None)
_MOVED = itertools.count()  # keys of storages whose bytes move between device and host

_UNSET = object()


@contextlib.contextmanager
def region(layer: int | None | object = _UNSET, microbatch: int | None | object = _UNSET) -> Iterator[Label]:
    """Attribute tensors saved inside this block to ``(layer, microbatch)``.

    A field left out keeps the enclosing block's value, so the runtime can label the
    micro-batch and the model the layer independently.
    """
    old_layer, old_mb = _LABEL.get()
    label = (old_layer if layer is _UNSET else layer, old_mb if microbatch is _UNSET else microbatch)
    token = _LABEL.set(label)  # type: ignore[arg-type]
    try:
        yield label  # type: ignore[misc]
    finally:
        _LABEL.reset(token)


def current_label() -> Label:
    return _LABEL.get()


def active() -> SavedActivations | None:
    """The tracker whose hooks are installed in this context, if any."""
    return _ACTIVE.get()


def storage_key(t: torch.Tensor) -> tuple[Any, int] | None:
    """(device, address) of the storage behind ``t`` and its size; None for tensors with none."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
        return None
    ptr = storage.data_ptr()
    if ptr == 0:
        return None
    return (str(t.device), ptr), storage.nbytes()


class _Held:
    """What autograd keeps for one saved tensor while a tracker counts it.

    Released when autograd drops its graph (after the backward, or when the graph is freed),
    which is when the storage stops being held for backward.
    """

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor | None, key: Any, tracker: SavedActivations) -> None:
        self.tensor = tensor
        self.key = key
        self.tracker = tracker

    def unpack(self) -> torch.Tensor | None:
        return self.tensor

    def __del__(self) -> None:
        tracker = getattr(self, "tracker", None)
        if tracker is not None and self.key is not None:
            tracker._release(self.key)


class SavedActivations:
    """Counts storage bytes that autograd saves for backward (storage-deduplicated)."""

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        self._lock = threading.RLock()  # re-entrant: a release may run from GC inside pack
        self._ignored: set[Any] = set()
        self._refs: dict[Any, int] = {}  # storage key -> saved tensors holding it
        self._sizes: dict[Any, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.host_live_bytes = 0  # held for backward in host memory (activation offload)
        self.host_peak_bytes = 0
        self._where: dict[Any, tuple[bool, bool]] = {}  # a moving storage's key -> (on the device, on the host)
        self.saved_count = 0
        self.by_region: dict[Label, int] = {}
        self.live_by_region: dict[Label, int] = {}
        self._labels: dict[Any, Label] = {}
        self.ignore(ignore)

    # ---------------------------------------------------------------- set-up
    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (parameters, buffers, constants)."""
        for t in tensors:
            found = storage_key(t)
            if found is not None:
                self._ignored.add(found[0])

    def _is_parameter(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)

    # ------------------------------------------------------------------ hooks
    def pack(self, t: torch.Tensor) -> Any:
        """saved_tensors_hooks pack: count ``t``'s storage and keep ``t``."""
        if self._is_parameter(t):
            return t
        found = storage_key(t)
        if found is None or found[0] in self._ignored:
            return t
        key, nbytes = found
        with self._lock:
            n = self._refs.get(key, 0)
            self._refs[key] = n + 1
            self.saved_count += 1
            if n == 0:
                self._sizes[key] = nbytes
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                label = _LABEL.get()
                self._labels[key] = label
                self.by_region[label] = self.by_region.get(label, 0) + nbytes
                self.live_by_region[label] = self.live_by_region.get(label, 0) + nbytes
        return _Held(t, key, self)

    @staticmethod
    def unpack(obj: Any) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Held) else obj

    def moving(self, nbytes: int) -> _Held:
        """Count a storage of ``nbytes`` whose bytes will move (activation offload) as saved on the
        device now, in place of the count it had as a saved storage (its ``by_region`` share stays
        as it was); the token holds no tensor, and releases the count when it is dropped."""
        key = ("moving", next(_MOVED))
        with self._lock:
            self._refs[key] = 1
            self._sizes[key] = nbytes
            self._where[key] = (True, False)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            label = self._labels[key] = _LABEL.get()  # counted in by_region when first saved, as any storage
            self.live_by_region[label] = self.live_by_region.get(label, 0) + nbytes
        return _Held(None, key, self)

    def place(self, held: _Held, device: bool, host: bool) -> None:
        """Where the bytes of a :meth:`moving` storage are held now: on the device, in host memory, or both."""
        with self._lock:
            key = held.key
            if key not in self._sizes:
                return
            n, (d, h) = self._sizes[key], self._where[key]
            self.live_bytes += n * (int(device) - int(d))
            self.host_live_bytes += n * (int(host) - int(h))
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
            self._where[key] = (device, host)

    def _release(self, key: Any) -> None:
        with self._lock:
            n = self._refs.get(key)
            if n is None:
                return
            if n > 1:
                self._refs[key] = n - 1
                return
            del self._refs[key]
            nbytes = self._sizes.pop(key)
            device, host = self._where.pop(key, (True, False))
            self.live_bytes -= nbytes * device
            self.host_live_bytes -= nbytes * host
            label = self._labels.pop(key)
            self.live_by_region[label] -= nbytes

    # -------------------------------------------------------------- contexts
    @contextlib.contextmanager
    def track(self) -> Iterator[SavedActivations]:
        """Count every tensor saved for backward inside this block (forwards run here)."""
        token = _ACTIVE.set(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def step(self) -> Iterator[SavedActivations]:
        """One training step: the peak restarts from what is live, then everything saved is tracked.

        ``with tracker.step(): runtime.step(batches)``, then read ``tracker.peak_bytes``.
        """
        self.reset_peak()
        with self.track():
            yield self

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (e.g. at the start of a step)."""
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.host_peak_bytes = self.host_live_bytes

    def reset(self) -> None:
        """Forget the per-region totals and restart the peak (live tensors stay counted)."""
        with self._lock:
            self.by_region.clear()
            self.saved_count = 0
            self.peak_bytes = self.live_bytes
            self.host_peak_bytes = self.host_live_bytes

    # ---------------------------------------------------------------- figures
    def layer_bytes(self, layer: int) -> int:
        """Bytes first saved under ``layer``, summed over micro-batches."""
        return sum(b for (lay, _mb), b in self.by_region.items() if lay == layer)

    def live_layer_bytes(self, layer: int) -> int:
        """Bytes saved under ``layer`` and still held for backward now."""
        return sum(b for (lay, _mb), b in self.live_by_region.items() if lay == layer)

    def microbatch_bytes(self, microbatch: int) -> int:
        return sum(b for (_lay, mb), b in self.by_region.items() if mb == microbatch)

    def summary(self, backend: Any = None) -> dict[str, Any]:
        """JSON-ready figures; ``backend`` adds its allocator peak where the device has one."""
        regions = [
            {"layer": lay, "microbatch": mb, "bytes": b}
            for (lay, mb), b in sorted(self.by_region.items(), key=lambda kv: (_order(kv[0][0]), _order(kv[0][1])))
        ]
        out: dict[str, Any] = {
            "peak_saved_bytes": self.peak_bytes,
            "live_saved_bytes": self.live_bytes,
            "peak_host_saved_bytes": self.host_peak_bytes,
            "live_host_saved_bytes": self.host_live_bytes,
            "saved_tensors": self.saved_count,
            "regions": regions,
        }
        if backend is not None:
            out["allocator_peak_bytes"] = backend.max_memory_allocated()
        return out


def label_layers(blocks: Iterable[Any], by_part: bool = False) -> None:
    """Attribute what each layer's parts save to that layer (``region(layer=layer.index)``).

    Wraps the layers' ``*_part`` methods, which run synchronously, so the label is right even
    when two micro-batches' programs interleave (an F&B), and in recompute replays. With
    ``by_part`` the label is ``"<index>.<part>"`` (e.g. ``"3.experts"``), for breakdowns.
    """
    for block in blocks:
        for layer in block.layers.values():
            for name in dir(type(layer)):
                if name.endswith("_part") and callable(getattr(type(layer), name)):
                    label = f"{layer.index}.{name[: -len('_part')]}" if by_part else layer.index
                    # the layer's own, as a memory option may have wrapped it (activation offload)
                    setattr(layer, name, _labelled(getattr(layer, name), label))


def _labelled(fn: Any, label: Any) -> Any:
    def part(*args: Any) -> Any:
        with region(layer=label):
            return fn(*args)

    return part


def _order(x: Any) -> tuple[int, str]:
    return (-1, "") if x is None else (0, f"{x:>12}" if isinstance(x, int) else str(x))


def peak_per_rank(backend: Any, tracker: SavedActivations, group: Any = None) -> list[int]:
    """Every rank's ``tracker.peak_bytes``, in rank order of ``group`` (collective: all ranks call it)."""
    import torch.distributed as dist

    mine = torch.tensor([tracker.peak_bytes], dtype=torch.int64)
    size = dist.get_world_size(group)
    out = [torch.zeros_like(mine) for _ in range(size)]
    backend.all_gather(out, mine, group=group)
    return [int(t) for t in out]


# ------------------------------------------------------- chaining for other hook owners
def pack_saved(t: torch.Tensor) -> Any:
    """Pack ``t`` for whoever is in the chain: the offload of the part running (:func:`packing`), else the
    active tracker (or keep it as is when neither is)."""
    packer = _PACKER.get()
    return packer(t) if packer is not None else track_saved(t)


def track_saved(t: torch.Tensor) -> Any:
    """Pack ``t`` for the active tracker alone (what an offload leaves where it is)."""
    tracker = _ACTIVE.get()
    return t if tracker is None else tracker.pack(t)


def unpack_saved(obj: Any) -> torch.Tensor:
    """What :func:`pack_saved` packed, as a tensor again."""
    return obj if isinstance(obj, torch.Tensor) else obj.unpack()


@contextlib.contextmanager
def packing(pack: Any) -> Iterator[None]:
    """Within: every tensor saved for backward goes through ``pack`` (which returns ``t`` itself, what
    :func:`track_saved` gives, or an object with ``unpack()``), the hooks inside it included."""
    token = _PACKER.set(pack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved):
            yield
    finally:
        _PACKER.reset(token)
