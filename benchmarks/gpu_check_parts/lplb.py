"""Part h: LPLB's Triton kernels on one layer (ep 8, 64 experts, cube, 4,096 tokens x top 8)
against the CPU path: the same answer, and the time per layer."""

from __future__ import annotations

import statistics

from .common import Ctx, Record, cuda_reason


def part_lplb(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends import get_backend
    from portapipe.balancing.lplb import Planner
    from portapipe.balancing.topology import cube

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    ep, experts, top_k = 8, 64, 8
    tokens = 4096 if not ctx.dry else 256
    r2o = cube()
    classes = int(r2o.shape[1])
    physical = experts + classes * ep
    g = torch.Generator().manual_seed(7)
    idx = torch.multinomial(torch.softmax(torch.randn(experts, generator=g) * 2, 0).expand(tokens, experts), top_k, generator=g).int()
    workload = torch.bincount(idx.flatten().long(), minlength=experts)
    cpu = Planner(r2o, physical, experts, ep_size=ep, use_triton=False)
    cpu.update_placement(workload)
    want = cpu.run(idx)
    rec.put("problem", {"ep": ep, "experts": experts, "physical": physical, "topology": "cube", "tokens": tokens, "top_k": top_k})
    be = get_backend(device)
    from portapipe.balancing import lplb_triton

    why = lplb_triton.why_unavailable(be.device())
    rec.put("triton", why or "available")
    dev = Planner(r2o, physical, experts, ep_size=ep, use_triton=not why)
    dev.update_placement(workload)  # the placement is planned from recorded loads, as in training
    on_device = idx.to(be.device())
    got = dev.run(on_device)  # the first call compiles the kernels
    equal = bool(torch.equal(got.cpu(), want))
    times = []
    for _ in range(3 if ctx.dry else 50):
        with be.timed() as timer:
            dev.run(on_device)
        times.append(timer.elapsed_s)
    us = statistics.median(times[1:] if len(times) > 1 else times) * 1e6
    rec.put("result", {"equal_to_cpu_path": equal, "paths": dev._paths_on.get(be.device()) if hasattr(dev, "_paths_on") else None,
                       "layer_us_median": us, "published_us": 100})
    rec["summary"] = f"{'equal' if equal else 'DIFFERS'} to the CPU path; {us:.0f} us per layer ({'triton' if not why else 'torch'})"
    if not equal:
        rec["status"] = "failed"
    elif device == "cuda" and not why:
        rec["status"] = "ok"
    else:
        rec.update(status="dry" if ctx.dry else "skipped", reason=reason or why or "dry mode")

