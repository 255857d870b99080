"""Part g: the allocator's peak of one step against the planner's memory model; what zero-memory
level0 / level1 and recompute moe save on the allocator and in the accounting."""

from __future__ import annotations

import contextlib
from typing import Any

from .common import Ctx, Record, cuda_reason, one_rank_runtime


def memory_need(raw: dict[str, Any]) -> dict[str, float]:
    """The planner's memory model for ``raw``: bytes per part of the one pipeline rank."""
    from portapipe.config import load_config
    from portapipe.plan.memory_model import MemoryModel
    from portapipe.scheduling.runnable import build_schedule
    from portapipe.config.setup import Setup

    config = load_config(raw)
    r = MemoryModel(Setup.from_config(config), build_schedule(config)).report().ranks[0]
    return {k: float(v) for k, v in r.to_dict().items()}


MEMORY_OPTIONS = {"off": {}, "level0": {"zero_memory": "level0"}, "level1": {"zero_memory": "level1"}, "recompute_moe": {"recompute": "moe"}}


def memory_raw(device: str, dry: bool, option: dict[str, Any]) -> dict[str, Any]:
    model = ({"hidden": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64, "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 16}
             if dry else {"hidden": 1024, "n_layers": 4, "n_heads": 8, "ffn_hidden": 4096, "moe_hidden": 512, "n_experts": 16, "top_k": 4, "seq_len": 1024})
    return {"backend": device, "parallel": {"pp": 1, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
            "model": {**model, "n_dense": 1, "n_shared": 1, "dtype": "float32", "vocab_size": 256},
            "memory": option, "train": {"micro_batch_size": 2 if dry else 4}}


def memory_rank(backend: Any, raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One step of each option on this rank: the allocator's peak and what the accounting saw."""
    from portapipe.memory.accounting import SavedActivations

    out = {}
    for name, raw in raws.items():
        be, rt, mbs = one_rank_runtime(backend, raw)
        rt.step(mbs)  # the gradients exist from here on, as in training
        be.synchronize()
        be.reset_peak_memory_stats()
        before = be.memory_allocated()
        tracker = SavedActivations(ignore=rt.parameters())
        with tracker.track():
            rt.step(mbs)
        be.synchronize()
        out[name] = {"allocator_before": before, "allocator_peak": be.max_memory_allocated(), "accounting_peak_saved": tracker.peak_bytes}
        del rt
        with contextlib.suppress(Exception):
            be.device_module().empty_cache()
    return out


def part_memory(rec: Record, ctx: Ctx) -> None:
    from portapipe.ranks.launch import run_ranks

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    raws = {name: memory_raw(device, ctx.dry, opt) for name, opt in MEMORY_OPTIONS.items()}
    model = {name: memory_need(raw) for name, raw in raws.items()}
    rec.put("model", model)
    if device == "cpu":  # the GPU run's shapes, through the same rules and memory model
        rec.put("gpu_model", {name: memory_need(memory_raw("cuda", False, opt)) for name, opt in MEMORY_OPTIONS.items()})
    measured = run_ranks(memory_rank, 1, raws, backend=device, wall_timeout_s=ctx.left())[0]
    rows = {}
    off = measured["off"]
    for name in raws:
        got, want = measured[name], model[name]
        predicted = want["params"] + want["grads"] + want["buffers"] + want["held_peak"]  # no optimizer in a bare step
        rows[name] = {**got, "model_step_peak": predicted, "model_saved_peak": want["saved_peak"],
                      "peak_vs_model": got["allocator_peak"] / predicted - 1 if got["allocator_peak"] else None,
                      "saved_vs_off_allocator": (off["allocator_peak"] or 0) - (got["allocator_peak"] or 0),
                      "saved_vs_off_model": model["off"]["held_peak"] - want["held_peak"],
                      "saved_vs_off_accounting": off["accounting_peak_saved"] - got["accounting_peak_saved"]}
    rec.put("rows", rows)
    rec.put("compared", "allocator peak of one step (forward + backward, gradients held, no optimizer) against the memory model's "
                        "params + grads + buffers + held_peak; savings: the off option's figure minus the option's, on each side")
    within = [abs(r["peak_vs_model"]) <= 0.05 for r in rows.values() if r["peak_vs_model"] is not None]
    rec["summary"] = ", ".join(f"{n}: peak {r['peak_vs_model']:+.1%} vs model" if r["peak_vs_model"] is not None else n for n, r in rows.items())
    if device == "cuda":
        rec["status"] = "ok" if within and all(within) else "failed"
    else:
        rec.update(status="dry" if ctx.dry else "skipped", reason=reason or "dry mode: the cpu backend has no allocator figures (its peak is the process's)")

