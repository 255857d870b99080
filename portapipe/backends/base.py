"""The backend interface: the one place that differs between CPU, CUDA and Ascend.

Everything that is identical across devices is forwarded to ``torch.get_device_module``;
only what differs in meaning lives here. The interface is deliberately small (see DESIGN.md).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .capabilities import Capabilities
from .fp8_mm import fp8_grouped_mm_emulated, fp8_mm_emulated
from .grouped_mm import grouped_mm_reference
from .p2p_works import per_op

#: the reductions the interface's ``all_reduce`` and ``reduce_scatter_tensor`` take as ``op``
#: (``torch.distributed.ReduceOp`` names): those gloo, NCCL and HCCL all implement. portapipe
#: itself sums and takes maxima; the conformance kit holds every backend to all four.
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX")


#: The tensor forms of reduce-scatter and all-gather under each release's name: torch 2.13
#: named them ``reduce_scatter_single`` / ``all_gather_single`` (and warns on the old names);
#: 2.11 and 2.12 have only ``reduce_scatter_tensor`` / ``all_gather_into_tensor``.
TENSOR_COLLECTIVE_NAMES = {
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
}


def tensor_collective(kind: str) -> Any:
    """``torch.distributed``'s function for ``kind`` (a key of :data:`TENSOR_COLLECTIVE_NAMES`),
    under the newest name this torch has; looked up at each call, by presence, not by version."""
    for name in TENSOR_COLLECTIVE_NAMES[kind]:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"torch {torch.__version__} has none of torch.distributed.{', '.join(TENSOR_COLLECTIVE_NAMES[kind])}")


class BackendUnavailable(RuntimeError):
    """Raised when a backend is asked for on a machine that cannot run it."""


@dataclass
class ParallelGroups:
    """This rank's place in the pp x dp x ep mesh and the process groups along each axis.

    Ranks are laid out with ``ep`` innermost (expert all-to-all stays on neighbouring ranks,
    usually one node), then ``dp``, then ``pp`` outermost:
    ``rank = (pp_rank * dp + dp_rank) * ep + ep_rank``.
    """

    rank: int
    world_size: int
    pp: int
    dp: int
    ep: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    pp_group: Any = None
    dp_group: Any = None
    ep_group: Any = None
    # The group over which replicated (non-expert) parameters are averaged: every rank with
    # the same pipeline stage (dp x ep ranks).
    replica_group: Any = None
    pp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    ep_ranks: list[int] = field(default_factory=list)
    replica_ranks: list[int] = field(default_factory=list)

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, ep_rank: int | None = None) -> int:
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        ep_rank = self.ep_rank if ep_rank is None else ep_rank
        return (pp_rank * self.dp + dp_rank) * self.ep + ep_rank


def mesh_coords(rank: int, pp: int, dp: int, ep: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, ep_rank) of a global rank in the pp x dp x ep mesh."""
    if not 0 <= rank < pp * dp * ep:
        raise ValueError(f"rank {rank} is outside a mesh of pp*dp*ep = {pp * dp * ep} ranks")
    return rank // (dp * ep), (rank // ep) % dp, rank % ep


class Timer:
    """Elapsed time of a region. Wall clock by default; devices override with events."""

    def __init__(self) -> None:
        self._start = 0.0
        self.elapsed_s = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> float:
        self.elapsed_s = time.perf_counter() - self._start
        return self.elapsed_s


class EventTimer(Timer):
    """Device time of a region, from two timing events recorded on the current stream.

    ``event_factory(enable_timing=True)`` makes the events (``torch.cuda.Event``,
    ``torch.npu.Event``). Host wall clock would only measure how long launching took;
    the events measure when the device ran the work. ``stop`` waits for the end event.
    """

    def __init__(self, event_factory: Any) -> None:
        super().__init__()
        self._begin = event_factory(enable_timing=True)
        self._end = event_factory(enable_timing=True)

    def start(self) -> None:
        self._begin.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        self.elapsed_s = self._begin.elapsed_time(self._end) / 1000.0  # events report milliseconds
        return self.elapsed_s


#: a time mark a span clock gives: a host time (seconds of ``time.perf_counter``), an event recorded
#: on a stream, a cell a callback fills with a host time, or None (unknown)
Mark = Any


