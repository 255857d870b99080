"""Expert all-to-all over NVSHMEM symmetric memory (``torch.ops.symm_mem.all_to_all_vdev``).

Facts from torch 2.14.1 (its symmetric-memory C++ and Python) that shape this module:

* **Allocation is collective over the whole job.** On the NVSHMEM backend ``symm_mem.empty``
  ends in ``nvshmem_malloc`` over the world group, and the first ``rendezvous`` of a buffer
  with a group allocates that group's signal pad the same way. Every rank must make the same
  allocations in the same order, whatever its EP group: a rank allocating lazily at its first
  expert exchange waits for ranks of other pipeline stages that are waiting for its
  activations. So :meth:`NvshmemTransport.setup` runs once at setup on every rank (the backend
  calls it from ``parallel_groups``) and an exchange never allocates.
* **So is the op's team.** The op works on an NVSHMEM team that it makes at its first call on
  a group: ``TeamManager`` splits it off the world team (``nvshmem_team_split_strided`` with
  parent ``NVSHMEM_TEAM_WORLD``, collective over every PE; in 2.14.1 ``all_to_all_vdev`` calls
  it through ``group_to_team_pool``). A first exchange inside the schedule would hang as a lazy
  allocation does, so setup runs one empty exchange on every rank: the team exists before the
  schedule starts. The team manager also refuses a one-rank group (the backend keeps those on
  ``all_to_all_single``).
* **Per-peer block rule.** The kernel splits the bytes it receives from each peer over
  ``blocks_per_peer`` thread blocks and asserts that they divide evenly (``allToAllV``:
  ``block_size * blocks_per_peer == peer_size``); the block count follows from the byte size
  of the whole input buffer and the group size (:func:`a2a_blocks_per_peer`). Every per-peer
  chunk is padded to a multiple of that unit; the receiver knows the true counts and skips the
  padding.
* **Buffer reuse.** Peers read this rank's input buffer remotely (``getmem``) and the op ends
  with ``nvshmem_quiet`` (this rank's own reads done), not a barrier, so a slower peer may still
  be reading when this rank starts its next exchange. Each exchange's first kernel ends in a
  team barrier that no peer passes before its previous exchange is done: a peer is at most one
  exchange behind. Hence **double buffering**: calls alternate between two input buffers and
  two split/offset buffers (peers write their splits into it at the start of an exchange), so a
  buffer is rewritten only after the barrier of the exchange in between. A fence (a barrier
  after every exchange) would be just as correct but costs a synchronisation per exchange; the
  second input buffer costs memory instead, which ``nvshmem_buffer_mb`` bounds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: The first torch release with ``set_backend``, ``get_backend`` and the five-argument
#: ``all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name)`` (2.8 has
#: ``is_nvshmem_available`` and a four-argument op; read from the 2.7.1, 2.8.0 and 2.9.0 wheels).
NVSHMEM_MIN_TORCH = (2, 9)
NVSHMEM_APIS = ("set_backend", "get_backend", "is_nvshmem_available", "empty", "rendezvous")
#: Bytes one thread block of ``allToAllV`` moves per loop round (16 B x 512 threads x 8 loops).
_A2A_CHUNK_BYTES = 16 * 512 * 8
_A2A_MAX_BLOCKS = {True: 64, False: 16}  # within one node (direct access) / across nodes


def nvshmem_api_missing() -> str | None:
    """What this torch lacks for the NVSHMEM transport, or None when it has all of it."""
    from torch.torch_version import TorchVersion

    version = TorchVersion(torch.__version__)
    need = ".".join(map(str, NVSHMEM_MIN_TORCH))
    if version < NVSHMEM_MIN_TORCH:
        return f"torch {torch.__version__} is older than {need}, the first release with the NVSHMEM APIs it uses"
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except Exception as exc:  # a build without distributed support
        return f"torch.distributed._symmetric_memory failed to import ({exc})"
    missing = [name for name in NVSHMEM_APIS if not hasattr(symm_mem, name)]
    if missing:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory.{', '.join(missing)} (torch >= {need} has)"
    op = getattr(getattr(torch.ops, "symm_mem", None), "all_to_all_vdev", None)
    if op is None or len(op.default._schema.arguments) != 5:
        return f"torch {torch.__version__} has no five-argument torch.ops.symm_mem.all_to_all_vdev (torch >= {need} has)"
    return None


def a2a_blocks_per_peer(input_bytes: int, world: int, intra_node: bool, env_blocks: int | None = None) -> int:
    """Thread blocks per peer of torch 2.14.1's ``all_to_all_vdev`` (``get_a2a_nblocks``).

    ``TORCH_SYMMMEM_NBLOCKS`` (``env_blocks``) overrides the block count; otherwise one block
    per 64 KiB of the input buffer, rounded up to a multiple of the group size, at most 64
    within a node and 16 across nodes. Each peer gets ``blocks // world`` of them (at least 1).
    """
    if env_blocks is not None and env_blocks > 0:
        blocks = env_blocks
    else:
        blocks = math.ceil(input_bytes / _A2A_CHUNK_BYTES)
        blocks = math.ceil(blocks / world) * world
        blocks = min(blocks, _A2A_MAX_BLOCKS[intra_node])
    return max(blocks // world, 1)


def chunk_unit(buffer_bytes: int, world: int, element_size: int, env_blocks: int | None = None) -> int:
    """Elements every per-peer chunk is padded to a multiple of, so the kernel's block split is
    exact whether the group is within one node or not (torch decides that; both are covered)."""
    per_peer = math.lcm(*(a2a_blocks_per_peer(buffer_bytes, world, intra, env_blocks) for intra in (True, False)))
    return math.lcm(per_peer, element_size) // element_size


def _padded(counts: Sequence[int], unit: int) -> list[int]:
    return [math.ceil(c / unit) * unit for c in counts]


def _starts(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _env_blocks() -> int | None:
    raw = os.environ.get("TORCH_SYMMMEM_NBLOCKS", "")
    return int(raw) if raw.strip() else None


@dataclass
class _GroupBuffers:
    """Symmetric staging tensors of one group, allocated at setup; bytes, viewed per call's dtype."""

    group_name: str
    world: int
    inputs: tuple[torch.Tensor, torch.Tensor]  # [capacity] uint8 each; calls alternate between them
    output: torch.Tensor  # [capacity] uint8; only this rank's own reads write it
    in_splits: torch.Tensor  # [world] int64, elements sent to each peer; read by this rank only
    splits_offsets: tuple[torch.Tensor, torch.Tensor]  # [2, world] int64 each; peers write row 0
    calls: int = 0
    last_use: Any = None  # event after the last read of ``output``; the next call waits for it


