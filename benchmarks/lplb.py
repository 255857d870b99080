"""LPLB balance and speed on realistic routing; prints one JSON object.

Routing: 256 experts, top-8, EP 32 (``--tokens`` per rank), Zipf-skewed expert popularity
(expert at popularity rank r has weight 1/(r+1)^skew) with fresh lognormal noise per batch,
tokens drawn by Gumbel top-k. Placement for LPLB and EPLB from the mean counts of ``--history``
earlier batches; both get the same redundant slots (``--redundant`` per rank).

Balance (max / mean rank load, averaged over ``--batches`` batches): no balancing (expert e on
rank e // (E/ep)), EPLB only (replicas from ``rebalance_experts`` with the same slots, each
expert's tokens split evenly over its replicas), and LPLB (``Planner.run`` on all tokens), with
the LP optimum of each batch beside it.

Speed: one ``Planner.run`` of one rank's tokens (count, solve every group's LP, map) with the
compiled CPU path (``lplb_native``, the default where a C compiler is found) and with the torch
path (``use_native=False``), beside scipy's HiGHS (``linprog(method="highs")``) solving the same
group LPs one by one, called in turn ``--repeats`` times in the same process and thread budget
(medians and minima), and ``run`` alone back to back (``run_alone_ms``: as in training, where
it follows the router with the indices still in cache); then every layer's group LPs (``--layers`` x groups) in one batched solve,
by both paths, against HiGHS one by one.

    python benchmarks/lplb.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from portapipe.balancing import lplb_native  # noqa: E402
from portapipe.balancing.eplb import rebalance_experts  # noqa: E402
from portapipe.balancing.lp_balance import BalanceLP  # noqa: E402
from portapipe.balancing.lplb import Planner  # noqa: E402
from portapipe.balancing.topology import TOPOLOGIES  # noqa: E402


def route(gen: torch.Generator, logits: torch.Tensor, ranks: int, tokens: int, top_k: int, noise: float) -> torch.Tensor:
    """One batch: [ranks, tokens, top_k] expert ids; the popularity gets fresh lognormal noise."""
    batch_logits = logits + noise * torch.randn(logits.shape, generator=gen)
    out = []
    for _ in range(ranks):
        u = torch.rand(tokens, logits.numel(), generator=gen).clamp_(1e-9, 1 - 1e-9)
        out.append((batch_logits - torch.log(-torch.log(u))).topk(top_k, dim=1).indices)
    return torch.stack(out)


def highs_group_lps(fixed: np.ndarray, rep: np.ndarray, r2o: np.ndarray) -> list[float]:
    """Each group's LPLB LP (inequality form) solved by HiGHS, one linprog call per group."""
    from scipy.optimize import linprog

    out = []
    g, d = r2o.shape
    n = g * d
    for F, W in zip(fixed, rep):
        a_ub = np.zeros((g, n + 1))
        for i in range(g):
            for k in range(d):
                a_ub[i, i * d + k] -= W[i, k]
                j = r2o[i, k]
                a_ub[i, j * d + k] += W[j, k]
        a_ub[:, n] = -1.0
        c = np.zeros(n + 1)
        c[n] = 1.0
        res = linprog(c, A_ub=a_ub, b_ub=-(F + W.sum(1)), bounds=[(0, 1)] * n + [(None, None)], method="highs")
        out.append(float(res.fun))
    return out


