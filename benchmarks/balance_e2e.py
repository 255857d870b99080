"""Balancers end to end: training-step time and EP wait under routing skew; prints one JSON object.

One launch of gloo ranks per layout (``ep4``: 4 ranks, ep 4; ``pp2ep4``: 8 ranks, pp 2 x ep 4)
training a small MoE-dominated model (wide routed experts, a narrow attention). In the same
processes it builds one training run per variant and steps them in turns, step by step, each
step starting at a barrier, so a change in machine load hits every variant alike (paired
steps). Variants, for each routing source:

- ``skew``: ``bench.router_skew_from`` (``--loads``, default examples/expert_loads.txt, whose
  first row has max / mean 2.19): each token's experts drawn in proportion to the file's loads;
- ``uniform``: ``bench.force_uniform_routing`` (round-robin: every expert the same rows), the
  peers' benchmark mode: the upper bound for the skewed runs, and a balanced router on which the
  balancers should stay off;

and balancer: ``none``, ``eplb`` (incremental, redundant 1, rebalancing every 2 steps on the
last 2 steps' loads) and ``lplb`` (ring, redundant 1; its placement is EPLB's packing of the
window's loads, so it is EPLB + LPLB; ``stay_off`` on). Per variant, over the steps after
``--warmup``: median step time (slowest rank), median ``ep_wait_frac`` and
``rank_balancedness``, the balancer's own time per step (after_step's planning and migration,
plus the LP's processor time), bytes migrated (every step), for LPLB the steps it ran, and the
median over paired steps of the step-time ratio to the same source without a balancer. Then for
the skewed source the share of the gap (none -> uniform) each balancer wins back, in step time
(from the paired ratios) and in EP wait; for the uniform source what each balancer costs
against none (paired ratio - 1).

Step times are wall clock on a shared machine (load averages recorded); the EP wait is measured
from processor time (see portapipe/models/expert_clock.py).

    python benchmarks/balance_e2e.py [--layouts ep4 pp2ep4] [--steps 12] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from portapipe.config import load_config  # noqa: E402
from portapipe.launch import run_ranks  # noqa: E402

# ep2: one rank per core of a 2-core machine, where a rank waiting on its EP peer leaves its core idle
# (with more ranks than cores a waiting rank hands its core to another, and the wait costs no wall time)
LAYOUTS = {"ep4": {"pp": 1, "ep": 4, "dp": 1}, "pp2ep4": {"pp": 2, "ep": 4, "dp": 1}, "ep2": {"pp": 1, "ep": 2, "dp": 1}}
BALANCERS = {
    "none": {"kind": "none"},
    "eplb": {"kind": "eplb", "redundant": 1, "interval": 2, "window": 2, "policy": "incremental"},
    "lplb": {"kind": "lplb", "redundant": 1, "topology": "ring", "interval": 2, "window": 2},
}


def variant_config(layout: str, source: str, balancer: str, loads: str, log_dir: Path, steps: int) -> dict[str, Any]:
    bench = {"router_skew_from": loads} if source == "skew" else {"force_uniform_routing": True}
    return load_config(
        {
            "backend": "cpu",
            "parallel": LAYOUTS[layout],
            "schedule": {"name": "1f1b", "microbatches": 4},
            "model": {"vocab_size": 256, "hidden": 64, "n_layers": 4, "n_dense": 0, "n_heads": 2, "ffn_hidden": 64,
                      "moe_hidden": 512, "n_experts": 12, "top_k": 4, "seq_len": 64, "bias_update_speed": 0.0},
            "balancer": BALANCERS[balancer],
            "bench": bench,
            "train": {"steps": steps, "micro_batch_size": 4, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0},
            "log": {"dir": str(log_dir), "progress": False},
            "checkpoint": {"every": 0},
        }
    ).to_dict()


def _rank(backend: Any, raws: dict[str, dict[str, Any]], steps: int) -> dict[str, list[dict[str, Any]]]:
    """Every variant's training, stepped in turns; rank 0 returns each step's figures."""
    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.data import TextData, replica_of
    from portapipe.metrics import ep_step_figures, gather_step_stats
    from portapipe.models.routing import force_routing
    from portapipe.train import counted_blocks, make_sharded_optimizer

    runs = {}
    first = config_from_dict(next(iter(raws.values()))).parallel  # every variant has the same layout
    groups = backend.parallel_groups(first.pp, first.dp, first.ep)
    for name, raw in raws.items():
        config = config_from_dict(raw)
        backend.manual_seed(config.train.seed)
        runtime = PipelineRuntime(config, backend, groups)
        force_routing(config.bench, config.model, {layer.index: layer.moe.router for layer in runtime.moe_layers()}, config.train.seed)
        optimizer = make_sharded_optimizer(runtime, config, backend)
        optimizer.lr = config.train.lr  # constant: every variant steps alike
        runs[name] = (config, groups, runtime, optimizer, TextData(config))
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for step in range(steps):
        for name, (config, groups, runtime, optimizer, data) in runs.items():
            replica, replicas = replica_of(groups)
            batches = data.microbatches(step, replica, replicas, config.schedule.microbatches, config.train.micro_batch_size,
                                        config.model.seq_len)
            backend.barrier()
            t0 = time.perf_counter()
            result = runtime.step(batches)
            ep = ep_step_figures(backend, groups, runtime.moe_layers())
            stats = gather_step_stats(backend, float(optimizer.local_sq_norm(counted_blocks(runtime.schedule, groups.pp_rank))), result, ep)
            with torch.no_grad():
                optimizer.step(1.0)
            runtime.grads.zero_grad()
            t1 = time.perf_counter()
            balance = runtime.balancer.after_step(step, result, optimizer) if runtime.balancer is not None else {}
            t2 = time.perf_counter()
            # the slowest rank's step and balancer time
            times = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)
            backend.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
            out[name].append({"step_s": float(times[0]), "after_step_s": float(times[1]), "ep_wait_frac": stats.ep_wait_frac,
                              "rank_balancedness": stats.rank_balancedness, "balancer": balance})
    return out


def summarise(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the steps after ``warmup``; migrations over every step (the first placement too)."""
    med = statistics.median
    rebalances = [s["balancer"]["rebalance"] for s in steps if "rebalance" in s["balancer"]]
    steps = steps[warmup:]
    ran = [s["balancer"]["lp_ran"] for s in steps if "lp_ran" in s["balancer"]]
    lp_ms = [s["balancer"]["lp_cost_ms"] for s in steps if s["balancer"].get("lp_ran")]
    out = {
        "step_s": round(med(s["step_s"] for s in steps), 4),
        "ep_wait_frac": round(med(s["ep_wait_frac"] for s in steps), 4),
        "rank_balancedness": round(med(s["rank_balancedness"] for s in steps), 4),
        "after_step_ms": round(1e3 * med(s["after_step_s"] for s in steps), 2),
        "bytes_migrated": sum(r["bytes_moved"] for r in rebalances),
        "rebalances_applied": sum(bool(r["applied"]) for r in rebalances),
    }
    if ran:
        out["lp_steps_run"] = sum(ran)
        out["lp_ms_per_step"] = round(med(lp_ms), 3) if lp_ms else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out (one-time costs, first placement)")
    ap.add_argument("--loads", default=str(ROOT / "examples" / "expert_loads.txt"))
    ap.add_argument("--out-dir", default=None, help="run folders (default: a temporary one)")
    args = ap.parse_args()
    import tempfile

    root = Path(args.out_dir or tempfile.mkdtemp(prefix="balance_e2e-"))
    result: dict[str, Any] = {
        "benchmark": "balance_e2e",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
        "steps": args.steps,
        "warmup": args.warmup,
        "loads": args.loads,
        "layouts": {},
    }
    for layout in args.layouts:
        raws = {f"{source}:{bal}": variant_config(layout, source, bal, args.loads, root / layout / f"{source}-{bal}", args.steps)
                for source in ("skew", "uniform") for bal in BALANCERS}
        world = LAYOUTS[layout]["pp"] * LAYOUTS[layout]["ep"]
        steps = run_ranks(_rank, world, raws, args.steps, wall_timeout_s=3600)[0]
        table = {name: summarise(s, args.warmup) for name, s in steps.items()}

        def paired(name: str, base: str) -> float:
            """Median over the paired steps (same step number, run in turn) of the step-time ratio."""
            return statistics.median(a["step_s"] / b["step_s"] for a, b in zip(steps[name][args.warmup:], steps[base][args.warmup:]))

        for name in table:
            table[name]["paired_ratio_vs_none"] = round(paired(name, name.split(":")[0] + ":none"), 4)
        none, top = table["skew:none"], table["uniform:none"]
        top_ratio = paired("uniform:none", "skew:none")
        won = {}
        for bal in ("eplb", "lplb"):
            row = table[f"skew:{bal}"]
            gap_w = none["ep_wait_frac"] - top["ep_wait_frac"]
            won[bal] = {
                "step_time": round((1 - paired(f"skew:{bal}", "skew:none")) / (1 - top_ratio), 3) if top_ratio < 1 else None,
                "ep_wait": round((none["ep_wait_frac"] - row["ep_wait_frac"]) / gap_w, 3) if gap_w > 0 else None,
            }
        cost = {bal: round(table[f"uniform:{bal}"]["paired_ratio_vs_none"] - 1, 4) for bal in ("eplb", "lplb")}
        result["layouts"][layout] = {"ranks": world, "variants": table, "gap_won_back": won,
                                     "balanced_router_cost_frac": cost}
    result["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
