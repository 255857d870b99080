"""Checkpoint save and load time and bytes: portapipe's logical DCP checkpoint against torch.save.

The memory benchmark's model (benchmarks/memory.py: 2 gloo ranks, pp 1 x ep 2, hidden 1024, 16
experts of width 288, float32) after one AdamW step. Per repetition, every rank:

- ours: ``Checkpointer.save_training`` (logical names, experts per expert, DCP files, checksums,
  manifest, rename), waited for; the same in the background (``wait=False``: the time the
  training is held is the logical copy, the rest is written beside it); ``Checkpointer.load`` into
  the model, optimizer and RNG; and the launcher's check of a checkpoint before a resume
  (``files.verify``: manifest, sizes, checksums, every part's run id and step), on rank 0;
- the peer: ``torch.save`` of each rank's own module and optimizer ``state_dict()`` to one file
  per rank (flushed to disk, as DCP does), and ``torch.load`` + ``load_state_dict`` back: the
  layout-bound format portapipe used before.

Times are the slowest rank's, median and fastest over ``--repeats`` (a barrier before and after
each); the files are read back from the page cache in both cases. Prints one JSON object.

    python benchmarks/checkpoint.py [--repeats 3] [--set model.hidden=2048 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import BASE  # noqa: E402  the memory benchmark's model

from portapipe.checkpoint import files  # noqa: E402
from portapipe.checkpoint.io import Checkpointer  # noqa: E402
from portapipe.checkpoint.run import RunPlan  # noqa: E402
from portapipe.config import config_from_dict, load_config  # noqa: E402
from portapipe.data.batches import Batches, replica_of  # noqa: E402
from portapipe.ranks.launch import run_ranks  # noqa: E402
from portapipe.training.update import make_sharded_optimizer  # noqa: E402


def _timed(backend: Any, fn: Any) -> tuple[float, Any]:
    backend.barrier()
    t0 = time.perf_counter()
    out = fn()
    backend.barrier()
    return time.perf_counter() - t0, out


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _torch_save(path: Path, state: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _rank(backend: Any, raw: dict[str, Any], repeats: int, folder: str) -> dict[str, Any]:
    from portapipe.compose import PipelineRuntime

    config = config_from_dict(raw)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    rank, world = groups.rank, groups.world_size
    runtime = PipelineRuntime(config, backend, groups)
    optimizer = make_sharded_optimizer(runtime, config, backend)
    optimizer.lr = config.train.lr
    replica, replicas = replica_of(groups)
    runtime.step(Batches(config).microbatches(0, replica, replicas, config.schedule.microbatches, config.train.micro_batch_size, config.model.seq_len))
    optimizer.step()  # AdamW's moments exist from here on
    runtime.grads.zero_grad()
    plan = RunPlan(run_id="bench", root=str(Path(folder) / "dcp"), mode="new", lr_schedule_steps=1)
    ckpt = Checkpointer(plan, config, backend, rank, world, runtime, optimizer, runtime.balancer)
    trainer = {"progress": {"step": 1}, "lr_schedule_steps": 1, "data": {}}
    peer_dir = Path(folder) / "torch_save"
    peer_dir.mkdir(parents=True, exist_ok=True)
    peer_file = peer_dir / f"rank{rank}.pt"

    def peer_state() -> dict[str, Any]:
        return {"model": {b: m.state_dict() for b, m in runtime.blocks.items()}, "optimizer": optimizer.state_dict(), "rng": backend.get_rng_state()}

    def peer_load() -> None:
        state = torch.load(peer_file, map_location="cpu", weights_only=True)
        for b, m in runtime.blocks.items():
            m.load_state_dict(state["model"][b])
        optimizer.load_state_dict(state["optimizer"])

    times: dict[str, list[float]] = {k: [] for k in ("save_s", "async_held_s", "async_total_s", "load_s", "verify_s", "torch_save_s", "torch_load_s")}
    path = None
    for i in range(repeats):
        dt, path = _timed(backend, lambda: ckpt.save_training(2 * i + 1, trainer, wait=True))
        times["save_s"].append(dt)
        backend.barrier()
        t0 = time.perf_counter()
        ckpt.save_training(2 * i + 2, trainer, wait=False)
        times["async_held_s"].append(time.perf_counter() - t0)
        ckpt.wait()
        backend.barrier()
        times["async_total_s"].append(time.perf_counter() - t0)
        dt, _ = _timed(backend, lambda: ckpt.load(path, runtime, optimizer, runtime.balancer, backend, placement_fits=True))
        times["load_s"].append(dt)
        dt, entry = _timed(backend, lambda: files.verify(path) if rank == 0 else None)
        times["verify_s"].append(dt)
        if rank == 0:
            assert entry.complete, entry.why
        dt, _ = _timed(backend, lambda: _torch_save(peer_file, peer_state()))
        times["torch_save_s"].append(dt)
        dt, _ = _timed(backend, peer_load)
        times["torch_load_s"].append(dt)
    ckpt.close()
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, times)
    state_bytes = sum(t.numel() * t.element_size() for t in [*(p for p in runtime.parameters()), *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))])
    return {
        "times": parts,
        "ours_bytes": _bytes(path) if rank == 0 else None,
        "torch_save_bytes": sum(p.stat().st_size for p in peer_dir.iterdir()) if rank == 0 else None,
        "rank_state_bytes": state_bytes,
    }


def _summary(parts: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for key in parts[0]:
        slowest = [max(p[key][i] for p in parts) for i in range(len(parts[0][key]))]
        out[key] = {"median": statistics.median(slowest), "fastest": min(slowest)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed afterwards)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. model.hidden=2048")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1")
    raw = json.loads(json.dumps(BASE))
    raw["data"] = {"val_fraction": 0.0}
    raw = load_config(raw, args.set).to_dict()
    cfg = config_from_dict(raw)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="portapipe-ckpt-bench-"))
    try:
        per_rank = run_ranks(_rank, cfg.world_size, raw, args.repeats, str(folder), backend=cfg.backend, wall_timeout_s=1800)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    r0 = per_rank[0]
    t = _summary(r0["times"])
    m = cfg.model
    report = {
        "benchmark": "checkpoint",
        "command": "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "setup": {"ranks": cfg.world_size, "pp": cfg.parallel.pp, "ep": cfg.parallel.ep, "hidden": m.hidden, "n_layers": m.n_layers,
                  "n_experts": m.n_experts, "moe_hidden": m.moe_hidden, "dtype": m.dtype, "repeats": args.repeats,
                  "state_bytes_all_ranks": sum(r["rank_state_bytes"] for r in per_rank)},
        "ours": {"bytes": r0["ours_bytes"], **{k: t[k] for k in ("save_s", "async_held_s", "async_total_s", "load_s", "verify_s")}},
        "torch_save": {"bytes": r0["torch_save_bytes"], "save_s": t["torch_save_s"], "load_s": t["torch_load_s"]},
        "ratio": {
            "bytes": r0["ours_bytes"] / r0["torch_save_bytes"],
            "save_s": t["save_s"]["median"] / t["torch_save_s"]["median"],
            "load_s": t["load_s"]["median"] / t["torch_load_s"]["median"],
            "async_held_vs_torch_save": t["async_held_s"]["median"] / t["torch_save_s"]["median"],
        },
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