def interleaved(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of each function, calling them in turn ``repeats`` times after a warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def ms(t: tuple[float, float]) -> dict[str, float]:
    return {"median": round(t[0] * 1e3, 3), "min": round(t[1] * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ep", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per EP rank per batch")
    ap.add_argument("--redundant", type=int, default=2, help="redundant slots per rank")
    ap.add_argument("--topology", default="cube", choices=["cube", "hypercube"])
    ap.add_argument("--skew", type=float, default=0.5, help="Zipf exponent of expert popularity")
    ap.add_argument("--noise", type=float, default=0.3, help="lognormal sigma of per-batch popularity noise")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--history", type=int, default=4, help="batches whose mean counts place the experts")
    ap.add_argument("--eplb-groups", type=int, default=8, help="num_groups for rebalance_experts")
    ap.add_argument("--eplb-nodes", type=int, default=4, help="num_nodes for rebalance_experts")
    ap.add_argument("--repeats", type=int, default=51)
    ap.add_argument("--layers", type=int, default=61, help="MoE layers for the all-layers batched solve")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (HiGHS runs on one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]  # other processes share the cores: say how busy they were
    torch.set_num_threads(args.threads)
    E, ep, topo = args.experts, args.ep, args.topology
    r2o = TOPOLOGIES[topo]()
    n_physical = E + args.redundant * ep

    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(E, generator=gen)
    logits = torch.empty(E)
    logits[perm] = -args.skew * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    history = torch.stack(
        [torch.bincount(route(gen, logits, ep, args.tokens, args.top_k, args.noise).flatten(), minlength=E) for _ in range(args.history)]
    ).double().mean(0)

    planner = Planner(r2o, n_physical, E, ep_size=ep)
    planner.update_placement(history, num_groups=args.eplb_groups, num_nodes=args.eplb_nodes)
    phy2log, _, logcnt = rebalance_experts(history.view(1, -1).float(), n_physical, args.eplb_groups, args.eplb_nodes, ep)
    phy2log, logcnt = phy2log[0], logcnt[0]

    ratios: dict[str, list[float]] = {"no_balancing": [], "eplb_only": [], "lplb": [], "lp_optimum": []}
    for _ in range(args.batches):
        idx = route(gen, logits, ep, args.tokens, args.top_k, args.noise)
        counts = torch.bincount(idx.flatten(), minlength=E).double()
        mean = counts.sum() / ep
        ratios["no_balancing"].append(float(counts.view(ep, -1).sum(1).max() / mean))
        eplb_load = (counts[phy2log] / logcnt[phy2log]).view(ep, -1).sum(1)
        ratios["eplb_only"].append(float(eplb_load.max() / mean))
        out = planner.run(idx.view(-1, args.top_k))
        plan = planner.last_plan
        assert torch.equal(torch.bincount(out.flatten(), minlength=n_physical), plan.phys_load)
        ratios["lplb"].append(float(plan.rank_load.max() / mean))
        ratios["lp_optimum"].append(float(plan.lp_objective.max() / mean))

    # Speed: one rank's run beside HiGHS on the same group LPs, alternating call by call so that
    # load from other processes hits both alike.
    rank_idx = route(gen, logits, 1, args.tokens, args.top_k, args.noise)[0]
    native_why = lplb_native.why_unavailable(rank_idx.device)
    timer = Planner(r2o, n_physical, E, ep_size=ep)  # native where available
    timer_torch = Planner(r2o, n_physical, E, ep_size=ep, use_native=False)
    for p in (timer, timer_torch):
        p.update_placement(history, num_groups=args.eplb_groups, num_nodes=args.eplb_nodes)
    counts = torch.bincount(rank_idx.flatten(), minlength=E)
    G, g, d = timer.n_groups, timer.group_size, timer.n_classes
    fixed, rep = timer.group_loads(counts)
    fixed_np, rep_np, r2o_np = fixed.numpy(), rep.numpy(), r2o.numpy()
    times = interleaved(
        {
            "run": lambda: timer.run(rank_idx),
            "run_torch": lambda: timer_torch.run(rank_idx),
            "plan": lambda: timer.plan(counts.unsqueeze(0)),
            "plan_torch": lambda: timer_torch.plan(counts.unsqueeze(0)),
            "highs": lambda: highs_group_lps(fixed_np, rep_np, r2o_np),
        },
        args.repeats,
    )
    # The training path calls run right after the router made the indices (hot in cache) and
    # nothing else in between: the same call back to back, alone.
    alone = interleaved({"run": lambda: timer.run(rank_idx)}, args.repeats * 4)["run"]
    same_indices = torch.equal(timer.run(rank_idx), timer_torch.run(rank_idx))
    ours = timer.last_plan.lp_objective.numpy()
    ours_torch = timer_torch.last_plan.lp_objective.numpy()
    ref = np.array(highs_group_lps(fixed_np, rep_np, r2o_np))

    # Batching: every MoE layer's groups in one solve (e.g. 61 layers x 4 groups) against HiGHS
    # one LP at a time.
    lgen = torch.Generator().manual_seed(args.seed + 1)
    noise = torch.exp(0.3 * torch.randn(args.layers, 1, g, generator=lgen))
    many_fixed = (fixed.unsqueeze(0) * noise).reshape(-1, g)
    many_rep = (rep.unsqueeze(0) * noise.unsqueeze(-1)).reshape(-1, g, d)
    many = BalanceLP(r2o, many_fixed.shape[0])
    many_res = many.solve(many_fixed, many_rep)
    many_torch = many.solve(many_fixed, many_rep, use_native=False)
    batch_times = interleaved(
        {
            "ours": lambda: many.solve(many_fixed, many_rep),
            "ours_torch": lambda: many.solve(many_fixed, many_rep, use_native=False),
            "highs": lambda: highs_group_lps(many_fixed.numpy(), many_rep.numpy(), r2o_np),
        },
        3,
    )
    many_ref = np.array(highs_group_lps(many_fixed.numpy(), many_rep.numpy(), r2o_np))

    def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.max(np.abs(a - b) / np.maximum(b, 1e-12)))

    def speedup(base: str, of: str, t: dict) -> dict[str, float]:
        return {"median": round(t[base][0] / t[of][0], 2), "min": round(t[base][1] / t[of][1], 2)}

    def summary(vals: list[float]) -> dict[str, float]:
        return {"mean": round(statistics.mean(vals), 5), "max": round(max(vals), 5)}

    result = {
        "benchmark": "lplb",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": args.threads,
        "load_avg_1min_before": round(load_before, 2),
        "load_avg_1min_after": round(os.getloadavg()[0], 2),
        "setup": {"experts": E, "ep": ep, "top_k": args.top_k, "tokens_per_rank": args.tokens,
                  "redundant_per_rank": args.redundant, "topology": topo, "groups": G,
                  "zipf_skew": args.skew, "noise_sigma": args.noise, "batches": args.batches, "seed": args.seed},
        "max_over_mean_rank_load": {k: summary(v) for k, v in ratios.items()},
        "lplb_within_1pct_of_lp_optimum": all(a <= b * 1.01 for a, b in zip(ratios["lplb"], ratios["lp_optimum"])),
        "accepted_solves": planner.accepted_solves,
        "fallback_solves": planner.fallback_solves,
        "native_path": native_why or "used (compiled C, lplb_native)",
        "speed_one_layer": {
            "what": f"one rank's Planner.run ({args.tokens} tokens x top-{args.top_k}: count, solve {G} group LPs, map) "
            f"vs scipy HiGHS solving the same {G} LPs one by one; medians of {args.repeats} alternating calls; "
            "run/plan: the default path (native where available), *_torch: use_native=False; run_alone: "
            f"median of {args.repeats * 4} back-to-back calls of run alone",
            "run_ms": ms(times["run"]),
            "run_alone_ms": ms(alone),
            "run_alone_within_0.1ms": alone[0] <= 1e-4,
            "plan_only_ms": ms(times["plan"]),
            "run_torch_ms": ms(times["run_torch"]),
            "plan_only_torch_ms": ms(times["plan_torch"]),
            "highs_ms": ms(times["highs"]),
            "speedup_run_vs_highs": speedup("highs", "run", times),
            "speedup_run_torch_vs_highs": speedup("highs", "run_torch", times),
            "same_indices_native_and_torch": same_indices,
            "lp_iterations": BalanceLP(r2o, G).solve(fixed, rep).iterations,
            "objective_max_rel_diff_vs_highs": rel_diff(ours, ref),
            "objective_max_rel_diff_torch_vs_highs": rel_diff(ours_torch, ref),
        },
        "speed_all_layers_batched": {
            "what": f"{many_fixed.shape[0]} group LPs ({args.layers} layers x {G} groups) in one batched solve vs HiGHS "
            "one by one; medians of 3; ours: default path, ours_torch: use_native=False",
            "ours_ms": ms(batch_times["ours"]),
            "ours_torch_ms": ms(batch_times["ours_torch"]),
            "highs_ms": ms(batch_times["highs"]),
            "speedup": round(batch_times["highs"][0] / batch_times["ours"][0], 2),
            "speedup_torch": round(batch_times["highs"][0] / batch_times["ours_torch"][0], 2),
            "accepted": int(many_res.accepted.sum()),
            "accepted_torch": int(many_torch.accepted.sum()),
            "lp_iterations": many_res.iterations,
            "objective_max_rel_diff_vs_highs": rel_diff(many_res.objective.numpy(), many_ref),
            "objective_max_rel_diff_torch_vs_highs": rel_diff(many_torch.objective.numpy(), many_ref),
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