class StreamWork:
    """Handle of a stream-ordered operation, shaped like a torch.distributed work handle."""

    def __init__(self, done: Any) -> None:
        self._done = done

    def wait(self, timeout: Any = None) -> bool:
        # Make the waiting stream depend on the operation, as NCCL's work.wait() does.
        torch.cuda.current_stream().wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return bool(self._done.query())


class NvshmemTransport:
    """Expert all-to-all through NVSHMEM symmetric memory; see the module docstring for the rules.

    ``capacity_bytes`` is the size of each staging buffer (two input buffers and one output
    buffer per EP group). Splits count rows; the op counts elements of its flat buffers, so
    rows are flattened, per-peer chunks padded, and splits scaled.
    """

    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        self.device = device
        self.capacity_bytes = capacity_bytes // 16 * 16  # whole elements of any dtype
        self.env_blocks = _env_blocks()
        self._buffers: dict[str, _GroupBuffers] = {}

    @staticmethod
    def _symm_mem() -> Any:
        from torch.distributed import _symmetric_memory as symm_mem

        return symm_mem

    @staticmethod
    def _all_to_all_vdev() -> Any:
        return torch.ops.symm_mem.all_to_all_vdev

    def setup(self, group: Any = None) -> None:
        """Allocate and rendezvous this group's buffers. Collective over the whole job: every
        rank calls it once, at the same point of setup, with its own group of the same size."""
        group = group if group is not None else dist.group.WORLD
        name = group.group_name
        if name in self._buffers:
            return
        symm_mem = self._symm_mem()
        if symm_mem.get_backend(self.device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")  # must precede the process's first symmetric allocation
        world = dist.get_world_size(group)
        cap = self.capacity_bytes
        bufs = _GroupBuffers(
            group_name=name,
            world=world,
            inputs=(
                symm_mem.empty(cap, dtype=torch.uint8, device=self.device),
                symm_mem.empty(cap, dtype=torch.uint8, device=self.device),
            ),
            output=symm_mem.empty(cap, dtype=torch.uint8, device=self.device),
            in_splits=symm_mem.empty(world, dtype=torch.int64, device=self.device),
            splits_offsets=(
                symm_mem.empty(2, world, dtype=torch.int64, device=self.device),
                symm_mem.empty(2, world, dtype=torch.int64, device=self.device),
            ),
        )
        for t in (*bufs.inputs, bufs.output, bufs.in_splits, *bufs.splits_offsets):
            symm_mem.rendezvous(t, name)  # collective: peers map each other's buffers
        # An empty exchange, on every rank at once: the op makes the group's NVSHMEM team at its
        # first call, a world-collective split that must not wait until the schedule runs.
        bufs.in_splits.zero_()
        self._all_to_all_vdev()(bufs.inputs[0], bufs.output, bufs.in_splits, bufs.splits_offsets[0], name)
        bufs.calls = 1  # the next exchange uses the other buffers
        self._buffers[name] = bufs

    def unit(self, world: int, element_size: int) -> int:
        """Elements each per-peer chunk is padded to a multiple of, for a group of ``world``."""
        return chunk_unit(self.capacity_bytes, world, element_size, self.env_blocks)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: Any = None,
        async_op: bool = False,
    ) -> StreamWork | None:
        group = group if group is not None else dist.group.WORLD
        bufs = self._buffers.get(group.group_name)
        if bufs is None:
            raise RuntimeError(
                f"expert all-to-all over nvshmem on group {group.group_name!r}: its symmetric buffers were not "
                "allocated at setup. NVSHMEM allocation is collective over the whole job, so every rank makes "
                "them in Backend.parallel_groups (or setup_expert_transport(group)) before any schedule runs."
            )
        if input.dtype != output.dtype:
            raise ValueError(f"expert all-to-all: input dtype {input.dtype} != output dtype {output.dtype}")
        if not output.is_contiguous():
            raise ValueError("expert all-to-all over nvshmem needs a contiguous output tensor")
        row = math.prod(input.shape[1:])
        send = [int(s) * row for s in input_split_sizes]
        recv = [int(s) * row for s in output_split_sizes]
        if sum(send) != input.numel() or sum(recv) != output.numel():
            raise ValueError(
                f"expert all-to-all: splits cover {sum(send)} input / {sum(recv)} output elements but the tensors "
                f"hold {input.numel()} / {output.numel()}"
            )
        elem = input.element_size()
        unit = self.unit(bufs.world, elem)
        send_padded, recv_padded = _padded(send, unit), _padded(recv, unit)
        need = max(sum(send_padded), sum(recv_padded)) * elem
        if need > self.capacity_bytes:
            need_mb = need / 2**20
            raise ValueError(
                f"expert all-to-all needs {need_mb:.1f} MiB of NVSHMEM buffer but backend_options.nvshmem_buffer_mb "
                f"is {self.capacity_bytes / 2**20:.1f}; raise it to at least {math.ceil(need_mb)} on every rank"
            )
        which = bufs.calls % 2
        staged = bufs.inputs[which].view(input.dtype)
        splits_offsets = bufs.splits_offsets[which]
        received = bufs.output.view(input.dtype)
        stream = torch.cuda.current_stream(self.device)
        if input.is_cuda:
            # The caller's tensors may come from another stream's pool (compute vs communication):
            # keep the allocator from reusing them before this stream is done with them.
            input.record_stream(stream)
            output.record_stream(stream)
        if bufs.last_use is not None:
            stream.wait_event(bufs.last_use)  # the previous call's read-out of ``output`` comes first
        flat_in = input.reshape(-1)
        for src, dst, n in zip(_starts(send), _starts(send_padded), send):
            if n:
                staged[dst : dst + n].copy_(flat_in[src : src + n], non_blocking=True)
        # Pinned host memory keeps the copy asynchronous; torch's host allocator keeps it alive until done.
        bufs.in_splits.copy_(torch.tensor(send_padded, dtype=torch.int64).pin_memory(), non_blocking=True)
        self._all_to_all_vdev()(staged, received, bufs.in_splits, splits_offsets, bufs.group_name)
        flat_out = output.view(-1)
        for src, dst, n in zip(_starts(recv_padded), _starts(recv), recv):
            if n:
                flat_out[dst : dst + n].copy_(received[src : src + n], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        bufs.last_use = done
        bufs.calls += 1
        return StreamWork(done) if async_op else None
