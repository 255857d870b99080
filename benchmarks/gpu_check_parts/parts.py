"""The GPU check's parts, in the order `--parts all` runs them, with their time caps, and the two
calls of a run on one GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .common import Ctx, Record
from .correctness import part_verify
from .env import part_env
from .fp8 import part_fp8
from .grouped_mm import part_grouped_mm
from .lplb import part_lplb
from .memory import part_memory
from .offload import part_offload
from .portability import part_portability
from .speed import part_speed
from .step_claims import part_step_claims
from .suite import part_suite
from .timeline import part_timeline

#: the two commands of a run on one GPU (docs/gpu.md), each about 6 minutes: the caps of call 1
#: add up to 375 s, those of call 2 to 375 s; within a call the parts run in this order, and the
#: last of each (the suite, cut off counted from pytest's progress; the step claims, each run
#: recorded as it ends) takes whatever the others left of the command's --budget-s
CALLS = {"1": "a,f,h,j,k,l,b", "2": "c,e,d,g,i"}


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    run: Callable[[Record, Ctx], None]
    cap_s: float  # on the GPU machine
    cap_dry_s: float  # in the dry mode


PARTS = [
    Part("a", "environment", part_env, 30, 60),
    Part("b", "the suite, cuda tests, conformance kit", part_suite, 125, 120),  # open-ended: it takes what call 1 leaves
    Part("c", "verify: every schedule on the GPU", part_verify, 90, 120),
    Part("d", "portability CPU <-> CUDA, bf16 vs float32", part_portability, 100, 300),  # dry: four CPU legs, 35-50 s each on a loaded 2-core machine
    Part("e", "speed: tokens/s, MFU, vs transformers", part_speed, 100, 120),
    Part("f", "grouped matmul vs dense", part_grouped_mm, 25, 60),
    Part("g", "allocator peak vs memory model", part_memory, 25, 90),
    Part("h", "LPLB Triton kernels", part_lplb, 15, 60),
    Part("i", "step_vs_torch, balance_e2e, a core set per rank", part_step_claims, 60, 150),
    Part("j", "FP8: blockwise GEMM vs bf16, against the emulation, the FP8 step vs bf16", part_fp8, 80, 120),
    Part("k", "timeline: a DualPipeV step recorded on the GPU, checked", part_timeline, 60, 120),
    Part("l", "offload: host link, copy overlap, an offloaded step", part_offload, 40, 120),
]
BY_KEY = {p.key: p for p in PARTS}
