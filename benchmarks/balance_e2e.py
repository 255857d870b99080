"""Balancers end to end: training-step time and EP wait under routing skew; prints one JSON object.

One launch of gloo ranks per layout (``ep2``: 2 ranks, ep 2, one rank per core here; ``ep4``: 4
ranks, ep 4; ``pp2ep4``: 8 ranks, pp 2 x ep 4) training a small MoE-dominated Qwen3-MoE-shaped
model (wide routed experts, no shared expert, a narrow attention). In the same processes it
builds one training run per variant and steps them in turns, step by step, each step starting at
a barrier, so a change in machine load hits every variant alike (paired steps). Routing sources:

- ``trained``: the model trained by portapipe itself (``portapipe train``, 2 ranks, no load
  balancing: the Qwen3-MoE router has no bias and the run has no auxiliary loss) until its
  routing skewed, exported as a Hugging Face folder and loaded with ``model.init_from``. It is
  trained once and kept in ``--trained-dir`` (retrained when the model or the recipe changes);
- ``loads``: ``bench.router_skew_from`` (``--loads``, default examples/expert_loads.txt, whose
  first row has max / mean 2.19): each token's experts drawn in proportion to the file's loads;
- ``uniform``: ``bench.force_uniform_routing`` (round-robin: every expert the same rows), the
  peers' benchmark mode: the upper bound for the skewed sources, and a balanced router on which
  the balancers should stay off;

and balancer: ``none``, ``eplb`` (incremental, redundant 1, rebalancing every 2 steps on the
last 2 steps' loads, ``min_gain: auto``) and ``lplb`` (ring, redundant 1, ``min_gain: auto``; its
placement is EPLB's packing of the window's loads, so it is EPLB + LPLB), both with ``stay_off``
(``--balancers`` picks them; ``lplb_on`` adds LPLB with ``stay_off: false``, its LP and replica
gradient sum in every step, to show what the switch's decisions are worth). Per variant, over
the steps after ``--warmup``: median step time (the whole iteration: step, figures, optimizer,
the balancer's after-step; slowest rank), median ``ep_wait_frac`` and ``rank_balancedness``, the
balancer's own time per step (after-step planning and migration; the replicas' measured cost:
LP and replica gradient sum), bytes migrated, the steps the replicas were in use, and the median
over paired steps of the step-time ratio to the same source without a balancer. Then for each
skewed source the share of the gap (none -> uniform routing) each balancer wins back, in step
time (paired ratios) and in EP wait; for the uniform source what each balancer costs against
none (paired ratio - 1). How skewed each source is: max / mean of its expert loads (mean over
layers) and the rank balancedness without a balancer.

Step times are wall clock (load averages recorded); the EP wait is measured from processor time
(see portapipe/models/expert_clock.py). Each rank runs the usable cores / ranks intra-op threads;
``--pin-cores true`` (``launch.pin_cores``) binds each rank to cores of its own, one thread per
core (a rank waiting on its EP peer then leaves its own cores idle, as a GPU would); each layout's
``placement`` gives every rank's cores and threads.

    python benchmarks/balance_e2e.py [--layouts ep2 ep4 pp2ep4] [--sources ...] [--balancers none eplb lplb lplb_on] [--steps 12] [--warmup 3]
        [--pin-cores auto|true|false] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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

from portapipe.ranks import pinning# noqa: E402
from portapipe.config import load_config  # noqa: E402
from portapipe.ranks.launch import rank_threads, run_ranks  # noqa: E402

# ep2: one rank per core of a 2-core machine, where a rank waiting on its EP peer leaves its core idle
# (with more ranks than cores a waiting rank hands its core to another, and the wait costs less wall time)
LAYOUTS = {"ep2": {"pp": 1, "ep": 2, "dp": 1}, "ep4": {"pp": 1, "ep": 4, "dp": 1}, "pp2ep4": {"pp": 2, "ep": 4, "dp": 1}}
BALANCERS = {
    "none": {"kind": "none"},
    "eplb": {"kind": "eplb", "redundant": 1, "interval": 2, "window": 2, "policy": "incremental", "min_gain": "auto"},
    "lplb": {"kind": "lplb", "redundant": 1, "topology": "ring", "interval": 2, "window": 2, "min_gain": "auto"},
}
# (--balancers) LPLB with its replicas never switched off: what the replica switch spares or misses
BALANCERS["lplb_on"] = {**BALANCERS["lplb"], "stay_off": False}
DEFAULT_BALANCERS = ("none", "eplb", "lplb")
SOURCES = ("trained", "loads", "uniform")
SKEWED = ("trained", "loads")
MODEL = {"arch": "qwen3_moe", "vocab_size": 256, "hidden": 64, "n_layers": 4, "n_dense": 0, "n_heads": 2, "ffn_hidden": 64,
         "moe_hidden": 1024, "n_experts": 12, "n_shared": 0, "top_k": 4, "seq_len": 64}
MICRO_BATCH = 8
# how the trained source is made: 2 ranks, constant lr, no load balancing
RECIPE = {"parallel": {"pp": 1, "ep": 2, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 4},
          "train": {"micro_batch_size": MICRO_BATCH, "lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 5}}


def variant_config(layout: str, source: str, balancer: str, loads: str, log_dir: Path, steps: int,
                   trained: Path | None = None) -> dict[str, Any]:
    model = dict(MODEL)
    bench: dict[str, Any] = {}
    if source == "trained":
        model["init_from"] = str(trained)
    elif source == "loads":
        bench["router_skew_from"] = loads
    else:
        bench["force_uniform_routing"] = True
    return load_config(
        {
            "backend": "cpu",
            "parallel": LAYOUTS[layout],
            "schedule": {"name": "1f1b", "microbatches": 4},
            "model": model,
            "balancer": BALANCERS[balancer],
            "bench": bench,
            "train": {"steps": steps, "micro_batch_size": MICRO_BATCH, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0},
            "log": {"dir": str(log_dir), "progress": False},
            "checkpoint": {"every": 0},
        }
    ).to_dict()


def trained_model(folder: Path, steps: int) -> Path:
    """The Hugging Face folder of the trained source, trained and exported once into ``folder``
    (again when the model or the recipe changed). Returns the exported folder."""
    from portapipe.cli import main as cli

    recipe = {"model": MODEL, **RECIPE, "steps": steps}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    out = folder / f"hf-{key}"
    if (out / "config.json").is_file():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    run = folder / f"run-{key}"
    raw = {"backend": "cpu", "model": MODEL, **RECIPE, "log": {"dir": str(run), "progress": False},
           "checkpoint": {"every": 0, "overwrite": True}}
    raw["train"] = {**RECIPE["train"], "steps": steps}
    cfg = folder / f"train-{key}.json"
    cfg.write_text(json.dumps(raw, indent=1))
    print(f"balance_e2e: training the skewed source ({steps} steps, 2 ranks) into {run}", file=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries this benchmark's JSON only
        ok = cli(["train", str(cfg)]) == 0 and cli(["export", str(run), str(out), "--format", "hf"]) == 0
    if not ok:
        raise SystemExit(f"balance_e2e: could not train or export the trained source in {folder}")
    return out


def _rank(backend: Any, raws: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """Every variant's training, stepped in turns: each step's figures (rank 0's are the job's) and
    this rank's cores and threads."""
    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.data.batches import Batches, replica_of
    from portapipe.metrics.step import ep_step_figures, gather_step_stats
    from portapipe.models.routing import force_routing
    from portapipe.training.update import counted_blocks, make_sharded_optimizer

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
        runs[name] = (config, groups, runtime, optimizer, Batches(config))
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for step in range(steps):
        for name, (config, groups, runtime, optimizer, data) in runs.items():
            replica, replicas = replica_of(groups)
            batches = data.microbatches(step, replica, replicas, config.schedule.microbatches, config.train.micro_batch_size,
                                        config.model.seq_len)
            backend.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            result = runtime.step(batches)
            c1 = time.process_time()
            ep = ep_step_figures(backend, groups, runtime.moe_layers())
            stats = gather_step_stats(backend, float(optimizer.local_sq_norm(counted_blocks(runtime.schedule, groups.pp_rank))), result, ep)
            c2 = time.process_time()
            with torch.no_grad():
                optimizer.step(1.0)
            runtime.grads.zero_grad()
            c3 = time.process_time()
            # the after-step's timer starts with every rank there: its first collective would
            # otherwise count the ranks' uneven arrival (pipeline stages, scheduling on a full host)
            backend.barrier()
            t1, c4 = time.perf_counter(), time.process_time()
            balance = runtime.balancer.after_step(step, result, optimizer) if runtime.balancer is not None else {}
            t2, c5 = time.perf_counter(), time.process_time()
            # the slowest rank's iteration and balancer time; processor time (all of a rank's
            # threads) of its step, optimizer and after-step, the largest over ranks
            times = torch.tensor([t2 - t0, t2 - t1, c1 - c0, c3 - c2, c5 - c4], dtype=torch.float64)
            backend.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
            out[name].append({"step_s": float(times[0]), "after_step_s": float(times[1]), "step_cpu_s": float(times[2]),
                              "optimizer_cpu_s": float(times[3]), "after_step_cpu_s": float(times[4]),
                              "ep_wait_frac": stats.ep_wait_frac, "rank_balancedness": stats.rank_balancedness, "balancer": balance,
                              "expert_counts": None if result.expert_counts is None else result.expert_counts.tolist()})
    return {"steps": out, "placement": pinning.placement()}


