"""``portapipe balance``: plan expert replication and placement for recorded loads, and what it costs.

Loads ``[layers, experts]`` come from any file :mod:`portapipe.balancing.loads_file` reads
(``.csv`` / ``.txt``, ``.json`` such as a run's ``expert_loads.json``, ``.pt``). ``--current`` reads the
placement in force (phy2log ``[layers, slots]``) the same way, key ``phy2log`` (so the ``--json``
output of an earlier run works); without it the placement is the one training starts from
(slot s holds expert s mod E).

The default policy is training's: ``incremental`` changes ``--current`` by few slots, and plans
a first placement with ``refined`` when there is no ``--current``. Prints what ran, a comparison
of every policy (slots changed, bytes moved within and between nodes, max / mean GPU load
before and after), then the plan per layer. Bad input exits 2 with one line per problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from ..balancing.cost import DTYPE_BYTES, OPTIMIZER_STATES, migration_cost, slot_bytes
from ..balancing.eplb import POLICIES, gpu_loads, lower_bound, policy_run, rebalance_experts
from ..balancing.loads_file import read_loads, read_table
from ..balancing.placement import ExpertPlacement

#: one routed expert of DeepSeek-V3: gate, up and down projections of 7168 x 2048
DEEPSEEK_V3_EXPERT = 3 * 7168 * 2048


def shape_problems(experts: int, replicas: int, groups: int, nodes: int, gpus: int) -> list[str]:
    """One line per rule the numbers break; the config's balancer checks apply the same rules."""
    out = []
    for flag, value in (("--replicas", replicas), ("--groups", groups), ("--nodes", nodes), ("--gpus", gpus)):
        if value < 1:
            out.append(f"{flag} must be a positive integer, got {value}")
    if out:
        return out
    if replicas < experts:
        out.append(f"--replicas {replicas} < {experts} experts: every expert needs a slot")
    if replicas % gpus:
        out.append(f"--replicas {replicas} is not a multiple of --gpus {gpus}")
    if experts % groups:
        out.append(f"--groups {groups} does not divide the {experts} experts")
    if gpus % nodes:
        out.append(f"--nodes {nodes} does not divide --gpus {gpus}")
    return out


def ran_label(policy: str, groups: int, nodes: int, has_current: bool) -> tuple[str, str]:
    """(policy that runs, how to say so)."""
    if policy == "incremental" and not has_current:
        return "refined", "refined (the first placement: incremental needs --current)"
    ran = policy_run(policy, groups, nodes)
    if ran != policy:
        return ran, f"global (hierarchical needs --groups % --nodes == 0: {groups} % {nodes} = {groups % nodes})"
    return ran, ran


def _imbalance(w: torch.Tensor, phy2log: torch.Tensor, gpus: int) -> torch.Tensor:
    """Max / mean GPU load per layer (1.0 = perfect; an idle layer scores 1)."""
    load = gpu_loads(w, phy2log, gpus)
    mean = load.mean(1)
    return torch.where(mean > 0, load.max(1).values / mean.clamp(min=1e-300), torch.ones_like(mean))


def compare(w: torch.Tensor, current: torch.Tensor, args: argparse.Namespace, per_slot: int) -> dict[str, dict[str, Any]]:
    """Every policy from ``current``: slots changed, rows and bytes moved, max / mean load before and after."""
    before = _imbalance(w, current, args.gpus)
    out: dict[str, dict[str, Any]] = {"keep": _row(w, current, current, args, per_slot, before)}
    for policy in POLICIES:
        ran, _ = ran_label(policy, args.groups, args.nodes, args.current is not None)
        try:
            plan = _plan(w, args, ran, current)[0]
        except ValueError as exc:  # e.g. a current placement breaking the slot rule: this row cannot run
            out[policy] = {"ran": ran, "not_possible": str(exc)}
            continue
        out[policy] = {"ran": ran, **_row(w, current, plan, args, per_slot, before)}
    return out


