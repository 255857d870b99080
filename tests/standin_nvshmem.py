"""STAND-IN for torch's NVSHMEM symmetric memory and the CUDA streams around it, on CPU. Not NVSHMEM.

A strict double of ``torch.distributed._symmetric_memory`` on the NVSHMEM backend and of
``torch.ops.symm_mem.all_to_all_vdev`` as torch 2.14.1 implements them; it refuses what the
real library would refuse or get wrong, so the CPU suite fails where a GPU job would:

* **World-collective allocation.** ``empty`` is ``nvshmem_malloc`` over the whole job, and the
  first ``rendezvous`` of a buffer with a group allocates a signal pad the same way. With
  ``world_group`` (several gloo ranks) each of them is a real collective over every rank with a
  short timeout: a rank allocating while another waits elsewhere (a pipeline receive) times
  out, as the GPU job would hang. Every rank must make the same allocations in the same order.
* **The op's NVSHMEM team is world-collective too.** On a group's first call, torch
  2.14.1's ``all_to_all_vdev`` asks its ``TeamManager`` for the group's team, which splits it
  off the world team (``nvshmem_team_split_strided(NVSHMEM_TEAM_WORLD, ...)``, collective over
  every PE of the job; read from the call graph of ``libtorch_nvshmem.so``). The double makes
  that first call a collective over every rank: a first exchange in the middle of a schedule
  times out. The team manager's own checks come with it: a group of more than one rank whose
  global ranks are evenly strided.
* **set_backend** only before the first allocation.
* **Argument checks** and **no implicit rendezvous**: contiguous tensors, int64 splits,
  ``[world]`` / ``[2, world]`` shapes, equal dtypes and dim-0 strides (torch 2.14.1's 1-D op
  checks only that the tensors share a device and writes out of bounds otherwise; the double
  refuses instead), and a tensor not rendezvoused with the group before the op would be
  rendezvoused inside it, a collective allocation in the middle of the schedule.
* **Per-peer block rule** (``allToAllV``: ``block_size * blocks_per_peer == peer_size``): the
  bytes exchanged with every peer must divide evenly over the kernel's blocks per peer, which
  follow from the input buffer's byte size and the group size.
* **Buffer reuse fence.** Peers read a rank's input buffer after the op returns on that rank
  (it ends with a quiet, not a barrier), and write their splits into its ``out_splits_offsets``
  at the start of the next exchange. A peer may be one exchange behind, no more (each exchange
  starts with a team barrier). So two consecutive calls on one group may not use the same
  input or the same ``out_splits_offsets`` buffer.

Calls are bound against the declarations of torch 2.14.1 (tests/conformance, tests/declared.py).
The data really moves between ranks (gloo ``all_to_all_single``), so results can be compared.
"""

from __future__ import annotations

import datetime
import math
import types
from typing import Any

import torch
import torch.distributed as dist

from . import declared

GARBAGE = -7  # fresh symmetric memory is not zeroed