class SpanClock:
    """When the work of a recorded step ran, on the host clock (``time.perf_counter``): the
    ``wall`` timer of a backend's declaration (:attr:`Capabilities.timer`).

    :meth:`mark` is "now" where the work runs; :meth:`done` the time an asynchronous work (an
    exchange, a reduction) completes; :meth:`read` turns marks into seconds once, after the step.
    Here a mark is the host time itself, and completion comes from the work's future (a callback on
    the communication thread), where the work has one.
    """

    kind = "wall"

    def start(self) -> None:
        """Before a recorded step (outside it: a device clock may synchronize here)."""

    def now(self) -> float:
        """The host clock now, in seconds (what :meth:`read` gives marks in; ranks align on it)."""
        return time.perf_counter()

    def mark(self) -> Mark:
        return time.perf_counter()

    def done(self, work: Any, cell: list[float] | None = None) -> Mark:
        """The completion time of ``work`` once it is known (None: the work cannot tell; the
        caller's wait then bounds it). ``cell``: a list the caller's own completion callback
        appends the host time to, taken instead of a second callback."""
        if cell is not None:
            return cell
        future = getattr(work, "get_future", None)
        if future is None:
            return None
        try:
            fut = future()
        except RuntimeError:  # a work without a future (gloo's point-to-point)
            return None
        cell = []
        fut.add_done_callback(lambda _f: cell.append(time.perf_counter()))
        return cell

    def read(self, marks: Sequence[Mark]) -> list[float | None]:
        """Each mark in seconds of the host clock (None where its time is not known)."""
        return [_host_seconds(m) for m in marks]


def _host_seconds(mark: Mark) -> float | None:
    if isinstance(mark, float):
        return mark
    if isinstance(mark, list):
        return mark[0] if mark else None
    return None


class EventSpanClock(SpanClock):
    """Device time of a recorded step: each mark an event recorded on the stream the work runs on
    (the current stream where :meth:`mark` is called; an exchange's issue on the communication
    stream), read once after the step against a reference event taken at :meth:`start`, where the
    device was idle and the host's clock stands beside it. Nothing waits inside the step.

    ``event_factory(enable_timing=True)`` makes the events; ``synchronize()`` the device's; with
    ``works_on_streams`` (NCCL / HCCL: an async work's ``wait()`` makes the current stream wait, the
    host does not), :meth:`done` is an event recorded on a watch stream of its own after it waited
    for the work (``stream_factory()`` and ``stream_ctx(stream)`` make and enter it); without (gloo,
    whose ``wait()`` blocks the host), the work's future gives the host time, as on the CPU.
    """

    kind = "events"

    def __init__(self, event_factory: Any, synchronize: Any, stream_factory: Any = None, stream_ctx: Any = None,
                 works_on_streams: bool = True) -> None:
        self._event, self._sync = event_factory, synchronize
        self._stream_factory, self._stream_ctx = stream_factory, stream_ctx
        self._on_streams = works_on_streams and stream_factory is not None
        self._watch: Any = None
        self._ref: Any = None
        self._origin = 0.0

    def start(self) -> None:
        self._sync()
        self._ref = self._event(enable_timing=True)
        self._ref.record()
        self._ref.synchronize()
        self._origin = time.perf_counter()

    def mark(self) -> Mark:
        ev = self._event(enable_timing=True)
        ev.record()
        return ev

    def done(self, work: Any, cell: list[float] | None = None) -> Mark:
        if not self._on_streams or not hasattr(work, "wait"):
            return super().done(work, cell)
        if self._watch is None:
            self._watch = self._stream_factory()
        with self._stream_ctx(self._watch):  # only this stream waits: no other work is held up
            work.wait()
            return self.mark()

    def read(self, marks: Sequence[Mark]) -> list[float | None]:
        if self._ref is None:
            raise RuntimeError("EventSpanClock.read before start(): no reference event to read the marks against")
        if any(not isinstance(m, (float, list, type(None))) for m in marks):
            self._sync()  # once, after the step: every event has run
        return [_host_seconds(m) if isinstance(m, (float, list, type(None))) else self._origin + self._ref.elapsed_time(m) / 1000.0
                for m in marks]