def _plan(w: torch.Tensor, args: argparse.Namespace, ran: str, current: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if ran != "incremental":
        return rebalance_experts(w, args.replicas, args.groups, args.nodes, args.gpus, policy=ran)
    try:
        return rebalance_experts(w, args.replicas, args.groups, args.nodes, args.gpus, policy=ran, current=current,
                                 max_moved=args.max_moved, min_gain=args.min_gain)
    except ValueError as exc:  # the shape was checked up front: what is left concerns --current
        raise ValueError(f"{args.current}: {exc}") from None


def _row(w: torch.Tensor, current: torch.Tensor, plan: torch.Tensor, args: argparse.Namespace, per_slot: int,
         before: torch.Tensor) -> dict[str, Any]:
    cost = migration_cost(current, plan, args.gpus, args.nodes)
    after = _imbalance(w, plan, args.gpus)
    return {
        **cost.bytes(per_slot),
        "slots_changed_fraction": int(cost.changed.sum()) / plan.numel(),
        "rows_local": int(cost.local.sum()),
        "max_over_mean_before": float(before.mean()),
        "max_over_mean_after": float(after.mean()),
        "max_over_mean_after_worst": float(after.max()),
    }


def plan_report(w: torch.Tensor, args: argparse.Namespace, current: torch.Tensor) -> dict[str, Any]:
    """The plan of the chosen policy, its figures and the comparison of every policy, as plain data."""
    ran, label = ran_label(args.policy, args.groups, args.nodes, args.current is not None)
    phy2log, log2phy, logcnt = _plan(w, args, ran, current)
    per_slot = slot_bytes(args.expert_params, args.dtype, args.optimizer, args.state_dtype, args.master_dtype)
    load = gpu_loads(w, phy2log, args.gpus, logcnt)
    top, mean = load.max(1).values, load.mean(1)
    lb = lower_bound(w, args.replicas, args.gpus)
    return {
        "policy": args.policy,
        "ran": label,
        "layers": w.shape[0],
        "experts": w.shape[1],
        "replicas": args.replicas,
        "groups": args.groups,
        "nodes": args.nodes,
        "gpus": args.gpus,
        "current": args.current or "identity (slot s holds expert s mod E)",
        "bytes_per_slot": per_slot,
        "balancedness": torch.where(top > 0, mean / top.clamp(min=1e-300), torch.ones_like(top)).tolist(),
        "max_load": top.tolist(),
        "lower_bound": lb.tolist(),
        "max_over_lower_bound": torch.where(lb > 0, top / lb.clamp(min=1e-300), torch.ones_like(lb)).tolist(),
        "compare": compare(w, current, args, per_slot),
        "phy2log": phy2log.tolist(),
        "log2phy": log2phy.tolist(),
        "logcnt": logcnt.tolist(),
    }


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _print_text(r: dict[str, Any]) -> None:
    per_gpu = r["replicas"] // r["gpus"]
    print(f"policy {r['ran']}: {r['layers']} layers x {r['experts']} experts -> {r['replicas']} slots on "
          f"{r['gpus']} GPUs ({per_gpu} per GPU), {r['nodes']} nodes, {r['groups']} groups")
    print(f"from {r['current']}; {_size(r['bytes_per_slot'])} per slot (parameters and optimizer state)")
    print(f"{'policy':<21}{'slots changed':>16}{'moved in node':>15}{'across nodes':>14}   max/mean GPU load: before -> after (worst layer)")
    for name, c in r["compare"].items():
        shown = name if c.get("ran", name) == name else f"{name}>{c['ran']}"
        if "not_possible" in c:
            print(f"{shown:<21}not possible: {c['not_possible']}")
            continue
        print(f"{shown:<21}{c['slots_changed']:>8} ({100 * c['slots_changed_fraction']:4.1f}%){_size(c['bytes_intra_node']):>15}"
              f"{_size(c['bytes_inter_node']):>14}   {c['max_over_mean_before']:.4f} -> {c['max_over_mean_after']:.4f} "
              f"({c['max_over_mean_after_worst']:.4f})")
    for layer, p2l in enumerate(r["phy2log"]):
        print(f"layer {layer}: balancedness {r['balancedness'][layer]:.4f}, max GPU load {r['max_load'][layer]:.6g}, "
              f"lower bound {r['lower_bound'][layer]:.6g} (x{r['max_over_lower_bound'][layer]:.4f})")
        for g in range(r["gpus"]):
            print(f"  GPU {g}: experts {p2l[g * per_gpu:(g + 1) * per_gpu]}")
    print(f"mean balancedness {sum(r['balancedness']) / len(r['balancedness']):.4f}")


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """(loads, current placement), or ValueError with one line per problem."""
    w = read_loads(args.loads)
    problems = shape_problems(w.shape[1], args.replicas, args.groups, args.nodes, args.gpus)
    if not 0 <= args.max_moved <= 1:
        problems.append(f"--max-moved {args.max_moved} is a fraction of the slots, in [0, 1]")
    if not args.min_gain >= 0:
        problems.append(f"--min-gain {args.min_gain} must be >= 0")
    if args.expert_params < 1:
        problems.append(f"--expert-params {args.expert_params} must be a positive integer")
    if problems:
        raise ValueError("\n".join(problems))
    if args.current is None:
        return w, ExpertPlacement.identity(w.shape[0], w.shape[1], args.gpus, args.replicas).phy2log
    cur = read_table(args.current, "phy2log")
    if tuple(cur.shape) != (w.shape[0], args.replicas):
        raise ValueError(f"{args.current}: phy2log must be [layers, slots] = [{w.shape[0]}, {args.replicas}], got {list(cur.shape)}")
    if not bool((cur == cur.round()).all()):
        raise ValueError(f"{args.current}: phy2log must hold whole expert ids")
    if not bool(((cur >= 0) & (cur < w.shape[1])).all()):  # before the int64 cast, which would wrap huge ids
        raise ValueError(f"{args.current}: phy2log entries must lie in [0, {w.shape[1]}); got [{cur.min():g}, {cur.max():g}]")
    try:
        ExpertPlacement(cur.to(torch.int64), args.gpus, w.shape[1])  # ids in range, every expert placed
    except ValueError as exc:
        raise ValueError(f"{args.current}: {exc}") from None
    return w, cur.to(torch.int64)


def run(args: argparse.Namespace) -> int:
    try:
        w, current = _inputs(args)
        report = plan_report(w, args, current)
    except ValueError as err:
        for line in str(err).splitlines():
            print(f"portapipe balance: {line}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        _print_text(report)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("balance", help="plan expert replication and placement (EPLB) for recorded loads, and its cost")
    p.add_argument("--loads", required=True, help="loads [layers, experts]: .csv / .txt (commas or spaces), .json or .pt")
    p.add_argument("--replicas", type=int, required=True, help="physical expert slots R in all (>= experts, multiple of --gpus)")
    p.add_argument("--groups", type=int, required=True, help="expert groups (group-limited routing); must divide the experts")
    p.add_argument("--nodes", type=int, required=True, help="nodes the GPUs span; must divide --gpus")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (expert-parallel ranks)")
    p.add_argument("--policy", choices=POLICIES, default="incremental",
                   help="as in training (default incremental: from --current, else a first placement by refined); "
                        "refined; hierarchical (published; global when groups %% nodes != 0); global")
    p.add_argument("--current", help="the placement in force, phy2log [layers, slots], in the loads formats (key phy2log)")
    p.add_argument("--max-moved", type=float, default=0.1, help="incremental: at most this fraction of a layer's slots change")
    p.add_argument("--min-gain", type=float, default=0.0,
                   help="incremental: balancedness a full migration must win (scaled by the fraction of slots moved)")
    p.add_argument("--expert-params", type=int, default=DEEPSEEK_V3_EXPERT,
                   help=f"parameters of one expert (default {DEEPSEEK_V3_EXPERT}: DeepSeek-V3's 3 x 7168 x 2048)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="parameter dtype")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw", help="optimizer states moved with each slot")
    p.add_argument("--state-dtype", choices=sorted(DTYPE_BYTES), help="optimizer state dtype (default: the parameter dtype)")
    p.add_argument("--master-dtype", choices=sorted(DTYPE_BYTES), help="dtype of a master copy of the weights, if kept")
    p.add_argument("--json", action="store_true", help="one line of JSON instead of text")
    p.set_defaults(func=run)
