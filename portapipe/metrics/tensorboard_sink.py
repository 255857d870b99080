"""The metrics of ``metrics.jsonl`` as TensorBoard scalars (``log.tensorboard: true``, extra ``tensorboard``).

Rank 0 writes them beside the JSONL file, into ``<log.dir>/tensorboard/<run id>/``, so
TensorBoard names the run by its id (``tensorboard --logdir <log.dir>/tensorboard``). The JSONL
file stays the source of truth: when a run starts or resumes, its event files are written afresh
from the lines the JSONL file kept, so a resumed run shows every step once, with the JSONL's
values (stored as float64, bit for bit).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

TB_DIR = "tensorboard"
EXTRA = "pip install 'portapipe[tensorboard]'"


def log_problems(tensorboard: bool) -> list[str]:
    """What stops ``log.tensorboard`` from working here (checked before any rank starts)."""
    if not tensorboard:
        return []
    try:
        import tensorboard as _  # noqa: F401  (torch.utils.tensorboard writes through it)
    except ImportError:
        return [f"log.tensorboard: true needs the tensorboard package: {EXTRA}"]
    return []


def _numbers(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    """Finite numbers of ``values`` under ``prefix/key``, nested dicts flattened (flags and lists left out)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_numbers(f"{prefix}/{key}", value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}/{key}"] = float(value)
    return out


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, {tag: value}) of one metrics line, or None for a line with nothing to chart.

    A line with a ``step`` gives ``<kind>/<key>`` for each number (``train/loss``, ``train/lr``,
    ``train/grad_norm``, ``train/tokens_per_s``, ``train/bubble_pct``, ``train/a2a_hidden_pct``,
    ...) and its balancer figures as ``balancer/<key>``; the summary gives the validation loss
    (``val/loss``) at the run's last step.
    """
    kind = record.get("kind")
    if kind == "summary":
        found = _numbers("val", {"loss": record.get("val_loss")})
        return (int(record["steps"]), found) if found else None
    if not isinstance(record.get("step"), int) or kind == "diverged":
        return None
    rest = {k: v for k, v in record.items() if k not in ("kind", "step", "balancer")}
    found = {**_numbers(str(kind), rest), **_numbers("balancer", record.get("balancer") or {})}
    return (record["step"], found) if found else None


class TensorBoardLog:
    """Rank 0's TensorBoard writer for one run, rebuilt from ``kept`` (the JSONL lines kept)."""

    def __init__(self, log_dir: Path, run_id: str, kept: list[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = log_dir / TB_DIR / run_id
        # Written afresh from the JSONL: steps an interrupted run logged past its checkpoint go.
        for old in self.folder.glob("events.out.tfevents.*"):
            old.unlink()
        self._writer = SummaryWriter(str(self.folder))
        for record in kept:
            self.write(record, flush=False)
        self._writer.flush()

    def write(self, record: dict[str, Any], flush: bool = True) -> None:
        found = scalars(record)
        if found is None:
            return
        step, values = found
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        if flush:  # so a TensorBoard watching the run sees every step as it is written
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()
