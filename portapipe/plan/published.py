"""Profiles built from published figures, for devices this machine does not have.

``portapipe profile CONFIG --published h800`` writes one for the config's model shape. Each part's
time is its FLOPs (or bytes moved) at an assumed share of the device's peak, each exchange
latency plus bytes over the published bandwidth. Figures and sources (see docs/plan.md):

H800 SXM5 (80 GB HBM3), NVIDIA's Hopper datasheet (H100 SXM5, which the H800 matches in compute):
  989.5 TFLOPS dense BF16 and 1,979 TFLOPS dense FP8 tensor throughput, 3.35 TB/s HBM3.
DeepEP's published measurements on H800 (github.com/deepseek-ai/DeepEP, docs/legacy.md, "normal
kernels", DeepSeek-V3 pre-training setting: 4096 tokens per batch, hidden 7168, top-8):
  NVLink ~160 GB/s; CX7 InfiniBand ~50 GB/s per GPU; dispatch bottleneck bandwidth 153 GB/s
  (EP 8, NVLink), 43 GB/s (EP 16), 58 GB/s (EP 32), 51 GB/s (EP 64, RDMA).
NVIDIA's H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100, "Interconnect"): PCIe Gen5
  128 GB/s for the SXM5 part, both directions together: 64 GB/s each way; the H800 SXM5 differs
  from it in NVLink (400 GB/s) and FP64, not in its PCIe Gen5 x16 host link (offload's copies).
DeepSeek-V3 technical report (arXiv 2412.19437): 2048 H800 GPUs, 8 per node (NVLink/NVSwitch),
  InfiniBand between nodes; 2.664M H800 GPU hours of pre-training for 14.8T tokens, i.e. about
  1540 tokens per GPU-second (checked against the plan's prediction in docs/plan.md).

Assumptions (not published; stated so they can be changed): host copies (page-locked memory, a
copy stream of their own beside compute) at 80% of the host link's 64 GB/s each way with 10 us
per copy; matrix work at 45% of the BF16 peak
(FP8 GEMMs, under ``train.fp8``, at 45% of the FP8 peak; quantizing their operands is memory
traffic: :func:`~portapipe.plan.shape.quantize_bytes`, the weights' 128x128 blocks at each use
as a fixed cost of the part), data movement at 70% of HBM bandwidth, 10 us fixed cost per part (kernel launches), 20 us
all-to-all and 10 us point-to-point latency, 25 us of host work per executor action, EP groups
beyond 64 ranks at the EP 64 bandwidth.
"""

from __future__ import annotations

from typing import Any

from .profile import FORMAT, Profile
from .shape import PARTS, PHASES, Shape, flops, fp8_flops, quantize_bytes, weight_quantize_bytes

H800: dict[str, Any] = {
    "name": "NVIDIA H800 SXM5 80GB (published figures)",
    "memory_bytes": 80 * 10**9,
    "bf16_flops": 989.5e12,
    "fp8_flops": 1979e12,
    "hbm_bytes_s": 3.35e12,
    "ib_bytes_s": 50e9,
    "pcie_bytes_s": 64e9,  # each way (128 GB/s both together)
    "pcie_efficiency": 0.80,
    "copy_latency_s": 10e-6,
    "a2a_bytes_s": {8: 153e9, 16: 43e9, 32: 58e9, 64: 51e9, 128: 51e9, 256: 51e9},
    "matmul_efficiency": 0.45,
    "memory_efficiency": 0.70,
    "part_fixed_s": 10e-6,
    "a2a_latency_s": 20e-6,
    "p2p_latency_s": 10e-6,
    "action_s": 25e-6,
}
DEVICES = {"h800": H800}
MOVES_DATA = ("embed", "combine")


def published(device: str, shape: Shape) -> Profile:
    """A profile of ``device`` (``h800``) for the model ``shape``, from the figures above."""
    if device not in DEVICES:
        raise ValueError(f"--published: unknown device {device!r}; known: {', '.join(DEVICES)}")
    d = DEVICES[device]
    compute = d["bf16_flops"] * d["matmul_efficiency"]
    compute_fp8 = d["fp8_flops"] * d["matmul_efficiency"]
    memory = d["hbm_bytes_s"] * d["memory_efficiency"]

    def cost(part: str, phase: str, extra_bytes: float = 0.0) -> dict[str, float]:
        work = flops(shape, part, phase)
        if work == 0 and extra_bytes == 0:
            return {"fixed": 0.0, "per_unit": 0.0}
        if part in MOVES_DATA:
            return {"fixed": d["part_fixed_s"], "per_unit": (work + extra_bytes) / memory}
        fp8 = fp8_flops(shape, part, phase)  # zero without train.fp8
        per = (work - fp8) / compute + fp8 / compute_fp8 + (extra_bytes + quantize_bytes(shape, part, phase)) / memory
        return {"fixed": d["part_fixed_s"] + weight_quantize_bytes(shape, part, phase) / memory, "per_unit": per}

    off = {part: {phase: cost(part, phase) for phase in PHASES} for part in PARTS}
    # level1 recomputes the activation (element-wise, on the gate/up output) in the backward
    level1 = {part: dict(phases) for part, phases in off.items()}
    level1["experts"]["B"] = cost("experts", "B", 3 * shape.moe_hidden * shape.e)
    level1["shared"]["B"] = cost("shared", "B", 3 * shape.shared_width * shape.e)
    e = shape.e
    return Profile.from_dict({
        "format": FORMAT,
        "device": {"backend": "cuda", "name": d["name"], "count": 8, "memory_bytes": d["memory_bytes"]},
        "torch": "n/a (published figures)",
        "shape": shape.to_dict(),
        "parts": {"off": off, "level0": off, "level1": level1},
        "a2a": {str(n): {"fixed": d["a2a_latency_s"], "per_unit": 1.0 / bw} for n, bw in d["a2a_bytes_s"].items()},
        "p2p": {"fixed": d["p2p_latency_s"], "per_unit": 1.0 / d["ib_bytes_s"]},
        # ring all-reduce over InfiniBand; the fit is stored at n = 2, where it moves the bytes once
        "allreduce": {"2": {"fixed": d["a2a_latency_s"], "per_unit": 1.0 / d["ib_bytes_s"]}},
        # AdamW reads parameter, gradient and both moments and writes three of them back
        "optimizer": {"fixed": 0.0, "per_unit": 7 * e / memory},
        "action_s": d["action_s"],
        "processors": None,
        "host_link": {way: {"fixed": d["copy_latency_s"], "per_unit": 1.0 / (d["pcie_bytes_s"] * d["pcie_efficiency"])} for way in ("h2d", "d2h")},
        "host_overlap": True,
        "source": f"published figures for {d['name']} (see portapipe/plan/published.py and docs/plan.md)",
    })
