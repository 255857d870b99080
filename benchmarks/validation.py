"""Validation's cost: the schedule's forwards alone against a full training step thrown away.

The end of a training run evaluates ``VAL_BATCHES`` steps' worth of validation micro-batches.
Before, each ran the whole training step (forwards, backwards, gradient reduction, the routers'
end of step) under :meth:`~portapipe.compose.PipelineRuntime.unchanged` and threw the gradients
away (the peer here, written as it was); now :func:`portapipe.training.validation.validation_loss` runs the
schedule's forwards alone, without gradients. On the config's ranks (examples/cpu.yaml: 4 gloo
ranks, DualPipeV pp 2 x ep 2) the two take turns ``--rounds`` times on the same model; reported
are the medians of each rank's wall time and processor time for the whole validation (the
slowest rank's), the forward-only share of the full step's, and whether the losses agree bit
for bit.

Prints one JSON object.

    python benchmarks/validation.py [--config examples/cpu.yaml] [--rounds 5] [--set k=v ...]
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


def _full_steps(runtime: Any, data: Any, config: Any, groups: Any) -> float:
    """The validation as it was: every batch a training step whose effects are undone."""
    from portapipe.data.batches import replica_of
    from portapipe.training.validation import VAL_BATCHES

    replica, replicas = replica_of(groups)
    losses = []
    for i in range(VAL_BATCHES):
        batches = data.microbatches(i, replica, replicas, config.schedule.microbatches, config.train.micro_batch_size,
                                    config.model.seq_len, split="val")
        with runtime.unchanged():
            losses.append(float(runtime.step(batches).loss))
            runtime.grads.zero_grad()
    return sum(losses) / len(losses)


def _rank(backend: Any, raw: dict[str, Any], rounds: int) -> dict[str, Any]:
    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.data.batches import Batches
    from portapipe.training.validation import validation_loss

    config = config_from_dict(raw)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    runtime = PipelineRuntime(config, backend, groups)
    data = Batches(config)
    ways = {"full_step": lambda: _full_steps(runtime, data, config, groups), "forward_only": lambda: validation_loss(runtime, data, config, groups)[0]}
    ways["full_step"]()  # the first run of each pays one-time costs
    ways["forward_only"]()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    losses: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            backend.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            losses[name].append(way())
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))
    return {"times": times, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "cpu.yaml"))
    ap.add_argument("--rounds", type=int, default=5, help="turns of each way [5]")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    from portapipe.config import load_config
    from portapipe.ranks.launch import rank_threads, run_ranks
    from portapipe.training.validation import VAL_BATCHES

    config = load_config(args.config, args.set)
    load_before = os.getloadavg()
    per_rank = run_ranks(_rank, config.world_size, config.to_dict(), args.rounds, backend=config.backend,
                         threads=rank_threads(config.world_size), wall_timeout_s=1800, low_precision=config.model.dtype == "bfloat16")

    def slowest(name: str, which: int) -> float:
        """The median over rounds of the slowest rank's seconds (0: wall, 1: processor)."""
        return statistics.median(max(r["times"][name][i][which] for r in per_rank) for i in range(args.rounds))

    figures = {name: {"wall_s": slowest(name, 0), "cpu_s": slowest(name, 1)} for name in ("full_step", "forward_only")}
    full, fwd = figures["full_step"], figures["forward_only"]
    out: dict[str, Any] = {
        "benchmark": "validation",
        "command": "python benchmarks/validation.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "config": args.config if not Path(args.config).is_relative_to(ROOT) else str(Path(args.config).relative_to(ROOT)),
        "layout": {"schedule": config.schedule.name, "pp": config.parallel.pp, "ep": config.parallel.ep, "dp": config.parallel.dp,
                   "microbatches": config.schedule.microbatches},
        "val_batches": VAL_BATCHES,
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "full_step": full,
        "forward_only": fwd,
        "forward_only_over_full_step": {"wall": fwd["wall_s"] / full["wall_s"], "cpu": fwd["cpu_s"] / full["cpu_s"]},
        "same_loss": all(r["losses"]["forward_only"] == r["losses"]["full_step"] for r in per_rank),
        "val_loss": per_rank[0]["losses"]["forward_only"][0],
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
