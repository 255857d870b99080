"""Checkpoints: one shard per rank plus a manifest, written so that nothing is lost on failure.

``<checkpoint.dir>/step_NNNNNNNN/`` holds ``rankNNNNN.pt`` per rank (model blocks, optimizer,
RNG, progress) and ``manifest.json`` (step, layout, config), written by rank 0 after every
shard is in place. Every file goes to a temporary name and is renamed, so a checkpoint either
has its manifest and is complete, or is ignored; a failure mid-write never damages an earlier
checkpoint. A checkpoint is resumed only into the same layout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from .config import Config

MANIFEST = "manifest.json"


def atomic_write(path: Path, write: Any) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, flush it to disk, rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def layout_of(config: Config) -> dict[str, Any]:
    """What a checkpoint's shards depend on: resuming needs the same layout and model."""
    return {
        "world_size": config.world_size,
        "pp": config.parallel.pp,
        "dp": config.parallel.dp,
        "ep": config.parallel.ep,
        "schedule": config.schedule.name,
        "chunks": config.schedule.chunks if config.schedule.name == "interleaved" else None,
        "model": config.model.model_dump(mode="json"),
    }


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with a manifest) under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step_") and (d / MANIFEST).is_file():
            try:
                found.append((int(d.name[5:]), d))
            except ValueError:
                continue
    return sorted(found)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST).read_text())


def resume_problems(config: Config, ckpt: Path) -> list[str]:
    """Why the checkpoint at ``ckpt`` cannot be resumed with ``config`` (empty when it can)."""
    manifest = read_manifest(ckpt)
    want, have = layout_of(config), manifest.get("layout", {})
    out = []
    for key in want:
        if want[key] != have.get(key):
            out.append(
                f"checkpoint.resume: {ckpt} was written with {key} = {have.get(key)!r} but the config has {want[key]!r}; "
                "use the same setting, another checkpoint.dir, or checkpoint.resume: false"
            )
    missing = [s for s in manifest.get("shards", []) if not (ckpt / s).is_file()]
    if missing:
        out.append(f"checkpoint.resume: {ckpt} lacks shard(s) {', '.join(missing)}")
    if manifest.get("step", 0) > config.train.steps:
        out.append(f"train.steps: {config.train.steps} < step {manifest['step']} of the checkpoint being resumed ({ckpt})")
    return out


def save_checkpoint(root: Path, step: int, rank: int, state: dict[str, Any], config: Config, backend: Any) -> Path:
    """Write this rank's shard; rank 0 writes the manifest once every shard is in place."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / shard_name(rank), lambda f: torch.save(state, f))
    backend.barrier()  # every shard is on disk before the manifest makes the checkpoint valid
    if rank == 0:
        manifest = {
            "step": step,
            "layout": layout_of(config),
            "shards": [shard_name(r) for r in range(config.world_size)],
            "config": config.to_dict(),
            "time": time.time(),
        }
        atomic_write(d / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        for _, old in list_checkpoints(root)[: -config.checkpoint.keep]:
            _remove_checkpoint(old)
    backend.barrier()
    return d


def _remove_checkpoint(d: Path) -> None:
    # The manifest goes first: a half-removed checkpoint is then simply incomplete.
    (d / MANIFEST).unlink(missing_ok=True)
    for f in d.iterdir():
        f.unlink(missing_ok=True)
    d.rmdir()


def load_shard(ckpt: Path, rank: int) -> dict[str, Any]:
    return torch.load(ckpt / shard_name(rank), map_location="cpu", weights_only=False)


def checkpoint_root(config: Config) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else Path(config.log.dir) / "checkpoints"
