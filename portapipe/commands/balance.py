"""``portapipe balance``: plan expert replication and placement for recorded loads.

Reads ``[layers, experts]`` loads from .pt (a tensor, or a dict with key "loads"), .csv (one
layer per row; a non-numeric header row is skipped) or .json (a list of rows, or {"loads": ...});
a single row is one layer. Prints the plan, balancedness per layer and the lower bound.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..balancing.eplb import POLICIES, balancedness, gpu_loads, lower_bound, rebalance_experts


def read_loads(path: str | Path) -> torch.Tensor:
    """Loads as a float64 [layers, experts] tensor; ValueError naming the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"loads file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    try:
        if suffix == ".pt":
            data: Any = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(data, dict):
                if "loads" not in data:
                    raise ValueError(f"a .pt dict needs the key 'loads'; found {sorted(map(str, data))}")
                data = data["loads"]
        elif suffix == ".json":
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                if "loads" not in data:
                    raise ValueError(f"a JSON object needs the key 'loads'; found {sorted(data)}")
                data = data["loads"]
        elif suffix == ".csv":
            rows = [r for r in csv.reader(p.read_text().splitlines()) if any(c.strip() for c in r)]
            if rows and not _numeric(rows[0]):
                rows = rows[1:]
            data = [[float(c) for c in r if c.strip()] for r in rows]
        else:
            raise ValueError(f"unknown loads format {suffix or '(none)'!r}; use .pt, .csv or .json")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: cannot read loads: not JSON ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None
    except (RuntimeError, TypeError, OSError) as exc:
        raise ValueError(f"{p}: cannot read loads: {exc}") from None
    try:
        w = torch.as_tensor(data, dtype=torch.float64)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{p}: cannot read loads as a [layers, experts] table of numbers: {exc}") from None
    if w.dim() == 1:
        w = w.unsqueeze(0)
    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"{p}: loads must be [layers, experts] numbers, got shape {tuple(w.shape)}")
    return w


def _numeric(row: list[str]) -> bool:
    try:
        [float(c) for c in row if c.strip()]
        return True
    except ValueError:
        return False


def plan_report(w: torch.Tensor, replicas: int, groups: int, nodes: int, gpus: int, policy: str) -> dict[str, Any]:
    """The plan and its figures, as plain data."""
    phy2log, log2phy, logcnt = rebalance_experts(w, replicas, groups, nodes, gpus, policy=policy)
    bal = balancedness(w, phy2log, gpus, logcnt)
    top = gpu_loads(w, phy2log, gpus, logcnt).max(1).values
    lb = lower_bound(w, replicas, gpus)
    ratio = torch.where(lb > 0, top / lb.clamp(min=1e-300), torch.ones_like(lb))
    return {
        "policy": policy,
        "layers": w.shape[0],
        "experts": w.shape[1],
        "replicas": replicas,
        "groups": groups,
        "nodes": nodes,
        "gpus": gpus,
        "balancedness": bal.tolist(),
        "balancedness_mean": float(bal.mean()),
        "max_load": top.tolist(),
        "lower_bound": lb.tolist(),
        "max_over_lower_bound": ratio.tolist(),
        "phy2log": phy2log.tolist(),
        "log2phy": log2phy.tolist(),
        "logcnt": logcnt.tolist(),
    }


def _print_text(r: dict[str, Any]) -> None:
    per_gpu = r["replicas"] // r["gpus"]
    print(f"policy {r['policy']}: {r['layers']} layers x {r['experts']} experts -> {r['replicas']} slots on "
          f"{r['gpus']} GPUs ({per_gpu} per GPU), {r['nodes']} nodes, {r['groups']} groups")
    for layer, p2l in enumerate(r["phy2log"]):
        print(f"layer {layer}: balancedness {r['balancedness'][layer]:.4f}, max GPU load {r['max_load'][layer]:.6g}, "
              f"lower bound {r['lower_bound'][layer]:.6g} (x{r['max_over_lower_bound'][layer]:.4f})")
        for g in range(r["gpus"]):
            print(f"  GPU {g}: experts {p2l[g * per_gpu:(g + 1) * per_gpu]}")
    print(f"mean balancedness {r['balancedness_mean']:.4f}")


def run(args: argparse.Namespace) -> int:
    try:
        w = read_loads(args.loads)
        report = plan_report(w, args.replicas, args.groups, args.nodes, args.gpus, args.policy)
    except ValueError as err:
        print(f"portapipe balance: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        _print_text(report)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("balance", help="plan expert replication and placement (EPLB) for recorded loads")
    p.add_argument("--loads", required=True, help="loads [layers, experts]: .pt, .csv or .json")
    p.add_argument("--replicas", type=int, required=True, help="physical expert slots R in all (>= experts, multiple of --gpus)")
    p.add_argument("--groups", type=int, required=True, help="expert groups (group-limited routing)")
    p.add_argument("--nodes", type=int, required=True, help="nodes the GPUs span")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (expert-parallel ranks)")
    p.add_argument("--policy", choices=POLICIES, default="hierarchical",
                   help="hierarchical (published; global when groups %% nodes != 0), global, or refined")
    p.add_argument("--json", action="store_true", help="one line of JSON instead of text")
    p.set_defaults(func=run)
