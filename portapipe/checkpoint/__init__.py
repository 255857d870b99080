"""Portable checkpoints: logical state under the single-process model's names, written with
torch.distributed.checkpoint, resumable under any layout, schedule, balancer and backend.

- :mod:`.files`: the folder on disk (DCP files + a manifest written last), checks, listing.
- :mod:`.state`: a rank's model, optimizer, balancer and RNG as logical tensors, and back.
- :mod:`.io`: saving (in the background where it fits) and loading on the ranks.
- :mod:`.run`: one run per folder: run ids, the folder lock, what a run starts from.

:func:`load_model_state` reads a checkpoint's model in one process (no process group), for
conversion and inspection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .files import CheckpointError, Entry, atomic_write, newest_complete, resolve, scan, verify
from .run import RunPlan, checkpoint_root, prepare_run

__all__ = [
    "CheckpointError",
    "Entry",
    "RunPlan",
    "atomic_write",
    "checkpoint_root",
    "list_checkpoints",
    "load_model_state",
    "newest_complete",
    "prepare_run",
    "resolve",
    "verify",
]


def load_model_state(path: str | Path, ema: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The logical model state of a checkpoint and the config it was written with.

    ``path`` is a checkpoint folder, or a folder of checkpoints (its newest complete one). The
    state holds parameters and persistent buffers under the single-process model's names, routed
    experts one per logical expert (``expert_key`` names), as CPU tensors. With ``ema`` the
    parameters are the host EMA of the weights (``train.ema_decay``), cast to the parameters'
    dtype; ValueError when the checkpoint holds none. Raises CheckpointError when there is no
    complete checkpoint there.
    """
    from .files import load_no_dist, read_dcp_metadata

    entry = resolve(Path(path))
    meta = read_dcp_metadata(entry.path)

    def empty(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix)}

    model = empty("model.")
    averaged = empty("ema.") if ema else {}
    if ema and not averaged:
        raise ValueError("holds no EMA of the weights (its run did not set train.ema_decay); export it without --ema")
    load_no_dist(entry.path, {"model": model, **({"ema": averaged} if averaged else {})})
    for name, t in averaged.items():
        model[name] = t.to(model[name].dtype)
    assert entry.manifest is not None
    return model, entry.manifest["config"]


def list_checkpoints(folder: str | Path) -> list[dict[str, Any]]:
    """Every checkpoint folder in ``folder`` (or its ``checkpoints/``), oldest first, as JSON-ready
    records: path, step, run id, layout, complete or not and why not."""
    folder = Path(folder)
    roots = [folder] if scan(folder) or not (folder / "checkpoints").is_dir() else [folder / "checkpoints"]
    return [verify(d).as_json() for root in roots for d in scan(root)]
