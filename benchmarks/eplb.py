"""EPLB speed and balance at DeepSeek-V3 shapes; prints one JSON object.

Times ``rebalance_experts`` for the hierarchical (published), global and refined policies on
lognormal loads (61 layers x 256 experts, 288 slots, 32 GPUs, 4 nodes, 8 groups by default;
sigma 0.75 puts the published policy at about 1.05 x the lower bound on average), reports the
median and minimum wall time and the median processor time of ``--repeats`` runs (the machine
may be shared: medians, and processor time is less stretched by other jobs), the balancedness
and max-load / lower-bound per policy, and, as the peer, the per-layer pure-Python loop
implementation of the same algorithm from the test suite (timed once; its answers must agree).

    python benchmarks/eplb.py --threads 1
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

from portapipe.balancing.eplb import balancedness, gpu_loads, lower_bound, rebalance_experts  # noqa: E402
from portapipe.balancing.slots import duplicated  # noqa: E402

#: the policies that plan from scratch (incremental changes a placement: benchmarks/eplb_migration.py)
POLICIES = ("hierarchical", "global", "refined")


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The placement problem's shape, DeepSeek-V3's by default, and the loads' skew."""
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--replicas", type=int, default=288)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--sigma", type=float, default=0.75, help="lognormal sigma of the expert loads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--no-reference", action="store_true", help="skip the pure-Python loop peer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(args.seed)
    w = torch.exp(torch.randn(args.layers, args.experts, generator=g) * args.sigma)
    shape = (args.replicas, args.groups, args.nodes, args.gpus)
    lb = lower_bound(w, args.replicas, args.gpus)
    out: dict = {
        "benchmark": "eplb",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": args.threads,
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
        "shape": {"layers": args.layers, "experts": args.experts, "replicas": args.replicas, "gpus": args.gpus,
                  "nodes": args.nodes, "groups": args.groups},
        "loads": f"lognormal(0, {args.sigma}), seed {args.seed}",
        "policies": {},
    }
    tops, plans = {}, {}
    for policy in POLICIES:
        rebalance_experts(w, *shape, policy=policy)  # warm-up
        times, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            phy2log, _, logcnt = rebalance_experts(w, *shape, policy=policy)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        top = gpu_loads(w, phy2log, args.gpus, logcnt).max(1).values
        tops[policy], plans[policy] = top, phy2log
        ratio = top / lb
        out["policies"][policy] = {
            "median_ms": round(statistics.median(times) * 1e3, 3),
            "min_ms": round(min(times) * 1e3, 3),
            "median_cpu_ms": round(statistics.median(cpu) * 1e3, 3),  # processor time: less stretched by other jobs
            "balancedness_mean": round(float(balancedness(w, phy2log, args.gpus, logcnt).mean()), 5),
            "max_over_lower_bound_mean": round(float(ratio.mean()), 5),
            "max_over_lower_bound_worst": round(float(ratio.max()), 5),
            "layers_with_an_expert_twice_on_a_gpu": int(duplicated(phy2log, args.gpus).sum()),
        }
    out["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    # refined keeps one replica of an expert per GPU; the published plan does not always
    keeps = ~duplicated(plans["hierarchical"], args.gpus)
    out["refined_never_worse_than_hierarchical_where_it_keeps_one_replica_per_gpu"] = bool((tops["refined"] <= tops["hierarchical"])[keeps].all())
    out["refined_worse_than_hierarchical_layers"] = int((tops["refined"] > tops["hierarchical"]).sum())

    try:
        from tests.test_eplb import ref_layer
    except ModuleNotFoundError:  # run from the installed package: the loop lives in the checkout's tests
        args.no_reference = True
        out["peer_python_loop"] = "not run: the loop is tests/test_eplb.py, in a source checkout"
    if not args.no_reference:
        t0, c0 = time.perf_counter(), time.process_time()
        ref = [ref_layer(row, *shape)[0] for row in w.tolist()]
        elapsed, elapsed_cpu = time.perf_counter() - t0, time.process_time() - c0
        out["peer_python_loop"] = {
            "what": "per-layer pure-Python loop of the same algorithm (tests/test_eplb.py), one run",
            "seconds": round(elapsed, 3),
            "cpu_seconds": round(elapsed_cpu, 3),
            "same_phy2log": ref == rebalance_experts(w, *shape)[0].tolist(),
            "speedup_vs_hierarchical_median": round(elapsed * 1e3 / out["policies"]["hierarchical"]["median_ms"], 1),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
