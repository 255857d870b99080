"""Part k: offload on a GPU. The host link as the backend's offload copies run it (page-locked
buffers, the copy stream): H2D and D2H bandwidth against the h800 profile's published figure;
how much of the copies a compute on the compute stream hides (the two alone, then together);
and one step with ``memory.offload`` and ``train.optimizer_offload`` against the same step
without: the same loss and gradients bit for bit, the allocator's peak lower by what the
planner's memory model says, and the step's time."""

from __future__ import annotations

import time
from typing import Any

from .common import Ctx, Record, cuda_reason, one_rank_runtime
from .memory import memory_raw


def _copies(be: Any, nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of the backend's copies each way (the best of ``reps``), one buffer of ``nbytes``."""
    import torch

    host = be.host_buffer(nbytes, torch.uint8).fill_(1)
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=be.device())
    out = {}
    for way, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        best = float("inf")
        for _ in range(reps + 1):
            be.synchronize()
            t0 = time.perf_counter()
            be.copy_async(dst, src).synchronize()
            best = min(best, time.perf_counter() - t0)
        out[f"{way}_gb_s"] = nbytes / best / 1e9
    out["pinned"] = bool(host.is_pinned()) if host.device.type == "cpu" and be.device().type != "cpu" else False
    return out


def _overlap(be: Any, nbytes: int, size: int, reps: int) -> dict[str, float]:
    """Seconds of a copy each way, of a matmul loop, and of both at once (the copies on their
    stream); hidden: the share of the shorter the overlap saved."""
    import torch

    host = be.host_buffer(nbytes, torch.uint8).fill_(1)
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=be.device())
    back = be.host_buffer(nbytes, torch.uint8)
    a = torch.randn(size, size, device=be.device())

    def compute() -> None:
        x = a
        for _ in range(reps):
            x = torch.tanh(x @ a)

    def copies() -> Any:
        be.copy_async(dev, host)
        return be.copy_async(back, dev)

    def timed(fn: Any) -> float:
        be.synchronize()
        t0 = time.perf_counter()
        done = fn()
        if done is not None:
            done.synchronize()
        be.synchronize()
        return time.perf_counter() - t0

    timed(compute), timed(copies)  # warm
    alone_c, alone_x = timed(compute), timed(copies)

    def both() -> Any:
        done = copies()
        compute()
        return done

    together = timed(both)
    saved = alone_c + alone_x - together
    return {"compute_s": alone_c, "copies_s": alone_x, "together_s": together,
            "hidden_frac": max(0.0, min(1.0, saved / min(alone_c, alone_x))) if min(alone_c, alone_x) > 0 else 0.0}


def offload_rank(backend: Any, raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One optimizer step (after one to warm) of each config: its loss, its gradients, the allocator's peak, its time."""
    from portapipe.config import config_from_dict
    from portapipe.training.update import make_sharded_optimizer

    out = {}
    for name, raw in raws.items():
        be, rt, mbs = one_rank_runtime(backend, raw)
        opt = make_sharded_optimizer(rt, config_from_dict(raw), be)
        opt.lr = 1e-3
        times, losses = [], []
        for i in range(3):
            be.synchronize()
            if i == 2:
                be.reset_peak_memory_stats()
            t0 = time.perf_counter()
            result = rt.step(mbs)
            grads = {n: g.detach().cpu().clone() for n, g in rt.grads.full_grads().items()} if i == 2 else None
            opt.step()
            rt.grads.zero_grad()
            be.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(result.loss)
        out[name] = {"losses": losses, "step_s": times[-1], "allocator_peak": be.max_memory_allocated(), "optimizer_bytes": opt.memory(),
                     "grads": [grads[q] for q in rt.parameters()], "sent_bytes": result.timings.get("offload_sent_bytes", 0.0)}
        del rt, opt
    return out


def part_offload(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends.registry import backend_class
    from portapipe.config import load_config
    from portapipe.config.setup import Setup
    from portapipe.plan.memory_model import MemoryModel
    from portapipe.plan.published import H800
    from portapipe.ranks.launch import run_ranks
    from portapipe.scheduling.runnable import build_schedule

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    be = backend_class(device)()
    nbytes, reps = (1 << 20, 2) if ctx.dry else (256 << 20, 5)
    link = _copies(be, nbytes, reps)
    link["published_each_way_gb_s"] = H800["pcie_bytes_s"] / 1e9
    link["profile_each_way_gb_s"] = H800["pcie_bytes_s"] * H800["pcie_efficiency"] / 1e9
    rec.put("host_link", link)
    rec.put("overlap", _overlap(be, nbytes, 256 if ctx.dry else 4096, 4 if ctx.dry else 40))
    raws = {"off": memory_raw(device, ctx.dry, {})}
    raws["offload"] = {**raws["off"], "memory": {"offload": ["attention", "dense", "shared", "experts"]},
                       "train": {**raws["off"]["train"], "optimizer_offload": "swap"}}
    for raw in raws.values():
        raw["model"] = {**raw["model"], "dtype": "bfloat16"}  # float32 master weights apart: they travel too
        # buckets well below the states, so that two of them on the device are a small part of them
        raw["train"] = {**raw["train"], "grad_bucket_mb": 0.01 if ctx.dry else 4.0}
    got = run_ranks(offload_rank, 1, raws, backend=device, wall_timeout_s=ctx.left())[0]
    model = {}
    for name, raw in raws.items():
        config = load_config(raw)
        r = MemoryModel(Setup.from_config(config), build_schedule(config)).report().ranks[0]
        model[name] = r.static + max(r.held_peak, r.post)
    a, b = got["off"], got["offload"]
    exact = a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    step = {"exact": exact, "losses": [a["losses"], b["losses"]], "sent_bytes": b["sent_bytes"],
            "optimizer_bytes": {"off": a["optimizer_bytes"], "offload": b["optimizer_bytes"]},
            "step_s": {"off": a["step_s"], "offload": b["step_s"]}, "model_peak": model}
    if a["allocator_peak"]:
        step["allocator_fall"] = a["allocator_peak"] - b["allocator_peak"]
        step["model_fall"] = model["off"] - model["offload"]
    rec.put("step", step)
    rec["summary"] = (f"h2d {link['h2d_gb_s']:.1f} GB/s, d2h {link['d2h_gb_s']:.1f} GB/s (published {link['published_each_way_gb_s']:.0f} each way); "
                      f"copies hidden {rec['results']['overlap']['hidden_frac']:.0%}; step exact: {exact}")
    if device == "cuda":
        rec["status"] = "ok" if exact and link["pinned"] else "failed"
    else:
        rec.update(status="dry" if ctx.dry else "skipped", reason=reason or "dry mode: the cpu backend's copies run in line")
