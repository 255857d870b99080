"""CUDA backend on NCCL: compute and communication streams, fused grouped matmul, event timers.

Importing this module touches no GPU: presence is judged from ``torch.cuda.device_count()``
(NVML-based, no context) or ``/dev/nvidia*``, and every CUDA call sits inside a method.

Expert-parallel transport: ``alltoall`` (NCCL ``all_to_all_single``) by default;
``backend_options: {ep_transport: nvshmem}`` sends expert dispatch/combine through NVSHMEM
symmetric memory (:mod:`portapipe.backends.nvshmem`) where torch (>= 2.9) reports NVSHMEM
available, and is refused with :class:`BackendUnavailable` where it is not.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .base import Backend, BackendUnavailable, EventSpanClock, EventTimer, SpanClock, Timer
from .capabilities import Capabilities
from .grouped_mm import (
    _fused_grouped_mm,
    cut_rows_past_end,
    fused_offs,
    grouped_mm_layout_ok,
    grouped_mm_reference,
    zero_empty_groups,
    zero_rows_past_end,
)
from .nvshmem import NVSHMEM_MIN_TORCH, NvshmemTransport, nvshmem_api_missing
from .scaled_mm import blockwise_mm
from .scaled_mm import probe as probe_blockwise
from .staged_p2p import HostStagedP2P, HostStaging

#: Default size of each NVSHMEM staging buffer (input and output, per group and dtype).
DEFAULT_NVSHMEM_BUFFER_MB = 128


def fused_grouped_mm_supported(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether torch's CUDA grouped_mm runs its fused kernel for ``dtype`` on this architecture.

    torch's fast path is bf16 on compute capability 9.x / 10.x (Hopper, Blackwell); elsewhere
    it loops over groups itself, so the portable loop is used instead and behaves the same.
    On 10.x the 2d x 2d form (the weight gradient) gives non-zero results for groups without
    rows (pytorch issue 172439, seen on B200); :func:`empty_groups_need_zeroing` makes the
    backend zero those groups after the call.
    """
    return dtype == torch.bfloat16 and capability[0] in (9, 10)


def empty_groups_need_zeroing(capability: tuple[int, int]) -> bool:
    """Compute capability 10.x: empty groups of the fused 2d x 2d result are not zero (pytorch issue 172439)."""
    return capability[0] == 10


def fused_path_ok(a: torch.Tensor, b: torch.Tensor, capability: tuple[int, int]) -> bool:
    """Operands (dtype, strides decided as torch does) and architecture allow the fused kernel."""
    return (
        _fused_grouped_mm() is not None
        and b.dtype == a.dtype
        and fused_grouped_mm_supported(a.dtype, capability)
        and grouped_mm_layout_ok(a, b)
    )


def _buffer_bytes(mb: Any) -> int:
    """``backend_options.nvshmem_buffer_mb`` in bytes; anything but a number of MiB worth 1 KiB or more is refused."""
    ok = isinstance(mb, (int, float)) and not isinstance(mb, bool) and math.isfinite(mb) and mb * 2**20 >= 1024
    if not ok:
        raise ValueError(
            f"backend_options.nvshmem_buffer_mb: {mb!r} is not a size in MiB of at least 1 KiB (0.001); "
            f"the default is {DEFAULT_NVSHMEM_BUFFER_MB}"
        )
    return int(mb * 2**20)


def cuda_staging(device: torch.device) -> HostStaging:
    """How a CUDA tensor goes through pinned host memory and back (for gloo's send / recv).

    To the host: a copy on the current stream into a pinned buffer (torch's caching host allocator
    keeps freed buffers for reuse), waited for once per batch by synchronizing that stream, since
    gloo reads the buffer from its own thread. Back: a copy on the current stream, so the work the
    caller queues after ``wait`` sees the data, as with NCCL; the pinned buffer is not reused before
    that copy has run (the allocator records it).
    """
    return HostStaging(
        host_empty=lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True),
        to_host=lambda dst, src: dst.copy_(src, non_blocking=True),
        host_ready=lambda: torch.cuda.current_stream(device).synchronize(),
        to_device=lambda dst, src: dst.copy_(src, non_blocking=True),
        on_host=lambda t: t.device.type == "cpu",
    )


def _nvidia_device_files() -> list[str]:
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


