"""The metrics file: one JSON object per line in ``<log.dir>/metrics.jsonl``, written by rank 0,
and the sinks each line also goes to (TensorBoard, W&B)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends one JSON object per line to ``<dir>/metrics.jsonl`` (rank 0 only).

    Resuming from step ``resume_step`` drops the lines of later steps that an interrupted run
    left and the summaries of earlier launches, and keeps every other line (each kind: train,
    overflow, memory, balancer figures...), so the file reads as one run. ``tensorboard_run`` (a
    run id): the same figures also go to TensorBoard under that run name (:mod:`portapipe.metrics.tensorboard_sink`);
    ``sinks``: other writers (``write(record)``, ``close()``) each line goes to after it is written
    (a W&B run, :mod:`portapipe.metrics.wandb_sink`).
    """

    def __init__(self, directory: Path, resume_step: int | None, tensorboard_run: str | None = None, sinks: list[Any] | None = None,
                 every: int = 1) -> None:
        self._sinks = list(sinks or [])
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / METRICS_FILE
        kept: list[str] = []
        if resume_step is not None and self.path.is_file():
            bad, stepped = 0, set()
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    bad += 1  # a line cut short by a crash, or edited
                    continue
                if rec.get("kind") != "summary" and rec.get("step", 0) <= resume_step:
                    kept.append(line)
                    if rec.get("kind") in ("train", "overflow"):
                        stepped.add(rec.get("step"))
            if bad:
                _say(f"{self.path}: {bad} line{'s' * (bad > 1)} that {'are' if bad > 1 else 'is'} not JSON dropped on resume "
                     "(cut short by a crash, or edited)")
            missing = [step for step in range(every, resume_step + 1, every) if step not in stepped]
            if missing:
                _say(f"{self.path}: no row for {len(missing)} of the steps up to {resume_step} that log.every {every} writes "
                     f"(steps {_spans(missing, every)}); the file reads as the run from there on")
        self.path.write_text("".join(k + "\n" for k in kept))
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard_run is not None:
            from .tensorboard_sink import TensorBoardLog

            self._tb = TensorBoardLog(directory, tensorboard_run, [json.loads(k) for k in kept])

    def write(self, record: dict[str, Any]) -> None:
        record = strict(record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.write(record)
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:
            sink.close()


def append_row(directory: Path, record: dict[str, Any]) -> None:
    """One line added to ``<directory>/metrics.jsonl`` while no rank writes it (the launcher's
    ``restart`` rows, between launches): a resume's cut-back keeps it like any row of its step."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / METRICS_FILE, "a") as f:
        f.write(json.dumps(strict(record), allow_nan=False) + "\n")


def _say(line: str) -> None:
    print(f"portapipe: {line}", file=sys.stderr, flush=True)


def _spans(steps: list[int], stride: int) -> str:
    """Sorted steps ``stride`` apart at the least, as runs: ``1-3, 7, 9-12`` (the first five runs)."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + stride:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:5])
    return text + (", ..." if len(spans) > 5 else "")


def strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None: strict JSON (no NaN, no Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value
