"""What a backend can do, declared once per backend class and read by everyone else.

Config validation and the rules table (:mod:`portapipe.config.rules`), the planner, ``portapipe
verify`` and ``portapipe info`` read a backend's :class:`Capabilities` through its class
(``registry.backend_class(name).capabilities``); none of them names a device. The conformance
kit (:mod:`portapipe.testing`) checks that a backend behaves as it declares.

Dtypes are named as the config names them (``float32``, ``bfloat16``...), so a declaration is
read without touching a device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: dtype names a declaration may use (the names of torch's dtypes)
DTYPE_NAMES = ("float64", "float32", "bfloat16", "float16")
#: the transport every backend offers for expert dispatch / combine
ALLTOALL = "alltoall"
#: how a backend may run the FP8 matmul (``Capabilities.fp8_matmul``)
FP8_MATMUL_KINDS = ("blockwise", "emulated", "none")
#: how a backend copies between host and device memory for offload (``Capabilities.host_copies``)
HOST_COPY_KINDS = ("async", "sync", "none")


@dataclass(frozen=True)
class Capabilities:
    """One backend class's declaration (see docs/backends.md, "writing a backend").

    ``compute_dtypes``: dtypes the device's matmul computes in (a model may use them).
    ``reduce_dtypes``: dtypes its reducing collectives take (all-reduce, reduce-scatter).
    ``move_dtypes``: dtypes its moving collectives take (all-to-all, all-gather, broadcast, p2p).
    ``ep_transports``: expert-parallel transports, ``alltoall`` first (every backend has it).
    ``fused_grouped_mm_dtypes``: dtypes a fused grouped-matmul kernel takes (others loop over
    groups); ``grouped_mm_max_groups``: groups one fused call takes (None: no limit).
    ``reduce_scatter`` / ``all_gather_into_tensor``: the distributed optimizer's pair runs.
    ``matches_cpu_float64``: float64 results here are the CPU's bit for bit (the same kernels),
    so a float64 pipelined step is verified exactly against the CPU reference; a device with float64
    kernels of its own is verified in float32 against it, within a tolerance (portapipe verify).
    ``fp8_matmul``: how the backend runs the FP8 matmul of ``train.fp8`` (``fp8_mm`` /
    ``fp8_grouped_mm``): ``blockwise`` (a device kernel with DeepSeek-style 1x128 / 128x128
    scaling where the device and torch have it, else the emulation), ``emulated`` (the reference
    semantics, :mod:`portapipe.backends.fp8_mm`), ``none`` (``train.fp8`` is refused).
    ``fused_attention_unequal_heads``: torch's fused attention runs a value head width other than
    the query / key's (MLA's); without it such an attention runs torch's math path, which keeps
    the attention probabilities for the backward (the planner's memory model follows).
    ``streams``: communication runs on its own stream beside compute (False: no-op streams,
    overlap comes from async work handles). ``memory_stats``: an allocator reports
    allocated / peak bytes. ``timer``: ``events`` (device time) or ``wall`` (host clock).
    ``host_copies``: how host <-> device copies run (``train.optimizer_offload``, ``memory.offload``):
    ``async`` (page-locked host buffers, copies on a copy stream of their own beside compute,
    ordered by events), ``sync`` (in order with the compute: the CPU, whose device is the host,
    copies between separate buffers), ``none`` (offload is refused).
    """

    dist_backend: str
    compute_dtypes: tuple[str, ...]
    reduce_dtypes: tuple[str, ...]
    move_dtypes: tuple[str, ...]
    ep_transports: tuple[str, ...] = (ALLTOALL,)
    fused_grouped_mm_dtypes: tuple[str, ...] = ()
    grouped_mm_max_groups: int | None = None
    reduce_scatter: bool = True
    all_gather_into_tensor: bool = True
    matches_cpu_float64: bool = False
    fp8_matmul: str = "none"
    fused_attention_unequal_heads: bool = False
    streams: bool = False
    memory_stats: bool = False
    timer: str = "wall"
    host_copies: str = "none"

    def problems(self) -> list[str]:
        """What is wrong with the declaration itself (the conformance kit's first line)."""
        out = []
        for key in ("compute_dtypes", "reduce_dtypes", "move_dtypes", "fused_grouped_mm_dtypes"):
            unknown = [d for d in getattr(self, key) if d not in DTYPE_NAMES]
            if unknown:
                out.append(f"capabilities.{key}: {', '.join(unknown)} not among {', '.join(DTYPE_NAMES)}")
        if not self.compute_dtypes or "float32" not in self.compute_dtypes:
            out.append("capabilities.compute_dtypes: must include float32 (portapipe's default model dtype)")
        missing = [d for d in self.compute_dtypes if d not in self.move_dtypes]
        if missing:
            out.append(f"capabilities.move_dtypes: lacks {', '.join(missing)}, which the model computes in (activations travel between stages)")
        if not self.ep_transports or self.ep_transports[0] != ALLTOALL:
            out.append(f"capabilities.ep_transports: {list(self.ep_transports)} must start with {ALLTOALL!r}")
        extra = [d for d in self.fused_grouped_mm_dtypes if d not in self.compute_dtypes]
        if extra:
            out.append(f"capabilities.fused_grouped_mm_dtypes: {', '.join(extra)} not in compute_dtypes")
        if self.grouped_mm_max_groups is not None and self.grouped_mm_max_groups < 1:
            out.append(f"capabilities.grouped_mm_max_groups: {self.grouped_mm_max_groups} < 1")
        if self.fp8_matmul not in FP8_MATMUL_KINDS:
            out.append(f"capabilities.fp8_matmul: {self.fp8_matmul!r} is not one of {', '.join(FP8_MATMUL_KINDS)}")
        if self.timer not in ("events", "wall"):
            out.append(f"capabilities.timer: {self.timer!r} is not one of events, wall")
        if self.host_copies not in HOST_COPY_KINDS:
            out.append(f"capabilities.host_copies: {self.host_copies!r} is not one of {', '.join(HOST_COPY_KINDS)}")
        return out

    def full_precision(self, dtype: str) -> bool:
        """Whether a model in ``dtype`` computes, reduces and moves in it on this backend."""
        return all(dtype in d for d in (self.compute_dtypes, self.reduce_dtypes, self.move_dtypes))

    @property
    def widest_reduce_dtype(self) -> str:
        """float64 where the backend reduces it, else float32: for sums that must stay exact
        (per-micro-batch losses of which one rank holds each, flags)."""
        return "float64" if "float64" in self.reduce_dtypes else "float32"

    def transport_problem(self, backend: str, transport: Any) -> str | None:
        """The one message for an expert transport this backend does not offer, or None."""
        if transport in self.ep_transports:
            return None
        return (
            f"backend_options.ep_transport: {transport!r} is not a transport of backend {backend!r} "
            f"(its transports: {', '.join(self.ep_transports)}); use {ALLTOALL}, which every backend has"
        )

    def fp8_problem(self, backend: str) -> str | None:
        """The message for ``train.fp8`` on a backend without an FP8 matmul, or None."""
        if self.fp8_matmul != "none":
            return None
        return (f"train.fp8: backend {backend!r} declares no FP8 matmul (capabilities.fp8_matmul: none); "
                "use a backend that has one (cpu and npu emulate it, cuda runs it blockwise), or train.fp8: off")

    def offload_problem(self, backend: str, key: str) -> str | None:
        """The message for an offload option (``key``, e.g. ``train.optimizer_offload``) on a
        backend that declares no host copies, or None."""
        if self.host_copies != "none":
            return None
        return (f"{key}: backend {backend!r} declares no host copies (capabilities.host_copies: none); "
                "use a backend that has them (cpu, cuda, npu) or turn the offload off")

    def dtype_problem(self, backend: str, dtype: str) -> str | None:
        """The message for a model dtype this backend does not compute in, or None."""
        if dtype in self.compute_dtypes:
            return None
        return f"model.dtype: {dtype} is not computed by backend {backend!r} (it computes in {', '.join(self.compute_dtypes)})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``portapipe info``)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