class Backend(ABC):
    """One kind of hardware: identity, process groups, streams, communication, kernels, memory.

    Subclasses set ``name``, ``device_type``, ``dist_backend`` and ``capabilities`` and implement
    the few methods whose meaning differs per device. Instances are cheap; one is made per process.
    """

    name: str = "abstract"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    #: how to make the backend available, shown when it is asked for and missing
    install_hint: str = ""
    #: the ``backend_options`` keys this backend reads; any other key is refused, since a misspelled
    #: option would otherwise be ignored without a word. None (a plug-in that declares none): any key.
    option_keys: frozenset[str] | None = None
    #: what the backend can do (dtypes per operation family, transports, kernels, streams,
    #: memory figures); read through the class by config validation, verify and `info`. A
    #: plug-in that declares nothing is taken at the narrowest: float32, gloo, no streams.
    capabilities: ClassVar[Capabilities] = Capabilities(
        dist_backend="gloo", compute_dtypes=("float32",), reduce_dtypes=("float32",), move_dtypes=("float32",)
    )

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options: dict[str, Any] = dict(options or {})
        if self.option_keys is not None:
            known = ", ".join(sorted(self.option_keys)) or "none"
            unknown = [f"backend_options.{key}: not an option of backend {self.name!r} (its options: {known})" for key in sorted(set(self.options) - self.option_keys)]
            if unknown:
                raise ValueError("\n".join(unknown))
        self.ep_transport: str = str(self.options.get("ep_transport", "alltoall"))
        problem = self.capabilities.transport_problem(self.name, self.ep_transport)
        if problem:
            raise ValueError(problem)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._groups: ParallelGroups | None = None

    # ------------------------------------------------------------------ identity
    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """True when this machine has the device and the software to drive it."""

    @classmethod
    def launch_problem(cls, local_ranks: int, options: dict[str, Any] | None = None) -> str | None:
        """Why ``local_ranks`` ranks of this backend cannot run on this machine with these
        ``backend_options`` (one line), or None; asked before any rank starts."""
        return None

    @classmethod
    def device_present(cls) -> bool:
        """Whether the hardware is on this machine, judged without importing device software."""
        return cls.is_available()

    @classmethod
    def device_count(cls) -> int:
        return 0

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why ``is_available()`` is False, with what to install or check."""
        return f"backend {cls.name!r} is not available. {cls.install_hint}".strip()

    def device(self, local_rank: int | None = None) -> torch.device:
        idx = self.local_rank if local_rank is None else local_rank
        return torch.device(self.device_type, idx)

    def device_module(self) -> Any:
        """torch.cuda / torch.npu / torch.cpu: for what is identical across devices."""
        return torch.get_device_module(self.device_type)

    def set_device(self) -> None:
        """Bind this process to its local device."""

    # ------------------------------------------------------------ process groups
    def init_process_group(
        self, rank: int, world_size: int, timeout_s: float = 300.0, init_method: str | None = None
    ) -> None:
        """Join the default group (env:// by default: MASTER_ADDR / MASTER_PORT)."""
        if dist.is_initialized():
            return
        self.set_device()
        dist.init_process_group(
            backend=self.dist_backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            init_method=init_method or "env://",
            **self.process_group_kwargs(),
        )

    def process_group_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of ``dist.init_process_group`` for this device."""
        return {"device_id": self.device()} if self.device_type != "cpu" else {}

    def destroy_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._groups = None

    def new_group(self, ranks: Sequence[int]) -> Any:
        return dist.new_group(ranks=list(ranks), backend=self.dist_backend)

    def parallel_groups(self, pp: int, dp: int, ep: int) -> ParallelGroups:
        """Create (once) the PP, DP, EP and replica sub-groups of the pp x dp x ep mesh.

        Every rank must call this with the same sizes: ``new_group`` is collective.
        """
        if self._groups is not None:
            g = self._groups
            if (g.pp, g.dp, g.ep) != (pp, dp, ep):
                raise ValueError(f"parallel groups already made for pp={g.pp} dp={g.dp} ep={g.ep}")
            return g
        world = dist.get_world_size()
        if pp * dp * ep != world:
            raise ValueError(f"pp*dp*ep = {pp}*{dp}*{ep} = {pp * dp * ep} but the world has {world} ranks")
        rank = dist.get_rank()
        pp_rank, dp_rank, ep_rank = mesh_coords(rank, pp, dp, ep)
        g = ParallelGroups(rank, world, pp, dp, ep, pp_rank, dp_rank, ep_rank)

        def coord(p: int, d: int, e: int) -> int:
            return (p * dp + d) * ep + e

        # new_group must be called by every rank for every group, in the same order.
        for d in range(dp):
            for e in range(ep):
                ranks = [coord(p, d, e) for p in range(pp)]
                grp = self.new_group(ranks)
                if rank in ranks:
                    g.pp_group, g.pp_ranks = grp, ranks
        for p in range(pp):
            for e in range(ep):
                ranks = [coord(p, d, e) for d in range(dp)]
                grp = self.new_group(ranks)
                if rank in ranks:
                    g.dp_group, g.dp_ranks = grp, ranks
        for p in range(pp):
            for d in range(dp):
                ranks = [coord(p, d, e) for e in range(ep)]
                grp = self.new_group(ranks)
                if rank in ranks:
                    g.ep_group, g.ep_ranks = grp, ranks
        for p in range(pp):
            ranks = [coord(p, d, e) for d in range(dp) for e in range(ep)]
            grp = self.new_group(ranks)
            if rank in ranks:
                g.replica_group, g.replica_ranks = grp, ranks
        self._groups = g
        # Every rank is here, at setup, before any schedule: the place for collective setup of
        # the expert transport (NVSHMEM allocation spans the whole job).
        self.setup_expert_transport(g.ep_group)
        return g

    # ------------------------------------------------------- streams and events
    def compute_stream(self) -> Any:
        return self.device_module().current_stream()

    @abstractmethod
    def comm_stream(self) -> Any:
        """The stream communication is issued on, so it can run beside compute."""

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager that makes ``stream`` current."""
        return self.device_module().stream(stream)

    @abstractmethod
    def event(self, enable_timing: bool = False) -> Any:
        """A recordable event on this device."""

    def synchronize(self) -> None:
        self.device_module().synchronize()

    # ------------------------------------------------------------ host copies
    def copy_stream(self) -> Any:
        """The stream host <-> device copies (offload) run on: one of its own beside compute where
        ``capabilities.host_copies`` is ``async``; here, the compute stream."""
        return self.compute_stream()

    def host_buffer(self, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """A flat host buffer (uninitialised) for copies with tensors on ``device`` (default this
        backend's): page-locked where ``device`` is a device, which an asynchronous copy needs;
        plain memory where it is the host itself."""
        device = self.device() if device is None else device
        return torch.empty(numel, dtype=dtype, pin_memory=device.type != "cpu")

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy ``src`` into ``dst`` (host to device, device to host, or host to host) on
        :meth:`copy_stream`, after the work issued so far on the current stream (which made
        ``src``, or last read ``dst``); returns an event recorded after the copy. The allocator is
        told the copy stream uses both tensors, so a caller may drop them at once."""
        stream = self.copy_stream()
        issued = self.event()
        issued.record()
        stream.wait_event(issued)
        with self.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = self.event()
            done.record(stream)
        for t in (dst, src):
            if t.device.type != "cpu":
                t.record_stream(stream)
        return done

    def wait_copy(self, done: Any) -> None:
        """Work issued on the current stream from now on runs after the copy that recorded ``done``."""
        self.compute_stream().wait_event(done)

    # ------------------------------------------------------------ communication
    def batch_isend_irecv(self, ops: Sequence[dist.P2POp]) -> list[Any]:
        """Post a batch of point-to-point sends/receives; returns their work handles, one per
        operation (a batch the process group coalesces completes as one: :mod:`.p2p_works`)."""
        if not ops:
            return []
        return per_op(dist.batch_isend_irecv(list(ops)), len(ops))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Exchange rows of ``input`` among the group; uneven splits allowed."""
        return dist.all_to_all_single(
            output,
            input,
            output_split_sizes=None if output_split_sizes is None else list(output_split_sizes),
            input_split_sizes=None if input_split_sizes is None else list(input_split_sizes),
            group=group,
            async_op=async_op,
        )

    def setup_expert_transport(self, group: Any = None) -> None:
        """Prepare the expert transport of ``group`` (None: the world). Collective over the whole
        job: every rank calls it at the same point of setup (``parallel_groups`` does)."""

    def expert_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        """The expert-parallel dispatch/combine transport; all-to-all unless a device offers better."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        """``tensor`` reduced over the group in place; ``op``: any of :data:`REDUCE_OPS`."""
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        return dist.all_gather(tensors, tensor, group=group, async_op=async_op)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        """``output`` (1/n of ``input``) = this rank's equal slice of ``input`` reduced over the group.

        ``input.numel()`` must be ``n * output.numel()`` for the group's size n; slice i goes to
        the group's i-th rank (the distributed optimizer's shards). ``op``: any of :data:`REDUCE_OPS`.
        """
        return tensor_collective("reduce_scatter")(output, input, op=op, group=group, async_op=async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        """``output`` = every rank's ``input`` concatenated in group-rank order (``n * input.numel()``)."""
        return tensor_collective("all_gather")(output, input, group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)

    def barrier(self, group: Any = None) -> None:
        dist.barrier(group=group)

    # ------------------------------------------------------------------ kernels
    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Grouped matmul with the semantics of ``torch.nn.functional.grouped_mm``.

        2d x 3d: ``a[T, K]`` rows grouped by ``offs`` (cumulative end rows), ``b[G, K, N]``
        -> ``[T, N]``. 2d x 2d: ``a[M, T]`` and ``b[T, N]`` grouped along T -> ``[G, M, N]``
        (the weight gradient). Uses the fused kernel where the dtype allows, else a loop.
        """
        return grouped_mm_reference(a, b, offs)

    def fp8_mm(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``a @ b`` of E4M3 operands with DeepSeek-style scales (1x128 tiles of ``a``; 128x128
        blocks or 128x1 tiles of ``b``), rounded to ``out_dtype``: the reference semantics of
        :mod:`portapipe.backends.fp8_mm`, computed where the operands are, or on the host where
        this backend does not compute in float64 (the exact block sums need it)."""
        if a.device.type == "cpu" or "float64" in self.capabilities.compute_dtypes:
            return fp8_mm_emulated(a, a_scale, b, b_scale, out_dtype)
        return fp8_mm_emulated(a.cpu(), a_scale.cpu(), b.cpu(), b_scale.cpu(), out_dtype).to(a.device)

    def fp8_path(self) -> str:
        """Which FP8 matmul :meth:`fp8_mm` runs here (``portapipe info``): the declaration, and
        where the emulation runs."""
        kind = self.capabilities.fp8_matmul
        if kind == "emulated" and "float64" not in self.capabilities.compute_dtypes:
            return "emulated on the host (the device computes no float64, which the exact block sums need)"
        return kind

    def fp8_grouped_mm(
        self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The grouped forms of :meth:`fp8_mm` (2d x 3d: rows by ``offs``; 2d x 2d: the weight
        gradient, grouped along the contracted rows; see :mod:`portapipe.backends.fp8_mm`): one
        :meth:`fp8_mm` per group, so a device's dense kernel serves the experts too."""
        return fp8_grouped_mm_emulated(a, a_scale, b, b_scale, offs, out_dtype, mm=self.fp8_mm)

    # ------------------------------------------------------------------- memory
    def memory_allocated(self) -> int | None:
        """Bytes held by the device allocator now; None where the device has no allocator stats."""
        return None

    def max_memory_allocated(self) -> int | None:
        return None

    def reset_peak_memory_stats(self) -> None:
        return None

    # ------------------------------------------------------------------- timers
    def timer(self) -> Timer:
        return Timer()

    @contextlib.contextmanager
    def timed(self) -> Iterator[Timer]:
        t = self.timer()
        t.start()
        try:
            yield t
        finally:
            t.stop()

    def profiler(self, memory: bool = False) -> Any:
        """A torch.profiler run over this device's activities (:meth:`profiler_activities`): enter
        and leave it around the profiled work, then ``export_chrome_trace(path)`` (``.gz``: gzipped)."""
        import torch.profiler

        return torch.profiler.profile(activities=self.profiler_activities(), profile_memory=memory, record_shapes=memory)

    def export_profile(self, prof: Any, path: str) -> None:
        """A finished :meth:`profiler` run's Chrome trace into ``path`` (``.json.gz``: gzipped)."""
        prof.export_chrome_trace(path)  # torch.profiler gzips a .gz path itself

    def profiler_activities(self) -> list[Any]:
        """What torch.profiler records here: the host's operators."""
        import torch.profiler

        return [torch.profiler.ProfilerActivity.CPU]

    def span_clock(self) -> SpanClock:
        """The clock a recorded step's spans are taken with (``capabilities.timer``): the host's here."""
        return SpanClock()

    # ---------------------------------------------------------------------- RNG
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "available": self.is_available(),
            "device_count": self.device_count(),
            "ep_transport": self.ep_transport,
            "capabilities": self.capabilities.as_dict(),
        }
