"""CUDA backend on NCCL: compute and communication streams, fused grouped matmul, event timers.

Importing this module touches no GPU: presence is judged from ``torch.cuda.device_count()``
(NVML-based, no context) or ``/dev/nvidia*``, and every CUDA call sits inside a method.

Expert-parallel transport: ``alltoall`` (NCCL ``all_to_all_single``) by default;
``backend_options: {ep_transport: nvshmem}`` sends expert dispatch/combine through NVSHMEM
symmetric memory (``torch.ops.symm_mem.all_to_all_vdev``) where torch reports NVSHMEM
available, and is refused with :class:`BackendUnavailable` where it is not.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .base import (
    Backend,
    BackendUnavailable,
    EventTimer,
    Timer,
    _fused_grouped_mm,
    grouped_mm_fused_ok,
    grouped_mm_reference,
)

EP_TRANSPORTS = ("alltoall", "nvshmem")
#: Default size of each NVSHMEM staging buffer (input and output, per group and dtype).
DEFAULT_NVSHMEM_BUFFER_MB = 128


def fused_grouped_mm_supported(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether torch's CUDA grouped_mm runs its fused kernel for ``dtype`` on this architecture.

    torch's fast path is bf16 on compute capability 9.x / 10.x (Hopper, Blackwell); elsewhere
    it loops over groups itself, so the portable loop is used instead and behaves the same.
    """
    return dtype == torch.bfloat16 and capability[0] in (9, 10)


def fused_path_ok(a: torch.Tensor, b: torch.Tensor, capability: tuple[int, int]) -> bool:
    """Operands (dtype, 16-byte strides) and architecture both allow the fused kernel."""
    return grouped_mm_fused_ok(a, b) and fused_grouped_mm_supported(a.dtype, capability)


def _nvidia_device_files() -> list[str]:
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


