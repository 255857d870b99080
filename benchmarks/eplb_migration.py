"""What an EPLB rebalance of a running model moves, and the balance it wins; prints one JSON object.

The shape is DeepSeek-V3's (61 layers x 256 experts, 288 slots, 32 GPUs in 4 nodes, 8 groups).
For each seed, loads are lognormal(0, 0.75) and the placement in force is the ``refined`` plan for
them (what training adopts first); the loads then drift: each is multiplied by exp(d * N(0, 1)).
From that placement every policy plans for the drifted loads:

- keep: the placement in force (moves nothing);
- hierarchical (the published algorithm) and refined: plan from scratch;
- incremental: change at most ``--max-moved`` of each layer's slots (``min_gain`` 0), moves
  ranked with a node crossing priced at the default ``inter_node_cost``;
- incremental_node_blind: the same with ``inter_node_cost`` 1 (every changed slot priced alike).

Per policy: slots whose expert changes (mean over layers and the worst layer), the rows and bytes
sent within and between nodes and the share of the moved rows that stay in their node (one slot = one DeepSeek-V3 expert, 3 x 7168 x 2048 parameters, in
bfloat16 with bfloat16 AdamW moments and a float32 master copy: the ``--dtype`` flags change it),
max / mean GPU load (mean over layers and worst layer) and the time of a call for all layers on
one thread: median wall clock, median and least processor time (the machine may be shared, so
the load average is recorded; ``targets_at_10pct_drift`` checks the incremental policy's bounds at 10% drift,
``targets_at_10_to_15pct_drift`` its balance and locality from 10% to 15%). The Pareto
curve runs incremental over a range of ``max_moved`` (and of ``min_gain`` at a fixed budget):
moved fraction against balance, as JSON and, with ``--png``, as a plot.

    python benchmarks/eplb_migration.py --png docs/eplb_migration.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from eplb import add_shape_args  # noqa: E402
from portapipe.balancing.cost import migration_cost, slot_bytes  # noqa: E402
from portapipe.balancing.eplb import gpu_loads, lower_bound, rebalance_experts  # noqa: E402

EXPERT_PARAMS = 3 * 7168 * 2048
BUDGETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
#: processor time of one incremental call for all 61 layers on one core, at 10% drift
TIME_BOUND_MS = 200
MIN_GAINS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def timed(fn, repeats: int) -> tuple[dict, object]:
    """({median wall ms, median and least processor ms}, last result) of ``repeats`` calls after one
    warm-up. Processor time is the figure to quote on a shared machine: other jobs stretch the wall
    clock, and less so this process's own processor time (the least call is the least disturbed)."""
    out = fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"median_ms": round(statistics.median(wall) * 1e3, 2), "median_cpu_ms": round(statistics.median(cpu) * 1e3, 2),
            "min_cpu_ms": round(min(cpu) * 1e3, 2)}, out


def figures(w: torch.Tensor, current: torch.Tensor, plan: torch.Tensor, shape: dict, per_slot: int) -> dict:
    cost = migration_cost(current, plan, shape["gpus"], shape["nodes"])
    load = gpu_loads(w, plan, shape["gpus"])
    ratio = load.max(1).values / load.mean(1)
    changed = cost.changed.double() / plan.shape[1]
    return {
        "slots_changed": float(changed.mean()),
        "slots_changed_worst_layer": float(changed.max()),
        "rows_intra_node": int(cost.intra.sum()),
        "rows_inter_node": int(cost.inter.sum()),
        "intra_node_share": float(cost.intra.sum() / (cost.intra.sum() + cost.inter.sum()).clamp(min=1)),
        "gb_intra_node": cost.bytes(per_slot)["bytes_intra_node"] / 1e9,
        "gb_inter_node": cost.bytes(per_slot)["bytes_inter_node"] / 1e9,
        "max_over_mean": float(ratio.mean()),
        "max_over_mean_worst": float(ratio.max()),
        "max_over_lower_bound": float((load.max(1).values / lower_bound(w, shape["replicas"], shape["gpus"])).mean()),
        "never_worse_than_keep": bool((load.max(1).values <= gpu_loads(w, current, shape["gpus"]).max(1).values).all()),
    }


