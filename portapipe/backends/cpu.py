"""CPU backend on gloo: the embedded default, runs everywhere, used by the test suite.

gloo supports ``all_to_all_single`` with uneven splits, batched p2p, all-reduce and all-gather,
so every schedule and balancer path runs for real here. Streams and events are torch.cpu's
working no-ops; communication overlaps compute through gloo's async work handles (gloo runs
each collective on its own thread). Offload's host copies run the device backends' path with
those no-op streams: a copy between two separate host buffers, in order.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

from .base import Backend
from .capabilities import Capabilities
from .grouped_mm import (
    CPU_GROUPED_MM_DTYPES,
    _fused_grouped_mm,
    cut_rows_past_end,
    fused_offs,
    grouped_mm_fused_ok,
    grouped_mm_reference,
    zero_rows_past_end,
)


class CPUBackend(Backend):
    name = "cpu"
    option_keys = frozenset({"ep_transport"})
    device_type = "cpu"
    dist_backend = "gloo"
    install_hint = "The CPU backend needs only torch."
    # gloo reduces and moves every floating dtype torch has; the conformance kit checks each.
    capabilities = Capabilities(
        dist_backend="gloo",
        compute_dtypes=("float64", "float32", "bfloat16", "float16"),
        reduce_dtypes=("float64", "float32", "bfloat16", "float16"),
        move_dtypes=("float64", "float32", "bfloat16", "float16"),
        fused_grouped_mm_dtypes=tuple(str(d).removeprefix("torch.") for d in CPU_GROUPED_MM_DTYPES),
        matches_cpu_float64=True,  # it is the CPU: verify's float64 claim is exact
        fp8_matmul="emulated",  # no FP8 matmul in torch's CPU kernels for DeepSeek's blockwise scaling
        streams=False,  # torch.cpu.Stream is a working no-op; gloo's async handles overlap instead
        memory_stats=False,  # no allocator figures; max_memory_allocated is the process's peak RSS
        timer="wall",
        host_copies="sync",  # the device is the host: a copy between separate buffers, in order
    )

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def device_count(cls) -> int:
        return os.cpu_count() or 1

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    def comm_stream(self) -> Any:
        # torch.cpu.Stream is a no-op stream: code written for device streams runs unchanged.
        return torch.cpu.Stream()

    def event(self, enable_timing: bool = False) -> Any:
        return torch.cpu.Event()  # takes no arguments; timing on CPU is wall clock

    def synchronize(self) -> None:
        return None

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if grouped_mm_fused_ok(a, b):
            if b.dim() == 3:
                a = cut_rows_past_end(a, offs)
            out = _fused_grouped_mm()(a, b, offs=fused_offs(offs, a.device))
            # 2d x 2d: torch's CPU path writes every group (an empty one as zeros).
            return zero_rows_past_end(out, offs) if b.dim() == 3 else out
        return grouped_mm_reference(a, b, offs)

    def max_memory_allocated(self) -> int | None:
        """Peak resident set size of this process (the closest CPU analogue of an allocator peak)."""
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