class CUDABackend(Backend):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    install_hint = (
        "It needs an NVIDIA GPU with its driver (check `nvidia-smi`) and a CUDA build of torch "
        "(the default Linux wheel: pip install torch); CUDA_VISIBLE_DEVICES must not hide the GPUs."
    )

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.ep_transport: str = str(self.options.get("ep_transport", "alltoall"))
        if self.ep_transport not in EP_TRANSPORTS:
            raise ValueError(
                f"backend_options.ep_transport: {self.ep_transport!r} is not one of {', '.join(EP_TRANSPORTS)}"
            )
        # Several ranks sharing one GPU cannot use NCCL (it refuses duplicate GPUs); gloo moves
        # CUDA tensors through host memory instead and keeps such runs possible.
        self.dist_backend = str(self.options.get("dist_backend", "nccl"))
        if self.dist_backend not in ("nccl", "gloo"):
            raise ValueError(f"backend_options.dist_backend: {self.dist_backend!r} is not one of nccl, gloo")
        if self.ep_transport == "nvshmem":
            reason = self.nvshmem_unavailable_reason()
            if reason:
                raise BackendUnavailable(reason)
        self._comm_stream: Any = None
        self._nvshmem: NvshmemTransport | None = None

    # ------------------------------------------------------------------ identity
    @classmethod
    def device_present(cls) -> bool:
        return cls.device_count() > 0 or bool(_nvidia_device_files())

    @classmethod
    def device_count(cls) -> int:
        if not torch.backends.cuda.is_built():
            return 0
        try:
            return int(torch.cuda.device_count())
        except Exception:  # a broken driver reads as no device; unavailable_reason says more
            return 0

    @classmethod
    def is_available(cls) -> bool:
        return (
            torch.backends.cuda.is_built()
            and cls.device_count() > 0
            and torch.cuda.is_available()
            and dist.is_nccl_available()
        )

    @classmethod
    def unavailable_reason(cls) -> str:
        if not torch.backends.cuda.is_built():
            return (
                f"backend 'cuda' is not available: this torch ({torch.__version__}) was built without CUDA. "
                "Install a CUDA build of torch (the default Linux wheel: pip install torch)."
            )
        if cls.device_count() == 0:
            files = _nvidia_device_files()
            seen = f"device files {', '.join(files)} exist but " if files else "no /dev/nvidia* device files and "
            return (
                f"backend 'cuda' is not available: no NVIDIA GPU found ({seen}torch.cuda.device_count() == 0). "
                + cls.install_hint
            )
        if not torch.cuda.is_available():
            return (
                "backend 'cuda' is not available: a GPU is present but torch cannot use it "
                f"(torch built for CUDA {torch.version.cuda}; is the driver older than that?). " + cls.install_hint
            )
        if not dist.is_nccl_available():
            return "backend 'cuda' is not available: this torch build has no NCCL; install the default Linux wheel of torch."
        return "backend 'cuda' is available."

    @classmethod
    def nvshmem_unavailable_reason(cls) -> str | None:
        """Why ``ep_transport: nvshmem`` cannot run here, or None when it can."""
        fix = "Use backend_options: {ep_transport: alltoall} (the default), which runs everywhere."
        if not cls.is_available():
            return f"backend_options.ep_transport: nvshmem needs a usable NVIDIA GPU: {cls.unavailable_reason()} {fix}"
        try:
            from torch.distributed import _symmetric_memory as symm_mem
        except Exception as exc:
            return f"backend_options.ep_transport: nvshmem needs torch.distributed._symmetric_memory, which failed to import ({exc}). {fix}"
        if not symm_mem.is_nvshmem_available():
            return (
                "backend_options.ep_transport: nvshmem is not available: torch reports NVSHMEM unavailable "
                "(torch.distributed._symmetric_memory.is_nvshmem_available() is False). Install the NVSHMEM "
                f"runtime that matches torch's CUDA {torch.version.cuda} (pip package nvidia-nvshmem-cu"
                f"{str(torch.version.cuda).split('.')[0]}). {fix}"
            )
        return None

    def _index(self, local_rank: int | None = None) -> int:
        idx = self.local_rank if local_rank is None else local_rank
        count = self.device_count()
        # Ranks beyond the GPU count share GPUs round-robin (only possible with dist_backend gloo).
        return idx % count if count else idx

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cuda", self._index(local_rank))

    def device_module(self) -> Any:
        return torch.cuda

    def set_device(self) -> None:
        torch.cuda.set_device(self._index())

    # ------------------------------------------------------------ process groups
    def process_group_kwargs(self) -> dict[str, Any]:
        # device_id binds NCCL to this GPU and creates its communicator eagerly; gloo has no use for it.
        return {"device_id": self.device()} if self.dist_backend == "nccl" else {}

    # ------------------------------------------------------- streams and events
    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device())

    def comm_stream(self) -> Any:
        if self._comm_stream is None:
            # High priority (lower number; clamped to the device's range): a ready all-to-all
            # should not queue behind compute kernels.
            self._comm_stream = torch.cuda.Stream(device=self.device(), priority=-1)
        return self._comm_stream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device())

    # ------------------------------------------------------------ communication
    def expert_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if self.ep_transport != "nvshmem":
            return super().expert_all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op)
        if self._nvshmem is None:
            mb = float(self.options.get("nvshmem_buffer_mb", DEFAULT_NVSHMEM_BUFFER_MB))
            self._nvshmem = NvshmemTransport(self.device(), int(mb * 2**20))
        return self._nvshmem.all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op)

    # ------------------------------------------------------------------ kernels
    def grouped_mm_fused(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether :meth:`grouped_mm` takes torch's fused kernel for these operands."""
        if not (a.is_cuda and b.is_cuda):
            return False
        return fused_path_ok(a, b, torch.cuda.get_device_capability(a.device))

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.grouped_mm_fused(a, b):
            return _fused_grouped_mm()(a, b, offs=offs.to(device=a.device, dtype=torch.int32))
        return grouped_mm_reference(a, b, offs)

    # ------------------------------------------------------------------- memory
    def memory_allocated(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device()))

    def max_memory_allocated(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device()))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device())

    # ------------------------------------------------------------------- timers
    def timer(self) -> Timer:
        return EventTimer(torch.cuda.Event)

    # ---------------------------------------------------------------------- RNG
    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(self.device())}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device())

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["ep_transport"] = self.ep_transport
        if self.is_available():
            props = torch.cuda.get_device_properties(self.device())
            out["device_name"] = props.name
            out["capability"] = f"{props.major}.{props.minor}"
        return out


# ---------------------------------------------------------------- NVSHMEM transport
@dataclass
class _SymmetricBuffers:
    """Symmetric-memory staging tensors of one (group, dtype): same size on every rank."""

    inp: torch.Tensor
    out: torch.Tensor
    in_splits: torch.Tensor  # [group size] int64, elements sent to each peer
    out_splits_offsets: torch.Tensor  # [2, group size] int64, filled by the op: received splits, offsets
    last_use: Any = None  # event after the last read of ``out``; the next use waits for it


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