def mean_of(rows: list[dict]) -> dict:
    """Seed means; worst-layer figures take the worst seed; flags must hold for every seed."""
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if isinstance(values[0], bool):
            out[key] = all(values)
        elif "worst" in key:
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in out.items()}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    colors = {"0.05": "tab:green", "0.1": "tab:blue", "0.12": "tab:purple", "0.15": "tab:orange", "0.2": "tab:red"}
    zero = 0.4  # where "moves nothing" sits on the log axis
    for drift, block in result["drifts"].items():
        c = colors.get(drift, None)
        pts = block["pareto_max_moved"]
        ax.plot([100 * p["slots_changed"] for p in pts], [p["max_over_mean"] for p in pts], "o-", color=c, ms=4,
                label=f"incremental, drift {float(drift):.0%}")
        for name, marker in (("keep", "s"), ("hierarchical", "^"), ("refined", "D")):
            p = block["policies"][name]
            ax.plot(max(100 * p["slots_changed"], zero), p["max_over_mean"], marker, color=c, ms=7, mfc="none" if name != "keep" else c)
    for name, marker in (("keep the old placement", "s"), ("hierarchical (published)", "^"), ("refined", "D")):
        ax.plot([], [], marker, color="gray", mfc="none", label=name)
    ax.axhline(1.01, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlim(0.3, 130)
    ax.set_xticks([zero, 1, 2, 5, 10, 20, 50, 100])
    ax.set_xticklabels(["0", "1", "2", "5", "10", "20", "50", "100"])
    ax.minorticks_off()
    ax.set_xlabel("slots whose expert changes (%, mean over 61 layers; log scale)")
    ax.set_ylabel("max / mean GPU load (mean over layers)")
    ax.set_title("EPLB rebalance after load drift: DeepSeek-V3 shape, 3 seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)  # --sigma: the base loads' skew, before the drift
    ap.add_argument("--drifts", type=float, nargs="+", default=[0.05, 0.10, 0.12, 0.15, 0.20])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-moved", type=float, default=0.1, help="incremental's budget in the policy table")
    ap.add_argument("--repeats", type=int, default=11, help="timed calls per policy (seed 0, each drift)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--state-dtype", default="bfloat16")
    ap.add_argument("--master-dtype", default="float32")
    ap.add_argument("--png", help="write the Pareto plot here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = {"layers": args.layers, "experts": args.experts, "replicas": args.replicas, "gpus": args.gpus,
             "nodes": args.nodes, "groups": args.groups}
    plan_args = (args.replicas, args.groups, args.nodes, args.gpus)
    per_slot = slot_bytes(EXPERT_PARAMS, args.dtype, "adamw", args.state_dtype, args.master_dtype)
    out: dict = {
        "benchmark": "eplb_migration",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": args.threads,
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
        "shape": shape,
        "loads": f"lognormal(0, {args.sigma}) x exp(drift * N(0, 1)), seeds 0..{args.seeds - 1}; current = refined plan of the base loads",
        "bytes_per_slot": per_slot,
        "slot": f"{EXPERT_PARAMS} parameters in {args.dtype}, AdamW moments in {args.state_dtype}, master copy in {args.master_dtype}",
        "incremental_max_moved": args.max_moved,
        "drifts": {},
    }
    for drift in args.drifts:
        rows: dict[str, list[dict]] = {}
        pareto: dict[float, list[dict]] = {b: [] for b in BUDGETS}
        gains: dict[float, list[dict]] = {g: [] for g in MIN_GAINS}
        times: dict[str, dict] = {}
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            w0 = torch.exp(torch.randn(args.layers, args.experts, generator=g) * args.sigma)
            current = rebalance_experts(w0, *plan_args, policy="refined")[0]
            w = w0 * torch.exp(drift * torch.randn(w0.shape, generator=g))
            plans = {
                "keep": lambda: current,
                "hierarchical": lambda: rebalance_experts(w, *plan_args)[0],
                "refined": lambda: rebalance_experts(w, *plan_args, policy="refined")[0],
                "incremental": lambda: rebalance_experts(w, *plan_args, policy="incremental", current=current, max_moved=args.max_moved)[0],
                "incremental_node_blind": lambda: rebalance_experts(w, *plan_args, policy="incremental", current=current,
                                                                    max_moved=args.max_moved, inter_node_cost=1.0)[0],
            }
            for name, fn in plans.items():
                if seed == 0 and name != "keep":
                    times[name], plan = timed(fn, args.repeats)
                else:
                    plan = fn()
                rows.setdefault(name, []).append(figures(w, current, plan, shape, per_slot))
            for budget in BUDGETS:
                plan = rebalance_experts(w, *plan_args, policy="incremental", current=current, max_moved=budget)[0]
                pareto[budget].append(figures(w, current, plan, shape, per_slot))
            for min_gain in MIN_GAINS:
                plan = rebalance_experts(w, *plan_args, policy="incremental", current=current, max_moved=0.2, min_gain=min_gain)[0]
                gains[min_gain].append(figures(w, current, plan, shape, per_slot))
        block = {"policies": {}}
        for name, r in rows.items():
            block["policies"][name] = mean_of(r)
            block["policies"][name].update(times.get(name, {}))
        block["pareto_max_moved"] = [{"max_moved": b, **mean_of(pareto[b])} for b in BUDGETS]
        block["min_gain_at_max_moved_0.2"] = [{"min_gain": m, **mean_of(gains[m])} for m in MIN_GAINS]
        out["drifts"][str(drift)] = block
    out["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    deepseek_v3 = all(shape[k] == ap.get_default(k) for k in shape) and args.sigma == ap.get_default("sigma")
    if deepseek_v3 and "0.1" in out["drifts"] and args.max_moved == 0.1:
        inc = out["drifts"]["0.1"]["policies"]["incremental"]
        # the incremental policy's bounds at 10% drift, stated for the DeepSeek-V3 shape (the default)
        out["targets_at_10pct_drift"] = {
            "slots_changed_worst_layer <= 0.10": inc["slots_changed_worst_layer"] <= 0.10,
            "max_over_mean <= 1.01": inc["max_over_mean"] <= 1.01,
            "max_over_mean_worst <= 1.02": inc["max_over_mean_worst"] <= 1.02,
            f"median_cpu_ms < {TIME_BOUND_MS}": inc["median_cpu_ms"] < TIME_BOUND_MS,
            "never_worse_than_keep": inc["never_worse_than_keep"],
            "intra_node_share > node-blind's": inc["intra_node_share"] > out["drifts"]["0.1"]["policies"]["incremental_node_blind"]["intra_node_share"],
        }
    if deepseek_v3 and args.max_moved == 0.1:
        # from 10% to 15% drift: the balance at <= 10% of the slots, with fewer rows across nodes than node-blind
        out["targets_at_10_to_15pct_drift"] = {
            drift: {
                "slots_changed_worst_layer <= 0.10": block["policies"]["incremental"]["slots_changed_worst_layer"] <= 0.10,
                "max_over_mean <= 1.01": block["policies"]["incremental"]["max_over_mean"] <= 1.01,
                "rows_inter_node < node-blind's": block["policies"]["incremental"]["rows_inter_node"]
                < block["policies"]["incremental_node_blind"]["rows_inter_node"],
            }
            for drift, block in out["drifts"].items() if 0.1 <= float(drift) <= 0.15
        }
    if args.png:
        plot(out, args.png)
        out["png"] = args.png
    print(json.dumps(out))


if __name__ == "__main__":
    main()
