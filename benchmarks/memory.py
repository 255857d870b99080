"""Saved-activation bytes and step time of each memory option, MoE layers at a DeepSeek-like ratio.

One launch of gloo ranks (default pp=1 x ep=2, DualPipeV with its F&B overlap on, so
micro-batches pair up in F&B). For each option (off, zero-memory level0 / level1, recompute
moe / full, norms alone and with moe; the parts' saved tensors in host memory, ``memory.offload``;
the optimizer's states there, ``train.optimizer_offload``) it builds the same model (same seed)
on the same ranks, with its optimizer, then:

- saved bytes: one micro-batch's forward through every block, counting with
  :class:`~portapipe.memory.accounting.SavedActivations` the bytes each MoE layer holds for
  backward once its forward is done (per layer, per micro-batch; also split by part), then the
  backward. Two figures per layer: the whole transformer layer (attention part included), and
  its MoE block (dispatch, routed experts, combine, shared expert: the layer's FFN, what
  ``recompute: moe`` recomputes);
- peak: one tracked step, the most bytes held for backward at any moment of it (recompute's
  replays included);
- time: the options take turns step by step (so load changes hit all alike), each step starts
  at a barrier and counts the slowest rank; the median and the fastest over ``--steps`` after
  ``--warmup`` (on a shared machine the fastest is the least disturbed);
- work: the processor time of the busiest rank per step (median), which other load on the
  machine barely changes, as a steadier measure of what an option costs;
- hidden re-dispatch: the share of zero-memory's re-dispatch all-to-all time during which the
  rank computed instead of waiting (sum over ranks and timed steps);
- offload: the most a step held in host memory (``peak_host_saved_bytes``), the optimizer's device
  and host bytes, and the busiest rank's processor time of the optimizer step (timed apart from
  the step, each step's update at a learning rate of 1e-9: the weights stay put).

Prints one JSON object: the machine, the config, and one entry per option.

    python benchmarks/memory.py [--steps 5] [--warmup 1] [--set model.hidden=2048 ...]
    python benchmarks/memory.py --base deepseek_v3 --options off,recompute_norms   # MLA: norms and up-projections
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from portapipe.config import config_from_dict, load_config
from portapipe.ranks.launch import run_ranks
from portapipe.memory.accounting import SavedActivations, label_layers
from portapipe.memory.policy import redispatch_stats, reset_redispatch_stats
from portapipe.compose import PipelineRuntime
from portapipe.scheduling.overlap import Tape, run as run_program

OPTIONS: dict[str, dict[str, Any]] = {
    "off": {},
    "level0": {"zero_memory": "level0"},
    "level1": {"zero_memory": "level1"},
    "recompute_moe": {"recompute": "moe"},
    "recompute_full": {"recompute": "full"},
    "recompute_norms": {"recompute": "norms"},
    "norms_moe": {"recompute": ["norms", "moe"]},
    "offload_activations": {"offload": ["attention", "shared", "experts"]},
    "offload_optimizer": {},
}
#: the options that set the train section (the optimizer's)
TRAIN_OPTIONS: dict[str, dict[str, Any]] = {"offload_optimizer": {"optimizer_offload": "swap"}}

# --fp8-activations: examples/deepseek_v3.yaml widened to multiples of 128 under train.fp8, on one pipeline
# rank as the options above (ep 2, DualPipeV with its F&B overlap; its kv_a,
# 128 -> 128 + 32, stays in bfloat16 as DeepSeek-V3's 7168 -> 512 + 64 does), FP8-cached activations
# against FP8 without; the emulated FP8 GEMMs' processor time is measured apart.
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "deepseek_v3.yaml")
FP8_WIDE = ["model.hidden=256", "model.ffn_hidden=256", "model.moe_hidden=128", "model.q_lora_rank=128", "model.kv_lora_rank=128",
            "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=32", "model.dtype=bfloat16",
            "train.fp8=deepseek", "train.micro_batch_size=2", "data.path=null", "data.format=bytes", "parallel.pp=1"]
FP8_OPTIONS: dict[str, dict[str, Any]] = {"fp8": {}, "fp8_activations": {"fp8_activations": True}}


def _timed_fp8(backend: Any) -> list[float]:
    """Wrap ``backend``'s FP8 matmuls to add their processor time to the returned one-item list."""
    spent = [0.0]
    for name in ("fp8_mm", "fp8_grouped_mm"):
        fn = getattr(backend, name)

        def timed(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            c0 = time.process_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[0] += time.process_time() - c0

        setattr(backend, name, timed)
    return spent


# DeepSeek-V3: hidden 7168, routed expert width 2048 (0.29 x hidden), top-8, one shared expert.
BASE: dict[str, Any] = {
    "backend": "cpu",
    "parallel": {"pp": 1, "ep": 2},
    "schedule": {"name": "dualpipev", "microbatches": 4, "overlap": True},
    "model": {
        "hidden": 1024,
        "n_heads": 8,
        "n_layers": 2,
        "n_dense": 0,
        "n_experts": 16,
        "top_k": 8,
        "moe_hidden": 288,
        "n_shared": 1,
        "seq_len": 64,
        "dtype": "float32",
    },
    "train": {"micro_batch_size": 2},
}


# ``--base deepseek_v3``: examples/deepseek_v3.yaml (multi-head latent attention, DualPipeV) with
# every width a multiple of 128, as FP8's 1x128 / 128x128 tiles need, on one pipeline rank (the
# held-bytes pass runs a rank's blocks in order) x 2 EP ranks, as BASE
DEEPSEEK_V3_WIDE = ["parallel.pp=1", "model.hidden=256", "model.ffn_hidden=512", "model.moe_hidden=128", "model.q_lora_rank=128",
                    "model.kv_lora_rank=128", "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64", "model.v_head_dim=128"]


def _base(name: str) -> dict[str, Any]:
    """The config every option starts from: BASE, or the widened DeepSeek-V3 example."""
    if name == "moe":
        return json.loads(json.dumps(BASE))
    return load_config(EXAMPLE, DEEPSEEK_V3_WIDE).to_dict()


def _tokens(raw: dict[str, Any], replica: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    m, t = raw["model"], raw["train"]
    g = torch.Generator().manual_seed(1000 + replica)
    out = []
    for _ in range(n):
        tok = torch.randint(0, m.get("vocab_size", 256), (t["micro_batch_size"], m["seq_len"] + 1), generator=g)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def _held_bytes(rt: PipelineRuntime, mb: tuple[torch.Tensor, torch.Tensor]) -> dict[Any, int]:
    """Bytes each (layer, part) label holds for backward after one micro-batch's forward."""
    tracker = SavedActivations(ignore=rt.parameters())
    tapes = []
    x: Any = mb[0]
    order = sorted(rt.blocks)
    with tracker.track():
        for b in order:
            tape = Tape()
            last = b == order[-1]
            out = run_program(rt.blocks[b].program(tape, x, mb[1] if last else None))
            tapes.append((tape, out))
            x = out.detach()
    held = {label: n for (label, _mb), n in tracker.live_by_region.items() if n}
    grad = torch.ones_like(tapes[-1][1])
    for tape, out in reversed(tapes):  # backward too: the EP peers take part in its exchanges
        grad = run_program(tape.backward(out, grad))
        if grad is None:
            break
        grad = grad.detach()
    for p in rt.parameters():
        p.grad = None
    return held


def _rank(backend: Any, raws: dict[str, dict[str, Any]], steps: int, warmup: int) -> dict[str, Any]:
    from portapipe.training.update import make_sharded_optimizer

    torch.manual_seed(0)
    runtimes: dict[str, PipelineRuntime] = {}
    optimizers: dict[str, Any] = {}
    for name, raw in raws.items():
        config = config_from_dict(raw)
        p = config.parallel
        be = type(backend)(backend.options)
        runtimes[name] = PipelineRuntime(config, be, be.parallel_groups(p.pp, p.dp, p.ep))
        optimizers[name] = make_sharded_optimizer(runtimes[name], config, be)
        optimizers[name].lr = 1e-9
    any_rt = next(iter(runtimes.values()))
    g = any_rt.groups
    replica = g.dp_rank * g.ep + g.ep_rank
    raw0 = next(iter(raws.values()))
    mbs = _tokens(raw0, replica, any_rt.schedule.n_microbatches)
    out: dict[str, Any] = {}
    for name, rt in runtimes.items():
        label_layers(rt.blocks.values(), by_part=True)
        held = _held_bytes(rt, mbs[0])
        tracker = SavedActivations(ignore=rt.parameters())
        with tracker.track():
            rt.step(mbs)
        rt.grads.zero_grad()
        out[name] = {"held": held, "peak_saved_bytes": tracker.peak_bytes, "peak_host_saved_bytes": tracker.host_peak_bytes, "step_s": [],
                     "cpu_s": [], "redispatch": [0.0, 0.0], "a2a": [0.0, 0.0], "fp8_cpu_s": [], "optimizer_cpu_s": [],
                     "optimizer_bytes": optimizers[name].memory()}
    fp8_spent = {name: _timed_fp8(rt.backend) for name, rt in runtimes.items()}
    for i in range(warmup + steps):
        for name, rt in runtimes.items():
            reset_redispatch_stats(rt.blocks.values())
            dist.barrier()
            t0, c0, e0 = time.perf_counter(), time.process_time(), fp8_spent[name][0]
            result = rt.step(mbs)
            dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            emulated = fp8_spent[name][0] - e0  # this rank's: the busiest rank's processor time may not be the same rank's
            c1 = time.process_time()
            optimizers[name].step()
            rt.grads.zero_grad()
            opt_s = torch.tensor([time.process_time() - c1], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            dist.all_reduce(opt_s, op=dist.ReduceOp.MAX)
            if i < warmup:
                continue
            out[name]["optimizer_cpu_s"].append(float(opt_s[0]))
            st = redispatch_stats(rt.blocks.values())
            rec = out[name]
            rec["step_s"].append(float(dt[0]))
            rec["cpu_s"].append(float(dt[1]))
            rec["fp8_cpu_s"].append(emulated)
            rec["redispatch"][0] += st.total_s
            rec["redispatch"][1] += st.wait_s
            rec["a2a"][0] += result.timings["a2a_total_s"]
            rec["a2a"][1] += result.timings["a2a_wait_s"]
    out["allocator_peak_bytes"] = any_rt.backend.max_memory_allocated()
    return out


def _hidden(total: float, wait: float) -> float | None:
    return None if total <= 0 else max(0.0, min(1.0, 1.0 - wait / total))


def summarize(per_rank: list[dict[str, Any]], names: list[str], base: str = "off") -> dict[str, Any]:
    """Rank 0's bytes (every rank holds the same shapes up to routing), times over all ranks;
    ratios against option ``base``."""
    r0 = per_rank[0]
    # Layer labels are "<index>.<part>"; the embedding and the loss (no layer) are left out.
    layers = sorted({str(label).split(".")[0] for label in r0[names[0]]["held"] if str(label)[:1].isdigit()})
    results = {}
    for name in names:
        held = r0[name]["held"]
        per_layer = {lay: sum(n for label, n in held.items() if str(label).split(".")[0] == lay) for lay in layers}
        # The MoE block: what replaces the dense FFN (dispatch, routed experts, combine, shared
        # expert); its input, the normed tokens, and the routing belong to the attention part.
        # It is what ``recompute: moe`` recomputes.
        moe_block = {
            lay: sum(n for label, n in held.items() if str(label).split(".")[0] == lay and not str(label).endswith(".attention"))
            for lay in layers
        }
        red = [sum(r[name]["redispatch"][k] for r in per_rank) for k in (0, 1)]
        a2a = [sum(r[name]["a2a"][k] for r in per_rank) for k in (0, 1)]
        results[name] = {
            "saved_bytes_per_layer": statistics.mean(per_layer.values()),
            "saved_bytes_moe_block_per_layer": statistics.mean(moe_block.values()),
            "saved_bytes_by_part": {str(k): v for k, v in sorted(held.items(), key=lambda kv: str(kv[0]))},
            "peak_saved_bytes_step": r0[name]["peak_saved_bytes"],
            "peak_saved_bytes_per_rank": [r[name]["peak_saved_bytes"] for r in per_rank],
            "step_s_median": statistics.median(r0[name]["step_s"]),
            "step_s_min": min(r0[name]["step_s"]),
            "cpu_s_median": statistics.median(r0[name]["cpu_s"]),
            "step_s_all": r0[name]["step_s"],
            "redispatch_hidden_frac": _hidden(*red),
            "redispatch_s": red[0],
            "a2a_hidden_frac": _hidden(*a2a),
            "fp8_emulation_cpu_s_median": statistics.median(r0[name]["fp8_cpu_s"]),
            "peak_host_saved_bytes_per_rank": [r[name]["peak_host_saved_bytes"] for r in per_rank],
            "optimizer_bytes_rank0": r0[name]["optimizer_bytes"],
            "optimizer_cpu_s_median": statistics.median(r0[name]["optimizer_cpu_s"]),
        }
    off = results[base]
    for name, res in results.items():
        res["saved_cut_vs_off"] = 1.0 - res["saved_bytes_per_layer"] / off["saved_bytes_per_layer"]
        res["moe_block_cut_vs_off"] = 1.0 - res["saved_bytes_moe_block_per_layer"] / off["saved_bytes_moe_block_per_layer"]
        res["step_vs_off"] = res["step_s_median"] / off["step_s_median"]
        # Other load on the machine only ever adds time: the fastest step is the least disturbed.
        res["step_vs_off_min"] = res["step_s_min"] / off["step_s_min"]
        # Processor time of the busiest rank: what the option costs in work, unlike wall time
        # barely moved by other processes on the machine (waiting is not counted).
        res["cpu_vs_off"] = res["cpu_s_median"] / off["cpu_s_median"]
        res["optimizer_cpu_vs_off"] = res["optimizer_cpu_s_median"] / off["optimizer_cpu_s_median"]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated subset of {', '.join(OPTIONS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. model.hidden=2048")
    ap.add_argument("--base", choices=("moe", "deepseek_v3"), default="moe",
                    help="moe: the DeepSeek-like MoE layers above; deepseek_v3: examples/deepseek_v3.yaml widened to multiples of 128")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="instead: FP8-cached activations against FP8 without, on examples/deepseek_v3.yaml widened to multiples of 128")
    args = ap.parse_args(argv)
    if args.fp8_activations:
        names, base = list(FP8_OPTIONS), "fp8"
        raws = {name: load_config(EXAMPLE, [*FP8_WIDE, *(f"memory.{k}={str(v).lower()}" for k, v in opt.items()), *args.set]).to_dict()
                for name, opt in FP8_OPTIONS.items()}
    else:
        names, base = [n.strip() for n in args.options.split(",") if n.strip()], "off"
        unknown = [n for n in names if n not in OPTIONS]
        if unknown or "off" not in names:
            ap.error(f"--options: unknown {unknown}; choose from {', '.join(OPTIONS)} (off is required as the baseline)")
        raws = {}
        for name in names:
            raw = _base(args.base)
            raw["memory"] = dict(OPTIONS[name])
            raw["train"] = {**raw.get("train", {}), **TRAIN_OPTIONS.get(name, {})}
            raws[name] = load_config(raw, args.set).to_dict()  # fails here, before ranks start, if invalid
    cfg = config_from_dict(raws[base])
    per_rank = run_ranks(_rank, cfg.world_size, raws, args.steps, args.warmup, backend=cfg.backend, wall_timeout_s=1800)
    m = cfg.model
    report = {
        "benchmark": "memory",
        "command": "python benchmarks/memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "setup": {
            "ranks": cfg.world_size,
            "arch": m.arch,
            "fp8": cfg.train.fp8,
            "pp": cfg.parallel.pp,
            "ep": cfg.parallel.ep,
            "schedule": cfg.schedule.name,
            "overlap": cfg.schedule.overlap,
            "microbatches": cfg.schedule.microbatches,
            "tokens_per_microbatch": cfg.train.micro_batch_size * m.seq_len,
            "hidden": m.hidden,
            "moe_hidden": m.moe_hidden,
            "top_k": m.top_k,
            "n_experts": m.n_experts,
            "n_shared": m.n_shared,
            "moe_layers": m.n_layers - m.n_dense,
            "steps": args.steps,
            "warmup": args.warmup,
        },
        "options": summarize(per_rank, names, base),
        "allocator_peak_bytes_rank0": per_rank[0]["allocator_peak_bytes"],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
