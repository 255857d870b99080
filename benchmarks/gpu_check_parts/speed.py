"""Part e: tokens/s and MFU of a DeepSeek-V3-shaped model sized by the planner's memory model to
fill the GPU (bf16 with float32 master, pp 1 ep 1), and transformers' model on the same batch
(:mod:`.transformers_peer`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .common import Ctx, Record, cuda_reason
from .memory import memory_need
from .transformers_peer import flops_per_token, hf_speed

#: dense bf16 peak of an H100 SXM and of an H200, without sparsity (NVIDIA's data sheets), TFLOP/s
PEAK_BF16_TFLOPS = 989.0
# ----------------------------------------------------------------------------- e speed
#: DeepSeek-V3's architecture (multi-head latent attention, sigmoid group-limited routing over 8
#: groups, a shared expert, dense first layer) at DeepSeek-V2-Lite's widths (hidden 2048, 16 heads,
#: kv_lora_rank 512, 64 experts of width 1408, top-6), deepest first: the planner's memory model
#: picks the first that fits the device (bf16 weights, float32 master and AdamW: about 18 bytes a
#: parameter; 8 layers plan 80 GB, 6 layers 58 GB), a CUDA out-of-memory error moves on to the next.
_SPEED_SHAPE = {"hidden": 2048, "n_dense": 1, "n_heads": 16, "ffn_hidden": 10944, "moe_hidden": 1408, "top_k": 6, "n_groups": 8,
                "topk_groups": 4, "q_lora_rank": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
SPEED_MODELS: list[dict[str, Any]] = [{**_SPEED_SHAPE, "n_layers": layers, "n_experts": experts}
                                      for layers, experts in ((12, 64), (8, 64), (7, 64), (6, 64), (4, 32))]
SPEED_COMMON = {"arch": "deepseek_v3", "vocab_size": 32768, "n_shared": 1, "routed_scale": 2.5, "seq_len": 4096, "dtype": "bfloat16"}
SPEED_DRY = {"hidden": 32, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 64, "moe_hidden": 16, "n_experts": 8, "top_k": 2,
             "n_groups": 4, "topk_groups": 2, "q_lora_rank": 0, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
             "v_head_dim": 8, "seq_len": 32, "vocab_size": 256}


def speed_raw(model: dict[str, Any], device: str, dry: bool) -> dict[str, Any]:
    return {
        "backend": device, "parallel": {"pp": 1, "ep": 1, "dp": 1},
        "schedule": {"name": "1f1b", "microbatches": 2 if dry else 4},
        "model": {**SPEED_COMMON, **model, **(SPEED_DRY if dry else {}), **({"dtype": "float32"} if device == "cpu" else {})},
        "train": {"steps": 4 if dry else 10, "micro_batch_size": 1, "master_dtype": "float32", "warmup_steps": 2, "lr": 3e-4},
        "log": {"progress": False}, "checkpoint": {"every": 0},
    }


def part_speed(rec: Record, ctx: Ctx) -> None:
    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    memory = 80 * 2**30
    if reason is None:
        from portapipe.backends import get_backend

        memory = int(get_backend("cuda").describe()["memory_bytes"])
    budget = 0.85 * memory  # what the model may plan for: the allocator's caching and fragmentation take the rest
    sizing = []
    for model in SPEED_MODELS:
        need = memory_need(speed_raw(model, "cuda", False))
        sizing.append({"model": model, "planned_bytes": need["total"], "fits": need["total"] <= budget, "parts": need})
    rec.put("sizing", {"device_memory_bytes": memory, "budget_bytes": budget, "candidates": sizing, "common": SPEED_COMMON})
    chosen = [s["model"] for s in sizing if s["fits"]] or [SPEED_MODELS[-1]]
    if ctx.dry:
        chosen = chosen[:1]
    for model in chosen:
        raw = speed_raw(model, device, ctx.dry)
        flops = flops_per_token(raw)
        rec.put("flops", flops)
        ours = ours_speed(raw, ctx)
        rec.put("portapipe", ours)
        if "error" in ours and "out of memory" in ours["error"].lower():
            rec.setdefault("oom", []).append(model)
            continue
        break
    theirs = hf_speed(raw, ctx)
    rec.put("transformers", theirs)
    tokens = raw["train"]["micro_batch_size"] * raw["schedule"]["microbatches"] * raw["model"]["seq_len"]
    res: dict[str, Any] = {"model": raw["model"], "micro_batch_size": raw["train"]["micro_batch_size"],
                           "microbatches": raw["schedule"]["microbatches"], "tokens_per_step": tokens, "pp": 1, "ep": 1,
                           "precision": f"{raw['model']['dtype']} weights, {raw['train']['master_dtype']} master weights and AdamW",
                           "peak_tflops": PEAK_BF16_TFLOPS}
    if ours.get("tokens_per_s"):
        res["mfu"] = ours["tokens_per_s"] * flops["flops_per_token"] / (PEAK_BF16_TFLOPS * 1e12)
    if ours.get("tokens_per_s") and theirs.get("tokens_per_s"):
        res["ours_over_transformers"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    rec.put("result", res)
    rec["summary"] = (f"{ours.get('tokens_per_s') or 0:.0f} tok/s, MFU {100 * res.get('mfu', 0):.1f}%, "
                      f"{res.get('ours_over_transformers') or 0:.2f}x transformers ({theirs.get('experts_implementation')})")
    failed = "error" in ours or "error" in theirs
    rec["status"] = "failed" if failed else ("ok" if device == "cuda" else "dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"


def speed_rank(backend: Any, raw: dict[str, Any], deadline: float) -> dict[str, Any]:
    """portapipe's training step on this rank (the loop of portapipe train without its run folder
    and checkpoints: a 3-billion-parameter model's would be tens of GB): the pipelined step, then
    the sharded AdamW on float32 master weights; device time per step by the backend's timer."""
    import torch

    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.training.update import make_sharded_optimizer

    config = config_from_dict(raw)
    p, m, t = config.parallel, config.model, config.train
    backend.manual_seed(t.seed)
    rt = PipelineRuntime(config, backend, backend.parallel_groups(p.pp, p.dp, p.ep))
    opt = make_sharded_optimizer(rt, config, backend)
    opt.lr = t.lr
    g = torch.Generator().manual_seed(t.seed)
    tok = torch.randint(0, m.vocab_size, (config.schedule.microbatches, t.micro_batch_size, m.seq_len + 1), generator=g)
    mbs = [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in tok]
    backend.reset_peak_memory_stats()
    times, tokens = [], 0
    for step in range(t.steps):
        with backend.timed() as timer:
            result = rt.step(mbs)
            with torch.no_grad():
                opt.step(1.0)
            rt.grads.zero_grad()
        tokens = int(result.tokens)
        if step >= t.warmup_steps:
            times.append(timer.elapsed_s)
        if time.time() > deadline:
            break
    return {"tokens_per_step": tokens, "step_s": times, "allocator_peak_bytes": backend.max_memory_allocated(),
            "loss_last": float(result.loss)}


def ours_speed(raw: dict[str, Any], ctx: Ctx) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    try:
        got = run_ranks(speed_rank, 1, raw, time.time() + ctx.left(40), backend=raw["backend"], wall_timeout_s=ctx.left(20))[0]
    except Exception as exc:
        return {"error": " ".join(str(exc).split())[:600]}
    rate = got["tokens_per_step"] / statistics.median(got["step_s"]) if got["step_s"] else None
    return {"tokens_per_s": rate, "steps_timed": len(got["step_s"]), **got}