def summarise(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the steps after ``warmup``; migrations over every step (the first placement too)."""
    med = statistics.median
    rebalances = [s["balancer"]["rebalance"] for s in steps if "rebalance" in s["balancer"]]
    steps = steps[warmup:]
    used = [s["balancer"]["replicas_used"] for s in steps if "replicas_used" in s["balancer"]]
    cost = [s["balancer"]["replica_cost_ms"] for s in steps if s["balancer"].get("replicas_used")]
    out = {
        "step_s": round(med(s["step_s"] for s in steps), 4),
        "ep_wait_frac": round(med(s["ep_wait_frac"] for s in steps), 4),
        "rank_balancedness": round(med(s["rank_balancedness"] for s in steps), 4),
        "after_step_ms": round(1e3 * med(s["after_step_s"] for s in steps), 2),
        **{f"{key}_cpu_ms": round(1e3 * med(s[f"{key}_cpu_s"] for s in steps), 2)
           for key in ("step", "optimizer", "after_step") if all(f"{key}_cpu_s" in s for s in steps)},
        "bytes_migrated": sum(r["bytes_moved"] for r in rebalances),
        "rebalances_applied": sum(bool(r["applied"]) for r in rebalances),
    }
    if used:
        out["replicas_used_steps"] = sum(used)
        out["replica_cost_ms_per_step"] = round(med(cost), 3) if cost else 0.0
    return out


def load_skew(steps: list[dict[str, Any]]) -> float | None:
    """max / mean of the expert loads summed over the steps, mean over the MoE layers (rank 0's)."""
    rows = [s["expert_counts"] for s in steps if s.get("expert_counts")]
    if not rows:
        return None
    loads = torch.tensor(rows, dtype=torch.float64).sum(0)  # [layers, experts]
    return round(float((loads.max(1).values / loads.mean(1)).mean()), 3)


def _shown(path: str | Path) -> str:
    """``path`` as the JSON records it: relative to the checkout when inside it (the same on
    every clone), else as given."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    ap.add_argument("--balancers", nargs="+", default=list(DEFAULT_BALANCERS), choices=list(BALANCERS),
                    help="none is always run (every ratio is to it); lplb_on: LPLB with stay_off false")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out (one-time costs, first placement)")
    ap.add_argument("--loads", default=str(ROOT / "examples" / "expert_loads.txt"))
    ap.add_argument("--trained-dir", default=str(ROOT / "benchmarks" / ".cache" / "balance_e2e"),
                    help="where the trained source is kept (trained on first use)")
    ap.add_argument("--train-steps", type=int, default=60, help="steps the trained source is trained for")
    ap.add_argument("--out-dir", default=None, help="run folders (default: a temporary one)")
    ap.add_argument("--pin-cores", choices=list(pinning.MODES), default="false",
                    help="each rank on cores of its own, one thread per core (launch.pin_cores) [false]")
    args = ap.parse_args()
    pin = pinning.MODES[args.pin_cores]
    for layout in args.layouts:  # a layout the cores cannot pin is refused before any runs
        pinning.plan(pin, LAYOUTS[layout]["pp"] * LAYOUTS[layout]["ep"])
    import tempfile

    if "uniform" not in args.sources:
        ap.error("--sources needs uniform: it is the upper bound of the skewed sources and the balanced router")
    balancers = ["none"] + [b for b in args.balancers if b != "none"]
    trained = trained_model(Path(args.trained_dir), args.train_steps) if "trained" in args.sources else None
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="balance_e2e-"))
    result: dict[str, Any] = {
        "benchmark": "balance_e2e",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cores_usable": len(pinning.usable_cores()),
        "torch": torch.__version__,
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
        "steps": args.steps,
        "warmup": args.warmup,
        "balancers": balancers,
        "loads": _shown(args.loads),
        "trained": None if trained is None else {"folder": _shown(trained), "train_steps": args.train_steps},
        "layouts": {},
    }
    for layout in args.layouts:
        raws = {f"{source}:{bal}": variant_config(layout, source, bal, args.loads, root / layout / f"{source}-{bal}", args.steps, trained)
                for source in args.sources for bal in balancers}
        world = LAYOUTS[layout]["pp"] * LAYOUTS[layout]["ep"]
        t0 = time.perf_counter()
        ranks = run_ranks(_rank, world, raws, args.steps, threads=rank_threads(world), wall_timeout_s=3600, pin_cores=pin)
        steps = ranks[0]["steps"]
        table = {name: summarise(s, args.warmup) for name, s in steps.items()}

        def paired(name: str, base: str) -> float:
            """Median over the paired steps (same step number, run in turn) of the step-time ratio."""
            return statistics.median(a["step_s"] / b["step_s"] for a, b in zip(steps[name][args.warmup:], steps[base][args.warmup:]))

        for name in table:
            table[name]["paired_ratio_vs_none"] = round(paired(name, name.split(":")[0] + ":none"), 4)
        top = table["uniform:none"]
        won: dict[str, Any] = {}
        skew: dict[str, Any] = {}
        for source in (s for s in SKEWED if s in args.sources):
            none = table[f"{source}:none"]
            top_ratio = paired("uniform:none", f"{source}:none")
            skew[source] = {"expert_load_max_over_mean": load_skew(steps[f"{source}:none"]),
                            "rank_balancedness": none["rank_balancedness"], "uniform_over_none": round(top_ratio, 4)}
            for bal in balancers[1:]:
                row = table[f"{source}:{bal}"]
                gap_w = none["ep_wait_frac"] - top["ep_wait_frac"]
                won[f"{source}:{bal}"] = {
                    "step_time": round((1 - paired(f"{source}:{bal}", f"{source}:none")) / (1 - top_ratio), 3) if top_ratio < 1 else None,
                    "ep_wait": round((none["ep_wait_frac"] - row["ep_wait_frac"]) / gap_w, 3) if gap_w > 0 else None,
                }
        cost = {bal: round(table[f"uniform:{bal}"]["paired_ratio_vs_none"] - 1, 4) for bal in balancers[1:]}
        result["layouts"][layout] = {"ranks": world, "seconds": round(time.perf_counter() - t0, 1),
                                     "placement": pinning.summary(pin, [r["placement"] for r in ranks]), "skew": skew,
                                     "variants": table, "gap_won_back": won, "balanced_router_cost_frac": cost}
    result["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