def element_splits(split_rows: Sequence[int], row_numel: int) -> list[int]:
    """Row splits of an all-to-all as element counts of the flattened tensor."""
    return [int(s) * row_numel for s in split_rows]


class NvshmemTransport:
    """Expert all-to-all through NVSHMEM symmetric memory (``all_to_all_vdev``).

    The op needs its input, output and split tensors in symmetric memory of equal size on
    every rank. Buffers of ``capacity_bytes`` each are made once per (group, dtype) with a
    collective allocation, so every rank must make its first call for a group and dtype at
    the same point of the program (as the expert layers do). Splits count rows of the
    input; the op itself counts elements, so rows are flattened and splits scaled.
    """

    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        self.device = device
        self.capacity_bytes = capacity_bytes
        self._buffers: dict[tuple[str, torch.dtype], _SymmetricBuffers] = {}

    @staticmethod
    def _symm_mem() -> Any:
        from torch.distributed import _symmetric_memory as symm_mem

        return symm_mem

    @staticmethod
    def _all_to_all_vdev() -> Any:
        return torch.ops.symm_mem.all_to_all_vdev

    def _get_buffers(self, group: Any, group_name: str, dtype: torch.dtype) -> _SymmetricBuffers:
        key = (group_name, dtype)
        if key in self._buffers:
            return self._buffers[key]
        symm_mem = self._symm_mem()
        if symm_mem.get_backend(self.device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")  # must precede the process's first symmetric allocation
        world = dist.get_world_size(group)
        numel = self.capacity_bytes // torch.empty((), dtype=dtype).element_size()
        bufs = _SymmetricBuffers(
            inp=symm_mem.empty(numel, dtype=dtype, device=self.device),
            out=symm_mem.empty(numel, dtype=dtype, device=self.device),
            in_splits=symm_mem.empty(world, dtype=torch.int64, device=self.device),
            out_splits_offsets=symm_mem.empty((2, world), dtype=torch.int64, device=self.device),
        )
        for t in (bufs.inp, bufs.out, bufs.in_splits, bufs.out_splits_offsets):
            symm_mem.rendezvous(t, group_name)  # collective: peers map each other's buffers
        self._buffers[key] = bufs
        return bufs

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
        group_name = group.group_name
        if input.dtype != output.dtype:
            raise ValueError(f"expert all-to-all: input dtype {input.dtype} != output dtype {output.dtype}")
        if not output.is_contiguous():
            raise ValueError("expert all-to-all over nvshmem needs a contiguous output tensor")
        row_numel = math.prod(input.shape[1:])
        in_elems = element_splits(input_split_sizes, row_numel)
        n_in, n_out = sum(in_elems), sum(output_split_sizes) * row_numel
        if n_in != input.numel() or n_out != output.numel():
            raise ValueError(
                f"expert all-to-all: splits cover {n_in} input / {n_out} output elements but the tensors hold "
                f"{input.numel()} / {output.numel()}"
            )
        bufs = self._get_buffers(group, group_name, input.dtype)
        if max(n_in, n_out) > bufs.inp.numel():
            need_mb = max(n_in, n_out) * input.element_size() / 2**20
            raise ValueError(
                f"expert all-to-all needs {need_mb:.1f} MiB of NVSHMEM buffer but backend_options.nvshmem_buffer_mb "
                f"is {self.capacity_bytes / 2**20:.1f}; raise it to at least {math.ceil(need_mb)} on every rank"
            )
        stream = torch.cuda.current_stream(self.device)
        if input.is_cuda:
            # The caller's tensors may come from another stream's pool (compute vs communication):
            # keep the allocator from reusing them before this stream is done with them.
            input.record_stream(stream)
            output.record_stream(stream)
        if bufs.last_use is not None:
            stream.wait_event(bufs.last_use)  # the previous call's output may still be read on another stream
        bufs.inp[:n_in].copy_(input.reshape(-1), non_blocking=True)
        # Pinned host memory keeps the copy asynchronous; torch's host allocator keeps it alive until done.
        bufs.in_splits.copy_(torch.tensor(in_elems, dtype=torch.int64).pin_memory(), non_blocking=True)
        # The op exchanges the splits among peers before any data moves, so a peer cannot
        # write into ``out`` before this rank's previous read of it (ordered above) is done.
        self._all_to_all_vdev()(bufs.inp, bufs.out, bufs.in_splits, bufs.out_splits_offsets, group_name)
        output.view(-1).copy_(bufs.out[:n_out], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        bufs.last_use = done
        return StreamWork(done) if async_op else None
