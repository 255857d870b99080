"""Work that runs with each step beside the update: a hook is called before a step, after its
update (inside the step's time), once its row is recorded (outside it), and when the run ends.

The loop knows hooks only through :class:`StepHook`'s four points; what they do (write the expert
loads file, record a timeline of chosen steps, profile them) stays theirs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.files import atomic_write
from ..config import Config


class StepHook:
    """Does nothing at each point; a hook overrides the points it needs. ``step`` is 0-based."""

    def before_step(self, step: int) -> None:
        """Before the step's batch is read (collective points are allowed: every rank calls it)."""

    def after_update(self, step: int, last: bool) -> None:
        """After the step's update and the balancer, inside the step's measured time."""

    def after_record(self, step: int, row: dict[str, Any] | None) -> None:
        """After the step's metrics row (None for a skipped step) was made, outside its measured time."""

    def close(self, failing: bool) -> None:
        """The run ended (``failing``: by an error, which this must not hide)."""


class Hooks(StepHook):
    """Several hooks called in order."""

    def __init__(self, hooks: list[StepHook]) -> None:
        self.hooks = hooks

    def before_step(self, step: int) -> None:
        for h in self.hooks:
            h.before_step(step)

    def after_update(self, step: int, last: bool) -> None:
        for h in self.hooks:
            h.after_update(step, last)

    def after_record(self, step: int, row: dict[str, Any] | None) -> None:
        for h in self.hooks:
            h.after_record(step, row)

    def close(self, failing: bool) -> None:
        for h in self.hooks:
            h.close(failing)


def step_hooks(config: Config, balancer: Any, groups: Any, backend: Any) -> list[StepHook]:
    """The hooks a config asks for, in the order they run: the expert loads file (``balancer.kind:
    eplb``), a torch.profiler run of chosen steps (``log.profiler``), a recorded timeline of chosen
    steps (``log.timeline``; after the profiler, so its files are written outside the profiled time)."""
    hooks: list[Any] = [ExpertLoadsFile(config, balancer, groups)] if config.balancer.kind == "eplb" else []
    log = config.log
    if log.profiler.steps:
        from ..timeline.profiler import ProfilerHook

        hooks.append(ProfilerHook(log.profiler, log.dir, backend, groups))
    if log.timeline.steps or log.timeline.every:
        from ..timeline.hook import TimelineHook

        hooks.append(TimelineHook(log.timeline, log.dir, config.to_dict(), backend, groups))
    return hooks


class ExpertLoadsFile(StepHook):
    """balancer.kind: eplb: write the recorded expert loads out for planning.

    The balancer records each step's per-expert loads (this pipeline rank's MoE layers, summed
    over the EP and DP groups) in its window of ``balancer.window`` steps, which checkpoints carry.
    Every ``balancer.interval`` steps and at the end, the window's loads of all layers are
    gathered to rank 0 and written to ``<log.dir>/expert_loads.json`` (``{"step", "window",
    "layers", "loads", "phy2log"}``: the placement in force when written, so the file serves
    ``portapipe balance`` as both ``--loads`` and ``--current``).
    """

    FILE = "expert_loads.json"

    def __init__(self, config: Config, balancer: Any, groups: Any) -> None:
        self.balancer = balancer
        self.interval = config.balancer.interval
        self.path = Path(config.log.dir) / self.FILE
        # One copy of each layer's loads is enough: the ranks at dp = ep = 0 hold them all.
        self.writer_group = groups.pp_group if groups.dp_rank == 0 and groups.ep_rank == 0 else None
        self.is_main = groups.rank == 0

    def after_update(self, step: int, last: bool) -> None:
        """After the balancer recorded (0-based) step ``step``."""
        if self.writer_group is not None and ((step + 1) % self.interval == 0 or last):
            self._write(step + 1)

    def _write(self, step: int) -> None:
        window = self.balancer.load_window
        placement = self.balancer.placement.phy2log.tolist()
        mine = {layer: (loads, placement[i]) for i, (layer, loads) in enumerate(zip(self.balancer.layers, window.loads().tolist()))}
        parts: list[Any] = [None] * torch.distributed.get_world_size(self.writer_group)
        torch.distributed.all_gather_object(parts, mine, group=self.writer_group)
        if self.is_main:
            rows = {layer: row for part in parts for layer, row in part.items()}  # DualPipe copies agree
            layers = sorted(rows)
            record = {"step": step, "window": len(window), "layers": layers, "loads": [rows[i][0] for i in layers],
                      "phy2log": [rows[i][1] for i in layers]}
            atomic_write(self.path, lambda f: f.write(json.dumps(record).encode()))
