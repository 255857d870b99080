"""Part f: the experts' grouped matmul (``backend.grouped_mm``) forward and backward against one
dense matmul of the same FLOPs, at MoE shapes."""

from __future__ import annotations

import time
from typing import Any

from .common import Ctx, Record, cuda_reason, device_time
from .speed import SPEED_MODELS, speed_raw


def part_grouped_mm(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends import get_backend

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    be = get_backend(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    e_model = speed_raw(SPEED_MODELS[0], "cuda", False)["model"]
    shapes = [(7168, 2048, "DeepSeek-V3"), (e_model["hidden"], e_model["moe_hidden"], "part e's model"), (2048, 768, "published anchor")]
    per_expert = (256, 1024, 4096) if not ctx.dry else (8, 16)
    groups = 8 if not ctx.dry else 2
    reps = 10 if not ctx.dry else 2
    rows = []
    for k, n, label in shapes:
        for t in per_expert + ((2048,) if label == "published anchor" and not ctx.dry else ()):
            if ctx.dry:
                k, n = 32, 16
            rows.append(_gmm_row(be, dtype, groups, t, k, n, label, reps))
            rec.put("rows", rows)
            if time.time() > ctx.deadline - 5:
                break
    rec["summary"] = "; ".join(f"{r['label']} {r['tokens_per_expert']}/e: {r['grouped_tflops']:.0f} vs dense {r['dense_tflops']:.0f} TFLOP/s"
                               for r in rows if r["tokens_per_expert"] in (1024, 2048) or ctx.dry)[:300]
    rec["status"] = "ok" if device == "cuda" else ("dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"


def _gmm_row(be: Any, dtype: Any, groups: int, t: int, k: int, n: int, label: str, reps: int) -> dict[str, Any]:
    """Forward + backward of ``groups`` experts of [k, n] on ``t`` rows each, grouped and dense (one
    [groups*t, k] x [k, n] matmul: the same FLOPs), TFLOP/s by the device's timer."""
    import torch

    dev = be.device()
    rows = groups * t
    a = torch.randn(rows, k, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(groups, k, n, device=dev, dtype=dtype, requires_grad=True)
    dense_w = torch.randn(k, n, device=dev, dtype=dtype, requires_grad=True)
    offs = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * t
    grad = torch.randn(rows, n, device=dev, dtype=dtype)

    def grouped() -> None:
        be.grouped_mm(a, w, offs).backward(grad)

    def dense() -> None:
        (a @ dense_w).backward(grad)

    flops = 6.0 * rows * k * n  # forward 2 x rows x k x n, backward twice that (input and weight gradients)
    g_s, d_s = device_time(be, grouped, reps), device_time(be, dense, reps)
    return {"label": label, "tokens_per_expert": t, "groups": groups, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."),
            "fused": bool(getattr(be, "grouped_mm_fused", lambda *_: False)(a, w)),
            "grouped_s": g_s, "dense_s": d_s, "grouped_tflops": flops / g_s / 1e12, "dense_tflops": flops / d_s / 1e12,
            "grouped_over_dense": d_s / g_s}