class CUDABackend(Backend):
    name = "cuda"
    option_keys = frozenset({"ep_transport", "dist_backend", "nvshmem_buffer_mb"})
    device_type = "cuda"
    dist_backend = "nccl"
    install_hint = (
        "It needs an NVIDIA GPU with its driver (check `nvidia-smi`) and a CUDA build of torch "
        "(the default Linux wheel: pip install torch); CUDA_VISIBLE_DEVICES must not hide the GPUs."
    )
    # NCCL's ncclDataType_t covers every floating dtype for every collective; torch's fused
    # grouped_mm is bf16 only (and only on compute capability 9.x / 10.x, decided per call).
    capabilities = Capabilities(
        dist_backend="nccl",
        compute_dtypes=("float64", "float32", "bfloat16", "float16"),
        reduce_dtypes=("float64", "float32", "bfloat16", "float16"),
        move_dtypes=("float64", "float32", "bfloat16", "float16"),
        ep_transports=("alltoall", "nvshmem"),
        fused_grouped_mm_dtypes=("bfloat16",),
        # torch._scaled_mm with DeepSeek-style scaling where the GPU and torch run it (a one-time
        # probe per process and device decides), else the emulation on the GPU in float64
        fp8_matmul="blockwise",
        # the memory-efficient kernel of scaled_dot_product_attention takes a value head width other
        # than the query / key's (flash does not; the CPU has neither for it)
        fused_attention_unequal_heads=True,
        streams=True,
        memory_stats=True,
        timer="events",
        host_copies="async",  # page-locked host buffers, copies on a stream of their own
        # cuBLAS and the CPU sum in different orders: float64 here is not the CPU reference's bit
        # for bit, so verify runs float32 on the device against float64 on the CPU (its tolerance)
        matches_cpu_float64=False,
    )

    #: the blockwise probe's answer per device index: None (it serves) or why not (see fp8_path)
    _fp8_probed: dict[int, str | None] = {}

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        # Several ranks sharing one GPU cannot use NCCL (it refuses duplicate GPUs); gloo moves
        # CUDA tensors through host memory instead and keeps such runs possible.
        self.dist_backend = str(self.options.get("dist_backend", "nccl"))
        if self.dist_backend not in ("nccl", "gloo"):
            raise ValueError(f"backend_options.dist_backend: {self.dist_backend!r} is not one of nccl, gloo")
        self.nvshmem_buffer_bytes = _buffer_bytes(self.options.get("nvshmem_buffer_mb", DEFAULT_NVSHMEM_BUFFER_MB))
        if self.ep_transport == "nvshmem":
            reason = self.nvshmem_unavailable_reason()
            if reason:
                raise BackendUnavailable(reason)
        self._comm_stream: Any = None
        self._copy_stream: Any = None
        self._nvshmem: NvshmemTransport | None = None
        # gloo's send / recv take host memory only (its collectives stage device tensors
        # themselves): the pipeline's point-to-point goes through pinned host buffers.
        self._staged_p2p = HostStagedP2P(cuda_staging(self.device())) if self.dist_backend == "gloo" else None

    # ------------------------------------------------------------------ identity
    @classmethod
    def launch_problem(cls, local_ranks: int, options: dict[str, Any] | None = None) -> str | None:
        """NCCL takes one rank per GPU: more local ranks than GPUs need gloo between them."""
        if str((options or {}).get("dist_backend", "nccl")) != "nccl":
            return None
        gpus = cls.device_count()  # NVML's count where it answers: no CUDA context is made
        if gpus == 0 or local_ranks <= gpus:
            return None  # no GPU at all is unavailable_reason's to say
        return (
            f"backend 'cuda': {local_ranks} ranks on this machine but {gpus} GPU{'s' if gpus > 1 else ''}, and NCCL "
            f"takes one rank per GPU; set backend_options.dist_backend: gloo to let ranks share a GPU "
            f"(or run at most {gpus} rank{'s' if gpus > 1 else ''} here)"
        )

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
        missing = nvshmem_api_missing()
        if missing:
            need = ".".join(map(str, NVSHMEM_MIN_TORCH))
            return f"backend_options.ep_transport: nvshmem needs torch >= {need}: {missing}. {fix}"
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

    def copy_stream(self) -> Any:
        if self._copy_stream is None:
            # the copy engines run it beside the compute and communication streams
            self._copy_stream = torch.cuda.Stream(device=self.device())
        return self._copy_stream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device())

    # ------------------------------------------------------------ communication
    def batch_isend_irecv(self, ops: Sequence[dist.P2POp]) -> list[Any]:
        if self._staged_p2p is not None:
            return self._staged_p2p.batch_isend_irecv(ops)
        return super().batch_isend_irecv(ops)

    def expert_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if self.ep_transport != "nvshmem" or dist.get_world_size(group) == 1:
            # A one-rank group has nothing to send: no symmetric buffers are made for it.
            return super().expert_all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op)
        return self._nvshmem_transport().all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op)

    def _nvshmem_transport(self) -> NvshmemTransport:
        if self._nvshmem is None:
            self._nvshmem = NvshmemTransport(self.device(), self.nvshmem_buffer_bytes)
        return self._nvshmem

    def setup_expert_transport(self, group: Any = None) -> None:
        # NVSHMEM allocation is collective over the whole job: every rank allocates here, at
        # setup, never at its first exchange (see portapipe/backends/nvshmem.py).
        if self.ep_transport == "nvshmem" and dist.get_world_size(group) > 1:
            self._nvshmem_transport().setup(group)

    # ------------------------------------------------------------------ kernels
    def grouped_mm_fused(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether :meth:`grouped_mm` takes torch's fused kernel for these operands."""
        if not (a.is_cuda and b.is_cuda):
            return False
        return fused_path_ok(a, b, torch.cuda.get_device_capability(a.device))

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if not self.grouped_mm_fused(a, b):
            return grouped_mm_reference(a, b, offs)
        if b.dim() == 3:
            a = cut_rows_past_end(a, offs)
        out = _fused_grouped_mm()(a, b, offs=fused_offs(offs, a.device))
        if b.dim() == 3:
            return zero_rows_past_end(out, offs)
        if empty_groups_need_zeroing(torch.cuda.get_device_capability(a.device)):
            return zero_empty_groups(out, offs)
        return out

    def fp8_blockwise_problem(self) -> str | None:
        """Why torch's blockwise ``_scaled_mm`` does not serve this GPU (one line), or None when it
        does: decided once per process and device by its presence and a probe against the emulation
        (:func:`~portapipe.backends.scaled_mm.probe`), never by a version number."""
        index = self._index()
        if index not in self._fp8_probed:
            self._fp8_probed[index] = probe_blockwise(getattr(torch, "_scaled_mm", None), self.device())
        return self._fp8_probed[index]

    def fp8_path(self) -> str:
        """Which FP8 matmul runs here: ``blockwise`` (torch._scaled_mm) or ``emulated: <why>``."""
        problem = self.fp8_blockwise_problem()
        return "blockwise" if problem is None else f"emulated: {problem}"

    def fp8_mm(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        # the routed experts come here one expert at a time (fp8_grouped_mm): torch has no blockwise grouped op
        if a.device.type != self.device_type or self.fp8_blockwise_problem() is not None:  # host tensors: the emulation
            return super().fp8_mm(a, a_scale, b, b_scale, out_dtype)
        return blockwise_mm(torch._scaled_mm, a, a_scale, b, b_scale, out_dtype)

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

    def profiler_activities(self) -> list[Any]:
        import torch.profiler

        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def span_clock(self) -> SpanClock:
        # NCCL's wait() holds a stream, not the host; gloo's (ranks sharing a GPU) blocks the host
        return EventSpanClock(torch.cuda.Event, self.synchronize, lambda: torch.cuda.Stream(device=self.device()), torch.cuda.stream,
                              works_on_streams=self.dist_backend == "nccl")

    # ---------------------------------------------------------------------- RNG
    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(self.device())}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device())

    @classmethod
    def software(cls) -> dict[str, Any]:
        """The CUDA software torch brings (read without a device, without creating a context)."""
        from importlib.metadata import distributions

        # NCCL as pip installs it beside torch (nvidia-nccl-cu12 / -cu13); a build that links its
        # own NCCL has no such package
        nccl = sorted(f"{d.metadata['Name']} {d.version}" for d in distributions() if str(d.metadata["Name"]).startswith("nvidia-nccl"))
        out: dict[str, Any] = {"cuda": torch.version.cuda, "nccl": ", ".join(nccl) or None, "nccl_available": dist.is_nccl_available()}
        out["nvshmem"] = "unavailable: " + reason if (reason := nvshmem_api_missing()) else "the API is there (whether the runtime loads: ep_transport: nvshmem's check)"
        return out

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), **self.software()}
        if self.is_available():
            props = torch.cuda.get_device_properties(self.device())
            out["device_name"] = props.name
            out["capability"] = f"{props.major}.{props.minor}"
            out["memory_bytes"] = int(props.total_memory)
            out["multiprocessors"] = int(props.multi_processor_count)
            out["nvshmem"] = self.nvshmem_unavailable_reason() or "available"
            out["fp8_matmul_path"] = self.fp8_path()
        return out
