"""A balancer's per-step collectives, each against what it replaced, on gloo ranks; prints one JSON object.

1. The replica gradient sum: between each expert's holders against an all-reduce over the EP group.
2. After-step's figures: one fixed-shape float64 row per rank (one all-gather) against
   ``all_gather_object`` of the same dicts.

Run: ``python benchmarks/balancer_collectives.py [--ep 4] [--redundant 1] [--reps 20]``. Shapes are balance_e2e's model
(4 MoE layers of 12 experts, hidden 64, moe_hidden 1024, float32); each rank holds its share
of the experts and ``redundant`` copies of the next ranks' first experts (a placement's replicas
spread over the ranks, as a load-planned EPLB layout has them). Both paths (``exchange`` between holders, ``all_reduce``) run in turns on the same gloo ranks (one
thread each); prints the median wall time per step of each and the bytes each rank sends
(a ring all-reduce sends 2 (ep - 1) / ep of the buffer). The figures are those of 4 MoE layers
on every rank (a rank of balance_e2e's ``ep4`` layout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

LAYERS, EXPERTS, HIDDEN, MOE_HIDDEN = 4, 12, 64, 1024


def _rank(backend: Any, ep: int, redundant: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from portapipe.balancing.placement import ExpertPlacement
    from portapipe.balancing.replica_sum import exchange_pays, holder_plan, sum_over_holders

    rank = dist.get_rank()
    own = EXPERTS // ep
    row = [e for r in range(ep) for e in list(range(r * own, (r + 1) * own)) + [((r + 1 + k) % ep) * own for k in range(redundant)]]
    p = ExpertPlacement(torch.tensor([row] * LAYERS), ep, EXPERTS)
    per = p.phy2log.shape[1] // ep
    grads = [torch.randn(per, n) for _ in range(LAYERS) for n in (2 * MOE_HIDDEN * HIDDEN, HIDDEN * MOE_HIDDEN)]
    plans = [holder_plan(p.phy2log[layer], ep, rank) for layer in range(LAYERS)]
    jobs = [(g, plans[i // 2]) for i, g in enumerate(grads)]
    paths = {how: (lambda how=how: sum_over_holders(jobs, backend, None, ep, rank, how)) for how in ("exchange", "all_reduce")}

    from portapipe.balancing.step_figures import gather_figures

    mine = {"pp_rank": 0, "layers": list(range(LAYERS)), "rank_loads": torch.rand(LAYERS, ep).tolist(), "orig_loads": [],
            "replica_tokens": 12.0, "switch": {"gain_s": 0.01, "cost_s": 0.02, "refresh_s": 0.0}, "event": None, "dp_rank": 0}
    world = dist.get_world_size()

    def objects() -> int:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, mine)
        return 0

    def rows() -> int:
        gather_figures(backend, mine, LAYERS, ep, world)
        return 0

    paths["figures_tensor"] = rows
    paths["figures_object"] = objects
    times: dict[str, list[float]] = {name: [] for name in paths}
    sent = {}
    for _ in range(reps):
        for name, fn in paths.items():
            dist.barrier()
            t0 = time.perf_counter()
            sent[name] = fn()
            times[name].append(time.perf_counter() - t0)
    auto = exchange_pays(jobs, ep)
    return {"auto": "exchange" if auto else "all_reduce", **{name: {"median_ms": 1e3 * statistics.median(t), "bytes_sent": sent[name]} for name, t in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from portapipe.ranks.launch import run_ranks

    out = run_ranks(_rank, args.ep, args.ep, args.redundant, args.reps, wall_timeout_s=600)
    from portapipe.balancing.replica_sum import EXCHANGE_PER_BYTE

    paths = [{"path": name, "median_ms_per_rank": [round(r[name]["median_ms"], 3) for r in out],
              "bytes_sent_per_rank": [r[name]["bytes_sent"] for r in out]}
             for name in ("exchange", "all_reduce", "figures_tensor", "figures_object")]
    print(json.dumps({"benchmark": "balancer_collectives", "ep": args.ep, "redundant": args.redundant, "paths": paths,
                      "auto_takes": out[0]["auto"], "exchange_per_byte": EXCHANGE_PER_BYTE}))


if __name__ == "__main__":
    main()