def kernel_blocks_per_peer(input_bytes: int, world: int, intra_node: bool, env_blocks: int | None = None) -> int:
    """``get_a2a_nblocks`` and ``allToAllV`` of torch 2.14.1's nvshmem_extension.cu, transcribed."""
    if env_blocks is not None and env_blocks > 0:
        num_blocks = env_blocks
    else:
        chunk_size = 16 * 512 * 8  # 16 B per thread, 512 threads, 8 loops
        num_blocks = -(-input_bytes // chunk_size)
        num_blocks = -(-num_blocks // world) * world  # at::round_up
        num_blocks = min(num_blocks, 64 if intra_node else 16)
    return max(num_blocks // world, 1)


class SymmMemDouble:
    """``torch.distributed._symmetric_memory`` (NVSHMEM backend) plus ``all_to_all_vdev``."""

    def __init__(self, world_group: Any = None, intra_node: bool = True, env_blocks: int | None = None) -> None:
        self.decl = declared.load("torch")
        self.world_group = world_group  # gloo group over every rank (short timeout); None: one process
        self.intra_node = intra_node
        self.env_blocks = env_blocks
        self.backend: str | None = None
        self.allocs: list[torch.Tensor] = []
        self.rendezvoused: set[tuple[int, str]] = set()
        self.op_calls: list[str] = []
        self.teams: set[str] = set()  # groups whose NVSHMEM team the op has made
        self.world_collectives: list[Any] = []  # every world-collective call, in order
        self._last: dict[str, tuple[int, int]] = {}  # group -> (input ptr, out_splits_offsets ptr)

    # ------------------------------------------------------------ module functions
    def module(self) -> types.SimpleNamespace:
        """What ``from torch.distributed import _symmetric_memory`` gives, for the transport."""
        return types.SimpleNamespace(
            is_nvshmem_available=self.is_nvshmem_available,
            set_backend=self.set_backend,
            get_backend=self.get_backend,
            empty=self.empty,
            rendezvous=self.rendezvous,
        )

    def is_nvshmem_available(self) -> bool:
        self.decl.bind_py("torch.distributed._symmetric_memory.is_nvshmem_available")
        return True

    def set_backend(self, name: str) -> None:
        self.decl.bind_py("torch.distributed._symmetric_memory.set_backend", name)
        if name not in ("NVSHMEM", "CUDA", "NCCL"):
            raise ValueError(f"unknown symmetric-memory backend {name!r}")
        if self.allocs:
            raise RuntimeError("symmetric memory: the backend cannot be changed once a symmetric tensor has been allocated")
        self.backend = name

    def get_backend(self, device: Any) -> str | None:
        self.decl.bind_py("torch.distributed._symmetric_memory.get_backend", device)
        return self.backend

    def _world_collective(self, what: Any) -> None:
        self.world_collectives.append(what)
        if self.world_group is None:
            return
        seen: list[Any] = [None] * dist.get_world_size(self.world_group)
        dist.all_gather_object(seen, what, group=self.world_group)  # times out if a rank is elsewhere
        if any(s != what for s in seen):
            raise RuntimeError(f"symmetric memory: world-collective calls differ between ranks: {seen}")

    def empty(self, *size: Any, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        self.decl.bind_py("torch.distributed._symmetric_memory.empty", *size, dtype=dtype, device=device)
        if self.backend != "NVSHMEM":
            raise RuntimeError("stand-in: set_backend('NVSHMEM') must come before the first symmetric allocation")
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else tuple(size)
        self._world_collective(("nvshmem_malloc", shape, str(dtype)))
        t = torch.full(shape, GARBAGE, dtype=dtype or torch.get_default_dtype())
        self.allocs.append(t)
        return t

    @staticmethod
    def _group(name: str) -> Any:
        return dist.distributed_c10d._resolve_process_group(name) if dist.is_initialized() else None

    def rendezvous(self, tensor: torch.Tensor, group: Any) -> None:
        self.decl.bind_py("torch.distributed._symmetric_memory.rendezvous", tensor, group)
        name = group if isinstance(group, str) else group.group_name
        if not any(a.data_ptr() == tensor.data_ptr() for a in self.allocs):
            raise RuntimeError("symmetric memory: rendezvous of a tensor not allocated by symm_mem.empty")
        key = (tensor.data_ptr(), name)
        if key in self.rendezvoused:
            return
        pg = self._group(name)
        if pg is not None and dist.get_world_size(pg) > 1:
            shapes: list[Any] = [None] * dist.get_world_size(pg)
            dist.all_gather_object(shapes, (tuple(tensor.shape), str(tensor.dtype)), group=pg)
            if len(set(shapes)) != 1:
                raise RuntimeError(f"symmetric memory: rendezvous of tensors that differ between ranks: {shapes}")
        self._world_collective(("signal pad", tuple(tensor.shape), str(tensor.dtype)))
        self.rendezvoused.add(key)

    # ------------------------------------------------------------------ the op
    def _make_team(self, pg: Any, name: str) -> None:
        """``TeamManager::group_to_team_pool`` at a group's first op: its checks, then a split of
        the world team, collective over every rank. Without a process group (one process) the
        double is a loopback and only the split's record is kept."""
        if pg is not None:
            ranks = dist.get_process_group_ranks(pg)
            if len(ranks) < 2:
                raise RuntimeError(f"all_to_all_vdev on group {name!r}: Expected global_ranks.size() > 1 (a one-rank group)")
            if any(b - a != ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:])):
                raise RuntimeError(f"all_to_all_vdev on group {name!r}: global ranks {ranks} are not evenly strided")
        self._world_collective(("nvshmem_team_split_strided", "NVSHMEM_TEAM_WORLD"))
        self.teams.add(name)

    def all_to_all_vdev(self, *args: Any, **kwargs: Any) -> None:
        _, a = self.decl.bind_op("symm_mem::all_to_all_vdev", *args, **kwargs)
        inp, out, in_splits, oso, name = a["input"], a["out"], a["in_splits"], a["out_splits_offsets"], a["group_name"]
        for label, t in (("input", inp), ("out", out), ("in_splits", in_splits), ("out_splits_offsets", oso)):
            if (t.data_ptr(), name) not in self.rendezvoused:
                raise RuntimeError(
                    f"all_to_all_vdev: {label} was not rendezvoused with group {name!r} before the op; the op would "
                    "do it itself, a collective allocation over the whole job in the middle of the schedule"
                )
        if not all(t.is_contiguous() for t in (inp, out, in_splits, oso)):
            raise RuntimeError("input, out, in_splits and out_splits_offsets must be contiguous")
        if inp.dim() < 1 or out.dim() < 1:
            raise RuntimeError("input and out must have at least 1 dimension")
        if inp.dtype != out.dtype or inp.stride(0) != out.stride(0):
            raise RuntimeError("input and out must have the same dtype and same stride at dim 0")
        if in_splits.dtype != torch.int64 or oso.dtype != torch.int64:
            raise RuntimeError("splits and offsets must be int64")
        pg = self._group(name)
        world = dist.get_world_size(pg) if pg is not None else 1
        if name not in self.teams:
            self._make_team(pg, name)
        if in_splits.numel() != world or tuple(oso.shape) != (2, world):
            raise RuntimeError(f"in_splits must have {world} elements and out_splits_offsets shape [2, {world}]")
        last = self._last.get(name)
        if last is not None and (inp.data_ptr() == last[0] or oso.data_ptr() == last[1]):
            which = "input" if inp.data_ptr() == last[0] else "out_splits_offsets"
            raise RuntimeError(
                f"all_to_all_vdev on group {name!r}: the {which} buffer of the previous exchange is used again at once; "
                "a slower peer may still read it (the op ends without a barrier): double-buffer or fence"
            )
        send = [int(v) for v in in_splits.tolist()]
        if min(send) < 0 or sum(send) > inp.shape[0]:
            raise RuntimeError(f"all_to_all_vdev: in_splits {send} do not fit the input's {inp.shape[0]} rows")
        recv = list(send)
        if world > 1:
            got = torch.empty(world, dtype=torch.int64)
            dist.all_to_all_single(got, torch.tensor(send), group=pg)
            recv = got.tolist()
        if sum(recv) > out.shape[0]:
            raise RuntimeError(f"all_to_all_vdev: {sum(recv)} rows arrive but out holds {out.shape[0]}")
        row_bytes = inp.stride(0) * inp.element_size()
        per_peer = kernel_blocks_per_peer(inp.numel() * inp.element_size(), world, self.intra_node, self.env_blocks)
        for peer, n in [*enumerate(send), *enumerate(recv)]:
            if (n * row_bytes) % per_peer:
                raise RuntimeError(
                    f"all_to_all_vdev: device-side assert `block_size * blocks_per_peer == peer_size` failed: "
                    f"{n * row_bytes} bytes with peer {peer} over {per_peer} blocks per peer"
                )
        row = math.prod(inp.shape[1:])
        src = inp.reshape(inp.shape[0], -1)[: sum(send)].reshape(-1).view(torch.uint8)
        dst = out.reshape(out.shape[0], -1)[: sum(recv)].reshape(-1).view(torch.uint8)
        unit = row * inp.element_size()
        if world > 1:
            dist.all_to_all_single(dst, src.clone(), [n * unit for n in recv], [n * unit for n in send], group=pg)
        else:
            dst.copy_(src)
        oso[0] = torch.tensor(recv)
        oso[1] = torch.tensor([0] + list(torch.tensor(recv).cumsum(0)[:-1].tolist()))
        self._last[name] = (inp.data_ptr(), oso.data_ptr())
        self.op_calls.append(name)


# ----------------------------------------------------------------- torch.cuda doubles
class CudaStream:
    """``torch.cuda.Stream`` as far as the transport uses it (declared signatures of torch 2.14.1).

    ``current_stream()`` wraps the current stream anew on every call, as torch's does: wrappers
    of one stream compare equal and share what was waited on, but are not the same object.
    """

    def __init__(self, stream_id: int = 0, waited: list | None = None) -> None:
        self.stream_id = stream_id
        self.waited: list[CudaEvent] = [] if waited is None else waited

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CudaStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(self.stream_id)

    def wait_event(self, event: CudaEvent) -> None:
        declared.load("torch").bind_py("torch.cuda.Stream.wait_event", event)
        self.waited.append(event)


class CudaEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        declared.load("torch").bind_py("torch.cuda.Event", *args, **kwargs)
        self.recorded_on: CudaStream | None = None

    def record(self, *args: Any, **kwargs: Any) -> None:
        self.recorded_on = declared.load("torch").bind_py("torch.cuda.Event.record", *args, **kwargs)["stream"]

    def query(self) -> bool:
        return True


def install(setattr_: Any, double: SymmMemDouble, stream: CudaStream | None = None) -> CudaStream:
    """Route the NVSHMEM transport and the CUDA backend's availability checks to the doubles.

    ``setattr_`` is pytest's ``monkeypatch.setattr`` or plain ``setattr`` (in a rank process).
    """
    from torch.distributed import _symmetric_memory as symm_mem

    from portapipe.backends import cuda as cuda_mod
    from portapipe.backends import nvshmem

    stream = stream or CudaStream()

    def current_stream(*args: Any, **kwargs: Any) -> CudaStream:
        declared.load("torch").bind_py("torch.cuda.current_stream", *args, **kwargs)
        return CudaStream(stream.stream_id, stream.waited)  # a new wrapper of the same stream

    setattr_(nvshmem.NvshmemTransport, "_symm_mem", staticmethod(double.module))
    setattr_(nvshmem.NvshmemTransport, "_all_to_all_vdev", staticmethod(lambda: double.all_to_all_vdev))
    setattr_(symm_mem, "is_nvshmem_available", double.is_nvshmem_available)
    setattr_(torch.cuda, "current_stream", current_stream)
    setattr_(torch.cuda, "Event", CudaEvent)
    setattr_(torch.Tensor, "pin_memory", lambda self: self)  # a CPU-only torch cannot pin
    setattr_(cuda_mod.CUDABackend, "is_available", classmethod(lambda cls: True))
    setattr_(cuda_mod.CUDABackend, "device", lambda self, local_rank=None: torch.device("cpu"))
    return stream


def world_group(timeout_s: float) -> Any:
    """A gloo group over every rank whose collectives give up after ``timeout_s`` (collective)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
